"""The storm harness core: gateways, real clients and the figures, shared by `make storm`
(bench/storm/storm.py) and the end-to-end test (integration/e2e/test_storm.py).

Standard library, `requests` and the `openai` SDK only (no plotting), so the test can import it.

Definitions used by every figure (also in BENCHMARKS.md):

- t = 0 is the instant the clients are released (all at once). Upstream times are the
  simulator's `unix_ms` of each provider request, relative to t = 0.
- Cold first wave: the upstream requests that are among the first N to arrive (N = number of
  clients) AND arrive within FIRST_WAVE_MS (100 ms) of the first upstream request. These are sent before any answer can be
  known to anyone and cannot be helped. Every other upstream request is "after the first wave".
- Cooldown round (the filter's behaviour, src/policy.rs): an upstream 429 that arrives when no
  cooldown is in force opens a round; the filter cools (pool, account) until
  t(429) + the provider's delay (what the 429 said: `retry-after-ms`, else `retry-after`), and a
  further 429 that arrives before that deadline belongs to the same round and can only push the
  deadline later (re-cooling keeps the later deadline). The round ends at its deadline; the next
  upstream 429 at or after it opens the next round. Preemptive cooldowns (a 2xx with remaining
  0) are not rounds: they produce no 429. The provider's delay of each 429 is recomputed from the
  request log with the simulator's exact rule (sliding window that counts rejected requests, or
  the scenario's `retry_after_s`), rounded as the chosen `retry_after` style sends it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import requests

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "integration" / "e2e"))

from harness import Envoy, HarnessError, Simulator, envoy_bootstrap, free_port, wasm_filter  # noqa: E402

FIRST_WAVE_MS = 100.0
MODEL = "gpt-4o-mini"
MESSAGES = [{"role": "user", "content": "hi"}]
LITELLM_VENV = REPO_ROOT / "bench" / ".venv-litellm"

GOVERNOR_CONFIG = {"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]}
# (f): the same with `retry_after.escalate`, which stretches what clients are told after a
# cooldown round whose probe failed (off by default).
GOVERNOR_ESCALATE_CONFIG = {**GOVERNOR_CONFIG, "retry_after": {"escalate": True}}

CONFIG_NAMES = {
    "a": "no gateway",
    "b": "Envoy retry 429 x3",
    "c": "Envoy rate_limited_retry_back_off",
    "d": "LiteLLM num_retries=3",
    "e": "Envoy + llm-governor",
    "f": "Envoy + llm-governor, escalate",
}


# --------------------------------------------------------------------------------------------
# Scenarios: what the provider does


@dataclass
class Phase:
    """One simulator scenario, posted at `at_ms` after t = 0 (the first at t = 0)."""

    scenario: dict
    at_ms: float = 0.0


@dataclass
class Storm:
    name: str
    title: str
    clients: int
    phases: list
    # "sdk": the openai SDK with max_retries=3 and its own schedule.
    # "fixed": the published Strategy C schedule. "obey": retry-after-ms as the SDKs read it.
    client_kind: str = "sdk"
    max_attempts: int = 4
    budget_ms: Optional[float] = None
    # When the provider recovers (t, ms), for "time to first success after recovery".
    recovers_at_ms: Optional[float] = None
    # For the replay: the throttled window is [0, recovers_at_ms).
    seed: int = 107
    run_timeout_s: float = 45.0


ISSUE3 = Storm(
    name="issue3",
    title="issue 3: 20 SDK clients, limit 5 req / 3 s (rejected count), one key",
    clients=20,
    phases=[Phase({"limit": {"requests": 5, "window_ms": 3000}})],
)

# The same storm with the hint also in `retry-after-ms` (as Azure OpenAI sends it): the
# deadlines then end exactly when one slot of the window frees, and returning clients that
# collide there cost more late 429s than with whole seconds (see BENCHMARKS.md).
ISSUE3_MS = Storm(
    name="issue3-ms",
    title="issue 3, provider hint also in retry-after-ms: 20 SDK clients, limit 5 req / 3 s, one key",
    clients=20,
    phases=[Phase({"limit": {"requests": 5, "window_ms": 3000}, "retry_after": "both"})],
)

# A sustained 429 window, then a request limit: the provider answers every request with 429
# and `retry-after: 1` for 2.5 s (it under-states how long it stays down), then admits 10
# requests per 2 s window, counting rejected ones.
ISSUE5 = Storm(
    name="issue5",
    title="issue 5: 20 SDK clients, 429 for 2.5 s (retry-after: 1), then limit 10 req / 2 s",
    clients=20,
    phases=[
        Phase({"mode": "rate_limited", "retry_after_s": 1.0, "until_ms": 10_000}),
        Phase({"limit": {"requests": 10, "window_ms": 2000}}, at_ms=2500),
    ],
    recovers_at_ms=2500,
)


def replay(client_kind: str, style: str) -> Storm:
    """The published replay: 120 clients at t = 0, every request 429 until 2,000 ms (the
    provider says 2 s), at most 4 attempts, 2,500 ms total budget."""
    return Storm(
        name=f"replay-{client_kind}-{style}",
        title=f"replay, {'Strategy C fixed schedule' if client_kind == 'fixed' else 'clients obey retry-after-ms'}, provider hint in {style}",
        clients=120,
        phases=[Phase({"mode": "rate_limited", "until_ms": 2000, "retry_after": style, "retry_after_s": 2.0})],
        client_kind=client_kind,
        budget_ms=2500,
        recovers_at_ms=2000,
        run_timeout_s=20,
    )


SCENARIOS = {
    "issue3": lambda: [ISSUE3, ISSUE3_MS],
    "issue5": lambda: [ISSUE5],
    "replay": lambda: [replay("fixed", "ms"), replay("obey", "ms"), replay("fixed", "seconds"), replay("obey", "seconds")],
}


# --------------------------------------------------------------------------------------------
# Gateways


class Gateway:
    key = ""
    name = ""

    def base_url(self) -> str:
        raise NotImplementedError

    def client_key(self, fresh: str) -> str:
        """The key clients send (a fresh one per run unless the gateway needs its own)."""
        return fresh

    def upstream_key(self, client_key: str) -> str:
        """The key the provider sees for a client key."""
        return client_key

    def start(self) -> "Gateway":
        return self

    def stop(self) -> None:
        pass

    def info(self) -> dict:
        return {}


class Direct(Gateway):
    key, name = "a", CONFIG_NAMES["a"]

    def __init__(self, sim: Simulator):
        self.sim = sim

    def base_url(self) -> str:
        return self.sim.url + "/v1"


def retry_bootstrap(upstream_port: int, http_filters: list, rate_limited_back_off: bool) -> dict:
    """The harness's bootstrap with a route retry policy on 429 (configurations b and c)."""
    boot = envoy_bootstrap(upstream_port, http_filters)
    policy: dict = {
        "retry_on": "retriable-status-codes",
        "retriable_status_codes": [429],
        "num_retries": 3,
    }
    if rate_limited_back_off:
        policy["rate_limited_retry_back_off"] = {
            "reset_headers": [
                {"name": "retry-after", "format": "SECONDS"},
                {"name": "x-ratelimit-reset", "format": "UNIX_TIMESTAMP"},
            ],
            "max_interval": "10s",
        }
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"] = policy
    return boot


class EnvoyGateway(Gateway):
    def __init__(self, key: str, sim: Simulator, concurrency: int = 2):
        self.key, self.name = key, CONFIG_NAMES[key]
        if key in "ef":
            config = GOVERNOR_CONFIG if key == "e" else GOVERNOR_ESCALATE_CONFIG
            self.envoy = Envoy(config, upstream_port=sim.port, concurrency=concurrency)
        else:
            boot = retry_bootstrap(sim.port, [], rate_limited_back_off=(key == "c"))
            self.envoy = Envoy(None, upstream_port=sim.port, concurrency=concurrency, bootstrap=boot)

    def start(self) -> "EnvoyGateway":
        self.envoy.start()
        return self

    def stop(self) -> None:
        self.envoy.stop(check=True)

    def base_url(self) -> str:
        return self.envoy.url + "/v1"

    def info(self) -> dict:
        wanted = ("upstream_rate_limited", "local_reject_cooldown", "preemptive_cooldown")
        stats = self.envoy.stats()
        out = {k: v for k, v in stats.items() if k.startswith("wasmcustom.") and any(w in k for w in wanted)}
        out["cluster.provider.upstream_rq_retry"] = stats.get("cluster.provider.upstream_rq_retry", 0)
        out["cluster.provider.upstream_rq_total"] = stats.get("cluster.provider.upstream_rq_total", 0)
        return out


class LiteLLMUnavailable(RuntimeError):
    pass


class LiteLLMGateway(Gateway):
    """LiteLLM's proxy (bench/.venv-litellm) with num_retries: 3, one deployment, one key."""

    key, name = "d", CONFIG_NAMES["d"]
    UPSTREAM_KEY = "sk-storm-litellm"

    def __init__(self, sim: Simulator, ready_timeout_s: float = 90.0):
        self.sim = sim
        self.ready_timeout_s = ready_timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.workdir = Path(tempfile.mkdtemp(prefix="storm-litellm-"))
        self.log_path = self.workdir / "litellm.log"
        # LiteLLM refuses to start without a master key; clients present it.
        self.master_key = "sk-storm-master-" + uuid.uuid4().hex

    def client_key(self, fresh: str) -> str:
        return self.master_key

    def upstream_key(self, client_key: str) -> str:
        return self.UPSTREAM_KEY

    def start(self) -> "LiteLLMGateway":
        exe = LITELLM_VENV / "bin" / "litellm"
        if not exe.exists():
            raise LiteLLMUnavailable(f"{exe} missing: run bench/storm/ensure-litellm.sh")
        config = self.workdir / "litellm.yaml"
        # JSON is YAML: no PyYAML needed on this side.
        config.write_text(json.dumps({
            "model_list": [{
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": self.sim.url + "/v1",
                    "api_key": self.UPSTREAM_KEY,
                },
            }],
            "litellm_settings": {"num_retries": 3, "request_timeout": 30, "telemetry": False},
            "router_settings": {"num_retries": 3},
            "general_settings": {"master_key": self.master_key},
        }, indent=1))
        self.port = free_port()
        env = dict(os.environ)
        env.update({
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # offline: no fetch of the cost map
            "LITELLM_TELEMETRY": "False",
            "DISABLE_SCHEMA_UPDATE": "True",
            "NO_DOCS": "True",
        })
        env.pop("DATABASE_URL", None)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(self.port),
                 "--num_workers", "1"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.workdir,
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LiteLLMUnavailable(f"LiteLLM exited {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health/liveliness", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.25)
        self.stop()
        raise LiteLLMUnavailable(f"LiteLLM not ready after {self.ready_timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def info(self) -> dict:
        return {"version": litellm_version()}


def litellm_version() -> str:
    py = LITELLM_VENV / "bin" / "python"
    if not py.exists():
        return ""
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip()


def make_gateway(key: str, sim: Simulator, concurrency: int = 2) -> Gateway:
    if key == "a":
        return Direct(sim)
    if key == "d":
        return LiteLLMGateway(sim)
    return EnvoyGateway(key, sim, concurrency)


# --------------------------------------------------------------------------------------------
# Clients


@dataclass
class Attempt:
    t_ms: float  # when the answer arrived, relative to t = 0
    status: int
    source: str  # x-llm-governor-source, or "" when absent
    retry_after_ms: Optional[float]


@dataclass
class CallResult:
    client: int
    ok: bool
    start_ms: float
    end_ms: float
    error: str = ""
    attempts: list = field(default_factory=list)


def _retry_after_s(headers) -> Optional[float]:
    """The SDKs' reading: `retry-after-ms`, then `retry-after` in seconds (or an HTTP date)."""
    for name, div in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        v = headers.get(name)
        if v is None:
            continue
        try:
            return float(v) / div
        except ValueError:
            continue
    import email.utils

    v = headers.get("retry-after")
    try:
        parsed = email.utils.parsedate_tz(v) if v else None
    except (TypeError, ValueError):
        parsed = None
    if parsed is None:
        return None
    return max(0.0, email.utils.mktime_tz(parsed) - time.time())


def strategy_c_delay_ms(attempt: int, rng: random.Random) -> float:
    """The published schedule: min(250 * 2^(attempt-1) + rand(0, 250), 1500)."""
    return min(250 * (2 ** (attempt - 1)) + rng.randrange(0, 251), 1500)


def sdk_backoff_s(retries_done: int, max_retries: int = 3) -> float:
    """openai-python's fallback when no hint: 0.5 s * 2^n, capped 8 s, minus up to 25 %."""
    return min(0.5 * 2.0 ** retries_done, 8.0) * (1 - 0.25 * random.random())


class RawClient:
    """One keep-alive HTTP/1.1 connection sending a pre-encoded chat completion.

    The replay's 120 clients must really start together: building 120 SDK requests in one
    Python process takes hundreds of ms on this machine, which would smear the first wave past
    what the published fixture means by "120 clients start at t = 0". The replay clients are
    not SDK clients anyway (their schedule is the point), so they send bytes prepared before
    t = 0 and read status and headers exactly as the SDKs interpret them.
    """

    def __init__(self, base_url: str, api_key: str):
        from urllib.parse import urlsplit

        u = urlsplit(base_url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        body = json.dumps({"model": MODEL, "messages": MESSAGES}).encode()
        self.request = (
            f"POST {u.path.rstrip('/')}/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader = self.writer = None

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def call(self) -> tuple:
        """(status, lower-cased headers) of one request; reconnects once if the peer closed."""
        for attempt in range(2):
            try:
                if self.writer is None:
                    await self.connect()
                self.writer.write(self.request)
                await self.writer.drain()
                head = await self.reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split()[1])
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                if "content-length" in headers:
                    await self.reader.readexactly(int(headers["content-length"]))
                elif headers.get("transfer-encoding", "").lower() == "chunked":
                    while True:
                        size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        await self.reader.readexactly(size + 2)
                        if size == 0:
                            break
                if headers.get("connection", "").lower() == "close":
                    await self.close()
                return status, headers
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                await self.close()
                if attempt:
                    raise
        raise ConnectionError("unreachable")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        self.reader = self.writer = None


async def _run_clients(storm: Storm, base_url: str, api_key: str, t0_holder: list,
                       on_release: Callable[[], None] = lambda: None) -> list:
    import openai

    n = storm.clients
    results: list = [None] * n
    attempts: list = [[] for _ in range(n)]
    rng = random.Random(storm.seed)
    # Strategy C draws: client-major order from one generator seeded 107, so a run is reproducible.
    schedule_draws = [[rng.randrange(0, 251) for _ in range(storm.max_attempts)] for _ in range(n)]

    warm = [True]

    def hook_for(i: int):
        async def on_response(response):
            if warm[0]:
                return
            attempts[i].append(Attempt(
                t_ms=time.monotonic() * 1000 - t0_holder[0],
                status=response.status_code,
                source=response.headers.get("x-llm-governor-source", ""),
                retry_after_ms=(lambda s: None if s is None else s * 1000)(_retry_after_s(response.headers)),
            ))
        return on_response

    sdk_retries = 3 if storm.client_kind == "sdk" else 0
    clients = [] if storm.client_kind != "sdk" else [
        openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, max_retries=sdk_retries, timeout=30.0,
            http_client=openai.DefaultAsyncHttpx2Client(event_hooks={"response": [hook_for(i)]}),
        )
        for i in range(n)
    ]
    # Warm every client before t = 0: the SDK's first call builds its machinery and opens the
    # connection, which otherwise spreads the "simultaneous" first wave over hundreds of ms.
    # GET /v1/models is a 404 at the simulator (never logged) and an ungoverned path for the
    # filter; LiteLLM answers it itself.

    async def warm_up(c):
        try:
            await c.models.list()
        except Exception:  # noqa: BLE001 - only the side effects matter
            pass

    await asyncio.gather(*(warm_up(c) for c in clients))
    warm[0] = False
    go = asyncio.Event()

    async def one_sdk_call(i: int):
        await go.wait()
        start = time.monotonic() * 1000 - t0_holder[0]
        try:
            await clients[i].chat.completions.create(model=MODEL, messages=MESSAGES)
            results[i] = CallResult(i, True, start, time.monotonic() * 1000 - t0_holder[0])
        except Exception as err:  # noqa: BLE001 - every failure is a data point
            results[i] = CallResult(i, False, start, time.monotonic() * 1000 - t0_holder[0], type(err).__name__)

    raw = [RawClient(base_url, api_key) for _ in range(n)] if storm.client_kind != "sdk" else []
    if raw:
        await asyncio.gather(*(c.connect() for c in raw))

    async def one_scheduled_call(i: int):
        """At most max_attempts attempts inside budget_ms, on the fixed or the obeying schedule."""
        await go.wait()
        start = time.monotonic() * 1000 - t0_holder[0]
        scheduled = 0.0
        err_name = ""
        for attempt in range(1, storm.max_attempts + 1):
            now = time.monotonic() * 1000 - t0_holder[0]
            if scheduled > now:
                await asyncio.sleep((scheduled - now) / 1000)
            left_s = None
            if storm.budget_ms is not None:
                left_s = max(0.001, (storm.budget_ms - (time.monotonic() * 1000 - t0_holder[0])) / 1000)
            try:
                # The budget is total: an answer that comes after it is a failure, whoever held it.
                status, headers = await asyncio.wait_for(raw[i].call(), timeout=left_s)
            except asyncio.TimeoutError:
                await raw[i].close()
                err_name = "budget expired waiting for an answer"
                break
            except (ConnectionError, OSError, asyncio.IncompleteReadError) as err:
                status, headers, err_name = 0, {}, type(err).__name__
            t = time.monotonic() * 1000 - t0_holder[0]
            if status:
                ra = _retry_after_s(headers)
                attempts[i].append(Attempt(t, status, headers.get("x-llm-governor-source", ""),
                                           None if ra is None else ra * 1000))
            if 200 <= status < 300:
                results[i] = CallResult(i, True, start, t)
                return
            err_name = f"HTTP {status}" if status else err_name
            if headers.get("x-should-retry") == "false":
                break
            if storm.client_kind == "fixed":
                # The published replay schedules from the attempt's scheduled time.
                nxt = scheduled + min(250 * (2 ** (attempt - 1)) + schedule_draws[i][attempt - 1], 1500)
            else:
                hint = _retry_after_s(headers)
                delay_s = hint if hint is not None and 0 < hint <= 120 else sdk_backoff_s(attempt - 1)
                nxt = t + delay_s * 1000
            if attempt == storm.max_attempts:
                break
            if storm.budget_ms is not None and nxt > storm.budget_ms:
                err_name += " (next attempt past budget)"
                break
            scheduled = nxt
        results[i] = CallResult(i, False, start, time.monotonic() * 1000 - t0_holder[0], err_name)

    body = one_sdk_call if storm.client_kind == "sdk" else one_scheduled_call
    tasks = [asyncio.create_task(body(i)) for i in range(n)]
    await asyncio.sleep(0.05)  # every task parked on the event
    on_release()  # the provider's scenario clock starts here, with the clients
    t0_holder[0] = time.monotonic() * 1000
    t0_holder.append(time.time() * 1000)
    go.set()
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=storm.run_timeout_s)
    except asyncio.TimeoutError:
        for t in tasks:
            t.cancel()
    for c in clients:
        await c.close()
    for c in raw:
        await c.close()
    for i in range(n):
        if results[i] is None:
            results[i] = CallResult(i, False, 0.0, storm.run_timeout_s * 1000, "timeout")
        results[i].attempts = attempts[i]
    return results


# --------------------------------------------------------------------------------------------
# One run and its figures


def run_storm(storm: Storm, gateway: Gateway, sim: Simulator) -> dict:
    """Resets the simulator, releases the clients at t = 0, and measures."""
    sim.reset()
    client_key = gateway.client_key(f"sk-storm-{storm.name}-{uuid.uuid4().hex[:8]}")
    upstream_key = gateway.upstream_key(client_key)
    t0_holder = [0.0]

    async def main():
        first = storm.phases[0]
        clients = asyncio.create_task(_run_clients(
            storm, gateway.base_url(), client_key, t0_holder, lambda: sim.scenario(first.scenario)))
        for phase in storm.phases[1:]:
            while len(t0_holder) < 2:
                await asyncio.sleep(0.001)
            wait = phase.at_ms - (time.monotonic() * 1000 - t0_holder[0])
            if wait > 0:
                await asyncio.sleep(wait / 1000)
            await asyncio.to_thread(sim.scenario, phase.scenario)
        return await clients

    results = asyncio.run(main())
    t0_unix = t0_holder[1]
    time.sleep(0.2)  # let in-flight gateway retries land in the log
    log = sim.requests()
    entries = [q for q in log.get("requests", []) if q.get("key") == upstream_key]
    return measure(storm, gateway, results, entries, t0_unix)


def _phase_of(storm: Storm, t_ms: float) -> dict:
    chosen = storm.phases[0].scenario
    for p in storm.phases:
        if t_ms >= p.at_ms:
            chosen = p.scenario
    return chosen


def provider_delays(storm: Storm, up: list) -> list:
    """The delay each upstream 429 carried, recomputed with the simulator's rule (see module doc).

    `up` holds (t_ms relative to t = 0, status, scenario-clock t_ms, phase index).
    """
    out = []
    windows: dict = {}
    for t, status, _, phase_idx in up:
        sc = storm.phases[phase_idx].scenario
        limit = sc.get("limit")
        admit = None
        if limit:
            q = windows.setdefault(phase_idx, deque())
            while q and q[0] + limit["window_ms"] <= t:
                q.popleft()
            q.append(t)
            n = len(q)
            if n > limit["requests"]:
                admit = max(1.0, math.ceil(q[n - limit["requests"]] + limit["window_ms"] - t))
        if status != 429:
            out.append(None)
            continue
        hint = math.ceil(sc["retry_after_s"] * 1000) if "retry_after_s" in sc else (admit or 1000)
        style = sc.get("retry_after", "seconds")
        out.append(float(hint) if style in ("ms", "both") else math.ceil(hint / 1000) * 1000.0)
    return out


def cooldown_rounds(up: list, delays: list, first_wave: set) -> list:
    """Rounds as the filter forms them (module doc): [{start, deadline, late_429s, cold_429s}]."""
    rounds: list = []
    for i, ((t, status, _, _), d) in enumerate(zip(up, delays)):
        if status != 429:
            continue
        if not rounds or t >= rounds[-1]["deadline"]:
            rounds.append({"start": t, "deadline": t + d, "late_429s": 0, "cold_429s": 0})
        r = rounds[-1]
        r["deadline"] = max(r["deadline"], t + d)
        r["cold_429s" if i in first_wave else "late_429s"] += 1
    return rounds


def _pct(values: list, p: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    k = min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))
    return round(s[k], 1)


def measure(storm: Storm, gateway: Gateway, results: list, entries: list, t0_unix: float) -> dict:
    # Phase index of each entry: the scenario clock restarts at each phase.
    up = []
    for q in sorted(entries, key=lambda q: q["unix_ms"]):
        t = q["unix_ms"] - t0_unix
        # Each phase restarts the simulator's scenario clock: the entry's own t_ms says which.
        scenario_start = q["unix_ms"] - q["t_ms"] - t0_unix
        phase_idx = min(range(len(storm.phases)), key=lambda j: abs(storm.phases[j].at_ms - scenario_start))
        up.append((t, int(q["status"]), q["t_ms"], phase_idx))
    n = storm.clients
    t_first = up[0][0] if up else 0.0
    first_wave = {i for i, (t, *_rest) in enumerate(up) if i < n and t - t_first < FIRST_WAVE_MS}
    delays = provider_delays(storm, up)
    rounds = cooldown_rounds(up, delays, first_wave)
    total = len(up)
    n429 = sum(1 for u in up if u[1] == 429)
    late429 = sum(1 for i, u in enumerate(up) if u[1] == 429 and i not in first_wave)
    ok = [r for r in results if r.ok]
    durations = [r.end_ms - r.start_ms for r in ok]
    out: dict = {
        "scenario": storm.name,
        "title": storm.title,
        "config": gateway.key,
        "config_name": gateway.name,
        "clients": n,
        "upstream_requests": total,
        "per_call": round(total / n, 2),
        "provider_429s": n429,
        "late_429s": late429,
        "first_wave": len(first_wave),
        # When the N-th upstream request arrived: how "simultaneous" the start really was.
        "nth_arrival_ms": round(up[n - 1][0], 1) if len(up) >= n else None,
        "completed": len(ok),
        "completion_rate": round(len(ok) / n, 3),
        "p50_ms": _pct(durations, 50),
        "p99_ms": _pct(durations, 99),
        "rounds": [{k: round(v, 1) for k, v in r.items()} for r in rounds],
        "max_late_429s_per_round": max((r["late_429s"] for r in rounds), default=0),
        "client_local_429s": sum(1 for r in results for a in r.attempts if a.status == 429 and a.source in ("cooldown", "limit")),
        "client_attempts": sum(len(r.attempts) for r in results),
        "errors": _count(r.error for r in results if not r.ok),
        "upstream": [[round(t, 1), s] for t, s, *_ in up],
        "client_ends": [[round(r.end_ms, 1), r.ok] for r in results],
        "gateway": gateway.info(),
    }
    if storm.recovers_at_ms is not None:
        rec = storm.recovers_at_ms
        after = [t for t, s, *_ in up if s == 200 and t >= rec]
        out["first_success_after_recovery_ms"] = round(min(after) - rec, 1) if after else None
        throttled = [t for t, *_ in up if t < rec]
        out["throttled_window_requests"] = len(throttled)
        out["peak_100ms_in_throttled_window"] = _peak(throttled)
        out["peak_100ms_after_first_wave"] = _peak([t for i, (t, *_r) in enumerate(up) if t < rec and i not in first_wave])
        out["late_requests_in_throttled_window"] = sum(1 for i, (t, *_r) in enumerate(up) if t < rec and i not in first_wave)
    return out


def _peak(times: list) -> int:
    buckets: dict = {}
    for t in times:
        b = int(t // 100)
        buckets[b] = buckets.get(b, 0) + 1
    return max(buckets.values(), default=0)


def _count(items) -> dict:
    out: dict = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


# --------------------------------------------------------------------------------------------
# The published replay, offline (the article's model: only t >= 2,000 ms succeeds)


def published_replay(strategy: str, clients: int = 120, recover_ms: int = 2000, attempts: int = 4,
                     budget_ms: int = 2500, seed: int = 107) -> dict:
    rng = random.Random(seed)
    sent, completed, times = 0, 0, []
    for _ in range(clients):
        at = 0.0
        for attempt in range(1, attempts + 1):
            sent += 1
            times.append(at)
            if at >= recover_ms:
                completed += 1
                break
            if strategy == "immediate":
                delay = 0
            elif strategy == "exponential":
                delay = 250 * 2 ** (attempt - 1)
            else:
                delay = strategy_c_delay_ms(attempt, rng)
            if attempt == attempts or at + delay > budget_ms:
                break
            at += delay
    throttled = [t for t in times if t < recover_ms]
    return {"strategy": strategy, "requests": sent, "completed": completed,
            "completion_rate": round(completed / clients, 3), "peak_100ms_in_throttled_window": _peak(throttled),
            "final_attempt_ms": max(times)}
