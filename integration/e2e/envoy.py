"""A real Envoy with llm-governor of either artifact, on ports it binds itself (port 0, read
back from its admin address file and admin API), and what can be read from it: stats by the
wasm name whichever artifact runs, Prometheus text, logs, access logs, memory.

Stopping it fails when its log shows a `[critical]` wasm line (or a bug the native module's
hooks caught)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any, Optional, Union

import requests

from artifacts import artifact_of, find_envoy, module_of
from bootstrap import envoy_bootstrap, native_filter, wasm_filter
from processes import HarnessError, Server, http_ok, wait_for
from stats import POOL_STAT_PREFIX, full_stat_name, wasm_stat_name

READY_TIMEOUT_S = 20.0

# Distinct --base-id values so several Envoys (and `make run`) can run at once: each base id
# names its own shared-memory region for hot restart.
_base_ids = itertools.count((os.getpid() % 5000) * 100 + 1000)


class Envoy(Server):
    """A real Envoy with llm-governor (or, with plugin_config=None, no governor filter at all).

    The listener and admin bind port 0; the bound ports are read back from the admin API, so
    there is no window in which another process can take them.
    """

    what = "envoy"
    announces_port = True

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
        super().__init__()  # the work folder: once nothing above can fail
        self.config_path = self.workdir / ("envoy.yaml" if isinstance(bootstrap, str) else "envoy.json")
        self.access_log_path = self.workdir / "access.log"
        self.admin_address_path = self.workdir / "admin.address"
        self.admin_port: Optional[int] = None
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

    def launch(self) -> subprocess.Popen:
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
        # Envoy writes its own log (--log-path); what it prints is not needed.
        return subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            env={**os.environ, **self.env} if self.env else None,
        )

    def _admin_address(self) -> str:
        return self.admin_address_path.read_text().strip() if self.admin_address_path.exists() else ""

    def read_announcement(self, deadline: float) -> bool:
        """Envoy's announcement is its admin address, written to admin_address_path."""
        proc = self.proc
        assert proc is not None
        wait_for(lambda: proc.poll() is not None or self._admin_address(), max(0.0, deadline - time.monotonic()))
        address = self._admin_address()
        if proc.poll() is not None or not address:
            return False
        self.admin_port = int(address.rsplit(":", 1)[1])
        return True

    def ready(self) -> bool:
        return http_ok(self.admin_url + "/ready")

    def _listener_port(self) -> int:
        listeners = requests.get(self.admin_url + "/listeners?format=json", timeout=2).json()
        for listener in listeners.get("listener_statuses", []):
            socket_address = listener.get("local_address", {}).get("socket_address", {})
            if socket_address.get("port_value"):
                return int(socket_address["port_value"])
        raise HarnessError(f"no bound listener reported: {listeners}")

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "Envoy":
        super().start(timeout_s)
        self.port = self._listener_port()
        return self

    def start_expecting_failure(self, timeout_s: float = 15.0) -> "StartFailure":
        """Starts Envoy with a configuration it should refuse.

        Returns how it failed: it exited (exit_code set), or its listener never became ready
        within timeout_s (ready False). Raises if Envoy does come up ready.
        """
        self.proc = self.launch()
        ready = self.await_ready(time.monotonic() + timeout_s)
        exit_code = self.settled_exit_code()
        self.stop(check=False)
        failure = StartFailure(exit_code=exit_code, ready=ready, log=self.log())
        log_tail = self.log_tail()
        self.cleanup()
        if ready:
            raise HarnessError(f"Envoy became ready with a configuration it should refuse:\n{log_tail}")
        return failure

    def stop(self, check: bool = True) -> None:
        """Stops Envoy; with check, fails if the log shows a [critical] wasm line."""
        self._halt()
        if check:
            critical = self.critical_wasm_lines()
            if critical:
                raise HarnessError("Envoy logged critical wasm lines:\n" + "\n".join(critical))

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
        full = full_stat_name(name, self.native)
        return self.stats(filter_regex="^" + re.escape(full) + "$").get(full, default)

    def pool_stat(self, pool: str, name: str) -> int:
        """The governor's stat `name` of `pool` (`held`, `upstream_rate_limited`, ...) as a
        number, whichever artifact runs; 0 before it is first written."""
        return int(self.stat(f"{POOL_STAT_PREFIX}{pool}.{name}") or 0)

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


