#!/usr/bin/env python3
"""What holding costs (issue 8): Envoy's memory and CPU with N requests held by llm-governor,
against N idle open requests through bare Envoy (no wasm filter) to a provider that takes its
time answering, and against N requests paused in Envoy itself with no wasm at all (bare Envoy's
buffer filter waiting for the last byte of each body: a stream and its filter chain, nothing
upstream, which is what a held request is minus the module).

For each side: Envoy (--concurrency 1) is started, its RSS (VmRSS) is read idle, N raw
connections each send one complete request, and once all N are open (held by the governor:
`held_requests` reaches N; or in flight through bare Envoy: the simulator sees N in flight), RSS
is read again and Envoy's CPU time (utime + stime from /proc/<pid>/stat) is measured over
--window-s seconds of waiting. The module's own memory per held request is

    ((RSS held - RSS idle) with the governor - (RSS open - RSS idle) bare) / N

(the contract's comparison), and against the buffer filter's pause the same way, which isolates
the module's own part. RSS also moves with what an allocator already held when idle (free pages
it reuses before asking the kernel for more), so each side's heap is read too: Envoy's
allocator's `allocated` bytes (admin /memory) idle and with N open, per request. The wasm
module's own data is in the VM's linear memory, outside that heap; what the pure core keeps
per held request (the same in both builds) is printed last, from bench/core-bench's held_bytes.
The CPU is Envoy's CPU seconds per wall second while the requests wait (a held request costs one
look every 20 ms tick on its worker; nothing else runs).

    .venv/bin/python bench/hold_cost.py                # N = 1000, 10 s window
    .venv/bin/python bench/hold_cost.py --n 500 --window-s 5
    .venv/bin/python bench/hold_cost.py --artifact wasm,native --runs 3   # issue 23: both, 3 runs

--artifact picks llm-governor's build: the proxy-wasm module, the Envoy dynamic module (native,
target/release/libllm_governor.so) or both, one governor row each in every run (default:
$LLM_GOVERNOR_ARTIFACT, else wasm). With --runs N every side is measured N times, each on a
fresh Envoy, and a last table gives each figure as min–max (median) over the runs.

Needs target/wasm32-wasip1/release/llm_governor.wasm (`make build`; native: `make build-native`),
target/release/llm-sim (`make sim`) and an Envoy ($ENVOY_BIN or scripts/ensure-envoy.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "e2e"))

import requests  # noqa: E402

from harness import ARTIFACTS, Envoy, Simulator, envoy_bootstrap, module_of  # noqa: E402

KEY = "sk-hold-cost"
HOLD_S = 60
BODY = json.dumps({"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    + f"authorization: Bearer {KEY}\r\ncontent-length: {len(BODY)}\r\n\r\n".encode()
    + BODY
)
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def settle_rss(envoy: Envoy) -> int:
    """RSS once it stops moving (allocations of the last burst have landed)."""
    last = envoy.rss_bytes()
    for _ in range(20):
        time.sleep(0.25)
        now = envoy.rss_bytes()
        if abs(now - last) < 64 * 1024:
            return now
        last = now
    return last


def heap_bytes(envoy: Envoy) -> int:
    """What Envoy's allocator has handed out and not taken back (admin /memory `allocated`):
    unlike RSS, blind to the free pages an allocator keeps and reuses."""
    return int(requests.get(envoy.admin_url + "/memory", timeout=5).json()["allocated"])


def measure(envoy: Envoy, n: int, opened, window_s: float, request: bytes = REQUEST) -> dict:
    idle = settle_rss(envoy)
    heap_idle = heap_bytes(envoy)
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", envoy.port))
            s.sendall(request)
            socks.append(s)
        if not wait_until(opened, 30):
            raise RuntimeError("the requests did not all open")
        loaded = settle_rss(envoy)
        heap = heap_bytes(envoy) - heap_idle
        pid = envoy.proc.pid
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(window_s)
        cpu = (cpu_s(pid) - c0) / (time.monotonic() - t0)
        return {"rss_idle": idle, "rss_loaded": loaded, "delta": loaded - idle, "heap": heap, "cpu_cores": cpu}
    finally:
        for s in socks:
            s.close()


def one_run(sim: Simulator, n: int, window_s: float, artifacts: list) -> dict:
    """Every side once: bare Envoy open upstream, bare Envoy paused, then llm-governor holding
    for each artifact. Returns {side: figures}; a governor side also has `upstream`."""
    out = {}
    # Bare Envoy: N requests open at a provider that answers after HOLD_S.
    sim.reset()
    sim.scenario({"mode": "ok", "latency_ms": HOLD_S * 1000})
    with Envoy(None, upstream_port=sim.port, concurrency=1) as bare:
        out["open"] = measure(bare, n, lambda: sim.requests().get("in_flight", 0) >= n, window_s)
    sim.reset()
    sim.scenario({"mode": "ok"})
    # Bare Envoy pausing N requests itself: the buffer filter waits for a last byte that
    # never comes (content-length one more than what is sent).
    buffer = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                         "max_request_bytes": 1 << 20},
    }
    short = REQUEST.replace(f"content-length: {len(BODY)}".encode(), f"content-length: {len(BODY) + 1}".encode())
    boot = envoy_bootstrap(sim.port, [buffer])
    with Envoy(None, upstream_port=sim.port, concurrency=1, bootstrap=boot) as paused:
        active = lambda: int(paused.stat("http.llm_gateway.downstream_rq_active") or 0) >= n  # noqa: E731
        out["paused"] = measure(paused, n, active, window_s, request=short)
    # The governor: N requests held through a cooldown of HOLD_S (hold.max_ms raised for it).
    config = {
        "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
        "hold": {"max_ms": HOLD_S * 1000 + 30_000, "max_held": n + 10},
    }
    for artifact in artifacts:
        sim.reset()
        sim.scenario({"mode": "ok"})
        with Envoy(config, upstream_port=sim.port, concurrency=1, artifact=artifact) as gov:
            sim.scenario({"mode": "rate_limited", "retry_after_s": HOLD_S + 20, "count": 1, "keys": [KEY]})
            s = socket.create_connection(("127.0.0.1", gov.port))
            s.sendall(REQUEST)
            s.recv(65536)  # the 429 that starts the cooldown
            s.close()
            held = lambda: int(gov.stat("llm_governor.pool.openai.held_requests") or 0) >= n  # noqa: E731
            g = measure(gov, n, held, window_s)
            g["upstream"] = len(sim.requests_for(KEY))
        out[artifact] = g
    return out


def core_bytes_per_held(n: int):
    """What the pure core keeps per held request (bench/core-bench's held_bytes), or None."""
    root = Path(__file__).resolve().parent
    binary = root / ".target" / "release" / "held_bytes"
    # Built every time (a no-op when current): a binary left from an older core would report
    # that core's figure.
    built = subprocess.run(["cargo", "build", "--quiet", "--release", "--bin", "held_bytes"],
                           cwd=root / "core-bench", env={**os.environ, "CARGO_TARGET_DIR": str(root / ".target")})
    if built.returncode != 0:
        return None
    out = subprocess.run([str(binary), str(n)], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)["core_bytes_per_held"]


def spread(values: list, fmt: str) -> str:
    lo, hi = min(values), max(values)
    if len(values) == 1 or fmt.format(lo) == fmt.format(hi):
        return fmt.format(lo)
    return f"{fmt.format(lo)} – {fmt.format(hi)} ({fmt.format(statistics.median(values))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--artifact", default=os.environ.get("LLM_GOVERNOR_ARTIFACT") or "wasm",
                    help="llm-governor's artifacts, comma-separated: wasm, native or wasm,native")
    ap.add_argument("--runs", type=int, default=1, help="measure every side this many times")
    args = ap.parse_args()
    n = args.n
    artifacts = list(dict.fromkeys(a.strip() for a in args.artifact.split(",") if a.strip()))
    if not artifacts or any(a not in ARTIFACTS for a in artifacts):
        ap.error(f"--artifact {args.artifact!r}: want wasm, native or both, comma-separated")

    names = {"open": "bare Envoy, N open upstream", "paused": "bare Envoy, N paused by its buffer filter",
             **{a: f"llm-governor ({a}), N held" for a in artifacts}}
    for a in artifacts:  # which build was measured (a rebuild during the run would not show)
        module = module_of(a)
        print(f"{a}: {module} sha256 {hashlib.sha256(module.read_bytes()).hexdigest()[:16]}")
    runs = []
    sim = Simulator().start()
    try:
        for i in range(args.runs):
            run = one_run(sim, n, args.window_s, artifacts)
            runs.append(run)
            print(f"run {i + 1} of {args.runs}: {n} requests, Envoy --concurrency 1, {args.window_s:g} s window")
            print("| side | RSS idle | RSS with N open | delta | per request | heap per request | CPU while waiting |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            for side, r in run.items():
                print(f"| {names[side]} | {r['rss_idle'] / 2**20:.1f} MiB | {r['rss_loaded'] / 2**20:.1f} MiB "
                      f"| {r['delta'] / 2**20:+.1f} MiB | {r['delta'] / n:,.0f} B | {r['heap'] / n:,.0f} B "
                      f"| {r['cpu_cores'] * 100:.2f} % of a core |")
            for a in artifacts:
                g, b, p = run[a], run["open"], run["paused"]
                print(f"({a}) held against open through bare Envoy: {(g['delta'] - b['delta']) / n:+,.0f} B per request")
                print(f"({a}) module's own memory per held request (held against paused by Envoy): "
                      f"{(g['delta'] - p['delta']) / n:,.0f} B of RSS, {(g['heap'] - p['heap']) / n:,.0f} B of Envoy's heap")
                print(f"({a}) CPU while {n} are held: {g['cpu_cores'] * 100:.2f} % of a core (target < 2 %)")
                print(f"({a}) upstream requests for the held account: {g['upstream']} (the one 429 that started the cooldown)")
            print(flush=True)
    finally:
        sim.cleanup()

    if args.runs > 1:
        print(f"over {args.runs} runs, min – max (median): {n} requests, Envoy --concurrency 1, {args.window_s:g} s window")
        print("| side | RSS idle | delta with N open | per request | own per held request (vs paused) "
              "| heap per request | own heap (vs paused) | CPU while waiting | upstream requests |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for side in runs[0]:
            col = lambda f: [f(r[side], r) for r in runs]  # noqa: E731
            own = (spread(col(lambda g, r: (g["delta"] - r["paused"]["delta"]) / n), "{:+,.0f} B")
                   if side in artifacts else "–")
            ups = spread(col(lambda g, r: g["upstream"]), "{:.0f}") if side in artifacts else "–"
            own_heap = (spread(col(lambda g, r: (g["heap"] - r["paused"]["heap"]) / n), "{:+,.0f} B")
                        if side in artifacts else "–")
            print(f"| {names[side]} | {spread(col(lambda g, r: g['rss_idle'] / 2**20), '{:.1f} MiB')} "
                  f"| {spread(col(lambda g, r: g['delta'] / 2**20), '{:+.1f} MiB')} "
                  f"| {spread(col(lambda g, r: g['delta'] / n), '{:,.0f} B')} | {own} "
                  f"| {spread(col(lambda g, r: g['heap'] / n), '{:,.0f} B')} | {own_heap} "
                  f"| {spread(col(lambda g, r: g['cpu_cores'] * 100), '{:.2f} %')} | {ups} |")
    core = core_bytes_per_held(n)
    if core is not None:
        print(f"the core's own heap per held request (bench/core-bench held_bytes {n}): {core:,.0f} B: in Envoy's "
              "heap for native (counted above), in the VM's linear memory for wasm (not counted in its heap column)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
