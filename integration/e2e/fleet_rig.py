"""The fleet rig: a real Redis (Debian's redis-server), Limitador-compatible rate-limit services
on it (the fixture in integration/limitador-rls, built on the `limitador` crate), and Envoys
whose llm-governor shares budgets through them.

    with Redis() as redis, RlsService(redis, limits) as rls:
        envoys = [fleet_envoy(config, sim.port, rls.port) for _ in range(3)]
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


from harness import REPO_ROOT, Envoy, HarnessError, envoy_bootstrap, free_port, governor_filter, terminate

RLS_BINARY = REPO_ROOT / "integration" / "limitador-rls" / "target" / "release" / "limitador-rls"
RLS_CLUSTER = "llm_governor_ratelimit"


def redis_server() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise HarnessError("redis-server not found: `make test` installs Debian's redis-server (scripts/ensure-fleet-deps.sh)")
    return found


class _Process:
    """A server process of the rig: stop() ends it; a `with` block starts and stops it."""

    proc: Optional[subprocess.Popen] = None

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        terminate(self.proc, grace_s=2.0)
        self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Redis(_Process):
    """redis-server on a free loopback port, no persistence; stop() kills it, start() again
    brings it back on the same port (empty)."""

    def __init__(self):
        self.port = free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-governor-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> "Redis":
        self.proc = subprocess.Popen(
            [redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                import socket

                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise HarnessError("redis-server did not answer PING")

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class RlsService(_Process):
    """One instance of the Limitador-compatible fixture on `redis`, with a limits file."""

    def __init__(self, redis: Redis, limits_yaml: str, extra_args: Optional[list] = None):
        self.redis = redis
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-governor-rls-"))
        self.limits_path = self.workdir / "limits.yaml"
        self.limits_path.write_text(limits_yaml)
        self.extra_args = list(extra_args or [])
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.log_path = self.workdir / "rls.log"

    def start(self, port: int = 0) -> "RlsService":
        if not RLS_BINARY.exists():
            raise HarnessError(f"{RLS_BINARY} missing: `make test` builds it (make rls)")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(RLS_BINARY), "--listen", f"127.0.0.1:{port}", "--redis", self.redis.url,
             "--limits", str(self.limits_path), "--rate-limit-headers", "DRAFT_VERSION_03",
             *self.extra_args],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )
        deadline = time.time() + 20
        assert self.proc.stdout is not None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise HarnessError(f"limitador-rls exited: {self.log_path.read_text()[-2000:]}")
                continue
            if "listening on" in line:
                self.port = int(line.strip().rsplit(":", 1)[1])
                return self
        raise HarnessError("limitador-rls did not say it listens")


def rls_cluster(port: int, name: str = RLS_CLUSTER) -> dict:
    """The operator's cluster for the rate-limit service: HTTP/2 (gRPC) to 127.0.0.1:port."""
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}],
        },
    }


# Every replica of a fleet keys its ids with the same secret (README, "Keyed ids"), so an
# account-keyed fleet limit is one key at the service whichever replica asks.
FLEET_HASH_KEY = "fleet-rig-shared-hash-key-0123456789"


def fleet_envoy(plugin_config: dict, upstream_port: int, rls_port: int, concurrency: int = 1,
                artifact: Optional[str] = None, **kwargs) -> Envoy:
    """An Envoy whose llm-governor (of `artifact`; None: the environment's) calls the rate-limit
    service on rls_port."""
    bootstrap = envoy_bootstrap(
        upstream_port,
        # (The native module reads the key from Envoy's environment; the wasm VM is given it.)
        [governor_filter(plugin_config, artifact=artifact, host_env_keys=["LLM_GOVERNOR_HASH_KEY"])],
        extra_clusters=[rls_cluster(rls_port)],
    )
    kwargs.setdefault("env", {"LLM_GOVERNOR_HASH_KEY": FLEET_HASH_KEY})
    return Envoy(plugin_config, upstream_port, concurrency=concurrency, bootstrap=bootstrap, artifact=artifact,
                 **kwargs)


def limits_file(config: dict) -> str:
    """The Limitador limits file for a filter configuration's fleet limits, written from the
    contract's descriptor shape: one limit per fleet limit, matched on descriptors[0]['limit'],
    counted per descriptors[0]['key'], namespace = the fleet's domain."""
    domain = config.get("fleet", {}).get("domain", "llm_governor")
    out = []
    for limit in config.get("limits", []):
        if limit.get("scope") != "fleet":
            continue
        amount = limit.get("requests_per_minute") or limit.get("tokens_per_minute")
        out.append(
            f"- namespace: {domain}\n"
            f"  name: {limit['name']}\n"
            f"  max_value: {amount}\n"
            f"  seconds: 60\n"
            f"  conditions: [\"descriptors[0]['limit'] == '{limit['name']}'\"]\n"
            f"  variables: [\"descriptors[0]['key']\"]\n"
        )
    return "".join(out)
