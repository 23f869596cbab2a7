"""The fleet rig: a real Redis (Debian's redis-server), Limitador-compatible rate-limit services
on it (the fixture in integration/limitador-rls, built on the `limitador` crate), and Envoys
whose llm-governor shares budgets through them.

    with Redis() as redis, rls_service(redis, limits) as rls:
        envoys = [fleet_envoy(config, sim.port, rls.port) for _ in range(3)]

With LLM_GOVERNOR_LIMITADOR_SERVER=/path/to/limitador-server, `rls_service` starts Kuadrant's
own server (built by whoever runs the tests, outside this repository) instead of the fixture:
same Redis, same limits file, loopback ports. That server has no Reserve / Commit and no fault
injection; `REAL_SERVER` tells the tests which one they talk to.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from harness import (REPO_ROOT, Envoy, HarnessError, Server, accepts, envoy_bootstrap, free_port, governor_filter,
                     http_ok)

RLS_BINARY = REPO_ROOT / "integration" / "limitador-rls" / "target" / "release" / "limitador-rls"
RLS_CLUSTER = "llm_governor_ratelimit"
# Kuadrant's limitador-server, when the run names one (README, "Fleet"): never built or shipped
# by this repository.
LIMITADOR_SERVER = Path(os.environ["LLM_GOVERNOR_LIMITADOR_SERVER"]) if os.environ.get("LLM_GOVERNOR_LIMITADOR_SERVER") else None
REAL_SERVER = LIMITADOR_SERVER is not None


def redis_server() -> str:
    found = shutil.which("redis-server")
    if not found:
        raise HarnessError("redis-server not found: `make test` installs Debian's redis-server (scripts/ensure-fleet-deps.sh)")
    return found


class Redis(Server):
    """redis-server on a free loopback port, no persistence; stop() kills it, start() again
    brings it back on the same port (empty)."""

    what = "redis"
    ready_timeout_s = 10.0
    stop_grace_s = 2.0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def launch(self) -> subprocess.Popen:
        return self.spawn([redis_server(), "--port", self.port, "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--dir", self.workdir])

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class _LimitsService(Server):
    """A rate-limit service on `redis`: its work folder also holds its limits file."""

    ready_timeout_s = 20.0
    stop_grace_s = 2.0

    def __init__(self, redis: Redis, limits_yaml: str):
        super().__init__()
        self.redis = redis
        self.limits_path = self.workdir / "limits.yaml"
        self.limits_path.write_text(limits_yaml)


class RlsService(_LimitsService):
    """One instance of the Limitador-compatible fixture on `redis`, with a limits file: it binds
    port 0 and announces the port."""

    what = "rls"
    announces_port = True

    def __init__(self, redis: Redis, limits_yaml: str, extra_args: Optional[list] = None):
        super().__init__(redis, limits_yaml)
        self.extra_args = list(extra_args or [])

    def launch(self) -> subprocess.Popen:
        if not RLS_BINARY.exists():
            raise HarnessError(f"{RLS_BINARY} missing: `make test` builds it (make rls)")
        return self.spawn([RLS_BINARY, "--listen", "127.0.0.1:0", "--redis", self.redis.url,
                           "--limits", self.limits_path, "--rate-limit-headers", "DRAFT_VERSION_03",
                           *self.extra_args], stdout=subprocess.PIPE)


class LimitadorServer(_LimitsService):
    """One instance of Kuadrant's limitador-server on `redis` (plain `redis` storage, so several
    instances share counters), with a limits file: gRPC (RLS) and its HTTP API on free loopback
    ports, draft-03 rate-limit headers on, as envoy/fleet.yaml documents it."""

    what = "limitador"

    def __init__(self, redis: Redis, limits_yaml: str, extra_args: Optional[list] = None):
        if extra_args:
            raise HarnessError(f"limitador-server has no fixture flags {extra_args}")
        super().__init__(redis, limits_yaml)
        self.http_port: Optional[int] = None
        self.paused = False

    def choose_ports(self) -> None:
        self.port, self.http_port = free_port(), free_port()

    def command(self, port: int, http_port: int) -> list:
        assert LIMITADOR_SERVER is not None
        return [str(LIMITADOR_SERVER), "--rls-ip", "127.0.0.1", "--rls-port", str(port),
                "--http-ip", "127.0.0.1", "--http-port", str(http_port),
                "--rate-limit-headers", "DRAFT_VERSION_03", str(self.limits_path),
                "redis", self.redis.url]

    def launch(self) -> subprocess.Popen:
        if LIMITADOR_SERVER is None or not os.access(LIMITADOR_SERVER, os.X_OK):
            raise HarnessError(f"LLM_GOVERNOR_LIMITADOR_SERVER={LIMITADOR_SERVER}: not an executable")
        # Its defaults also come from the environment (LIMITS_FILE, REDIS_URL, ENVOY_RLS_PORT,
        # ...): it gets none of ours.
        env = {"PATH": os.environ.get("PATH", ""), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        return self.spawn(self.command(self.port, self.http_port), env=env)

    def ready(self) -> bool:
        """Its HTTP API answers /status and the RLS port takes connections."""
        return accepts(self.port) and http_ok(f"http://127.0.0.1:{self.http_port}/status")

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a service slower than any timeout)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def _halt(self) -> None:
        self.resume()
        super()._halt()


def rls_service(redis: Redis, limits_yaml: str, extra_args: Optional[list] = None):
    """The rate-limit service of a fleet test: Kuadrant's limitador-server when
    LLM_GOVERNOR_LIMITADOR_SERVER names one, else the fixture."""
    if REAL_SERVER:
        return LimitadorServer(redis, limits_yaml, extra_args)
    return RlsService(redis, limits_yaml, extra_args)


def validate_limits(limits_yaml: str) -> str:
    """`limitador-server --validate`: what the real server makes of a limits file (its parsed
    limits as YAML); HarnessError with its message when it refuses the file."""
    assert LIMITADOR_SERVER is not None
    with tempfile.TemporaryDirectory(prefix="llm-governor-limits-") as d:
        path = Path(d) / "limits.yaml"
        path.write_text(limits_yaml)
        done = subprocess.run([str(LIMITADOR_SERVER), "--validate", str(path)], capture_output=True,
                              text=True, timeout=30, env={"PATH": os.environ.get("PATH", "")})
    if done.returncode != 0:
        raise HarnessError(f"limitador-server --validate refused the file: {done.stderr.strip()}")
    return done.stdout


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


# The rate fields of a limit (README "Configuration"), each a window's amount.
RATE_FIELDS = ("requests_per_minute", "requests_per_day", "tokens_per_minute", "tokens_per_day",
               "input_tokens_per_minute", "output_tokens_per_minute")


def limits_file(config: dict) -> str:
    """The Limitador limits file for a filter configuration's fleet limits, written from the
    contract's descriptor shape: one limit per fleet limit, matched on descriptors[0]['limit'],
    counted per descriptors[0]['key'], namespace = the fleet's domain; a fleet cap's guard
    beside its cap."""
    domain = config.get("fleet", {}).get("domain", "llm_governor")
    out = []
    for limit in config.get("limits", []):
        if limit.get("scope") != "fleet":
            continue
        # The one rate field a limit has, and its window. A fleet max_in_flight's slots are
        # holds given back with a Commit of 0: its window only bounds a hold's life, so long.
        field = next(f for f in RATE_FIELDS + ("max_in_flight",) if f in limit)
        seconds = {"max_in_flight": 86400}.get(field, 86400 if field.endswith("_per_day") else 60)
        # A fleet cap's slots hold its guard too, the same limit matched on 'guard' (README,
        # "A fleet-wide cap"): one stays held while the other is taken again.
        names = [("limit", limit["name"])]
        if field == "max_in_flight":
            names.append(("guard", f"{limit['name']}-guard"))
        for entry, name in names:
            out.append(
                f"- namespace: {domain}\n"
                f"  name: {name}\n"
                f"  max_value: {limit[field]}\n"
                f"  seconds: {seconds}\n"
                f"  conditions: [\"descriptors[0]['{entry}'] == '{limit['name']}'\"]\n"
                f"  variables: [\"descriptors[0]['key']\"]\n"
            )
    if config.get("fleet", {}).get("cooldowns"):
        out.append(turn_limit(domain))
    return "".join(out)


# The limit a fleet's shared cooldowns take turns on (README, `fleet.cooldowns`): one hold at a
# time per (pool, account), so the service runs with `--max-reservation-fraction 1`
# (TURN_SERVICE_ARGS). Holds are given back with a Commit of 0: the window never fills.
TURN_SERVICE_ARGS = ["--max-reservation-fraction", "1"]


def turn_limit(domain: str) -> str:
    return (
        "# fleet cooldowns\n"
        f"- namespace: {domain}\n"
        "  name: llm_governor_turn\n"
        "  max_value: 1\n"
        "  seconds: 3600\n"
        "  conditions: [\"descriptors[0]['limit'] == 'llm_governor_turn'\"]\n"
        "  variables: [\"descriptors[0]['key']\"]\n"
        # An Envoy that cools a (pool, account) hits this every 250 ms; the others check it.
        f"- namespace: {domain}\n"
        "  name: llm_governor_cooling\n"
        "  max_value: 1\n"
        "  seconds: 1\n"
        "  conditions: [\"descriptors[0]['limit'] == 'llm_governor_cooling'\"]\n"
        "  variables: [\"descriptors[0]['key']\"]\n"
    )
