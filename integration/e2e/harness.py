"""End-to-end harness: the provider simulator and real Envoy processes on free loopback ports.

Reusable by every end-to-end test, benchmark and storm run:

    with Simulator() as sim, Envoy({"pools": [...]}, upstream_port=sim.port) as envoy:
        r = post(envoy, new_key())
        envoy.pool_stat("openai", "upstream_rate_limited")

Only the standard library and `requests` are used, so anything that can import this module can
drive it. Every process started here is stopped by `stop()` and its work folder removed by
`cleanup()` (both via `with`), and an Envoy whose log shows a `[critical]` wasm line (or a
caught bug of the native module) fails on stop.

One suite, two artifacts: LLM_GOVERNOR_ARTIFACT=wasm (default: the proxy-wasm module) or
native (the Envoy dynamic module, target/release/libllm_governor.so). `governor_filter(...)`
builds the filter entry of the artifact under test, and `Envoy.stat()` takes the wasm stat name
(`llm_governor.pool.<pool>.<stat>`) and reads the native module's labelled stat for it. A
benchmark that compares the two in one process passes `artifact="wasm"|"native"` to `Envoy`,
`governor_filter` and `failover_bootstrap` instead (None: the environment's).

This module only gathers the names; each job has its own:

| module | job |
|---|---|
| `processes.py` | `Server` (start, readiness, stop, `with`, work folder, log), ports, `wait_for` |
| `artifacts.py` | built modules and binaries, the artifact under test, `wasm_only`/`native_only` |
| `stats.py` | stat names and Prometheus series of either artifact |
| `bootstrap.py` | filter entries and Envoy bootstraps |
| `envoy.py` | `Envoy` |
| `upstreams.py` | `Simulator` and `RawUpstream` |
| `calls.py` | keys, requests in each dialect, `post`, `cool`, `post_concurrently` |
"""

from artifacts import (ARTIFACT, ARTIFACTS, GOVERNOR_MODULE, NATIVE, NATIVE_MODULE, NO_STOP_ITERATION_OPTION,
                       PROMETHEUS_LABELS, REPO_ROOT, SIM_BINARY, WASM_MODULE, artifact_of, find_envoy, module_of,
                       native_only, wasm_only)
from bootstrap import envoy_bootstrap, failover_bootstrap, governor_filter, native_filter, wasm_filter
from calls import CHAT, CHAT_PATH, Reply, cool, new_key, post, post_concurrently, request_in
from envoy import READY_TIMEOUT_S, Envoy, StartFailure
from processes import HarnessError, Server, accepts, free_port, http_ok, terminate, wait_for, wait_http_ok
from stats import (HISTOGRAMS, NATIVE_PROMETHEUS_PREFIX, STATS_TAGS, WASM_PROMETHEUS_PREFIX, missing_native_twins,
                   native_family, native_metric, native_stat_name, prometheus_series, wasm_stat_name)
from upstreams import RawUpstream, Simulator

__all__ = [
    "ARTIFACT", "ARTIFACTS", "CHAT", "CHAT_PATH", "GOVERNOR_MODULE", "HISTOGRAMS", "NATIVE", "NATIVE_MODULE",
    "NATIVE_PROMETHEUS_PREFIX", "NO_STOP_ITERATION_OPTION", "PROMETHEUS_LABELS", "READY_TIMEOUT_S", "REPO_ROOT",
    "SIM_BINARY", "STATS_TAGS", "WASM_MODULE", "WASM_PROMETHEUS_PREFIX",
    "Envoy", "HarnessError", "RawUpstream", "Reply", "Server", "Simulator", "StartFailure",
    "accepts", "artifact_of", "cool", "envoy_bootstrap", "failover_bootstrap", "find_envoy", "free_port",
    "governor_filter", "http_ok", "missing_native_twins", "module_of", "native_family", "native_filter",
    "native_metric", "native_only", "native_stat_name", "new_key", "post", "post_concurrently", "prometheus_series",
    "request_in", "terminate", "wait_for", "wait_http_ok", "wasm_filter", "wasm_only", "wasm_stat_name",
]
