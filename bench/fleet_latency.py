#!/usr/bin/env python3
"""What a fleet limit adds to a request's latency (issue 21's cost target: p50 <= 1 ms, p99 <= 5 ms
over loopback): the same limits with `"scope": "fleet"` (a ShouldRateLimit, or a Reserve for a
token budget, to the Limitador-compatible fixture on a real Redis, all on loopback) against
`"scope": "local"` (Envoy's shared data), through one Envoy each (--concurrency 1) in front of
the provider simulator.

Paired rounds: each round sends --per-round sequential keep-alive requests through every
configuration, in an order that alternates by round, and takes each one's p50 and p99; the
added latency is fleet minus local within the round (so a noisy moment of the shared machine
moves both sides). Printed: per configuration, the median over rounds of p50 and p99 and the
spread (min-max) of the added latency over rounds.

    .venv/bin/python bench/fleet_latency.py                  # 9 rounds x 300 requests
    .venv/bin/python bench/fleet_latency.py --rounds 5 --per-round 200

Needs make build, make sim, make rls, redis-server and an Envoy ($ENVOY_BIN).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "e2e"))

from fleet_rig import RLS_CLUSTER, Redis, RlsService, fleet_envoy, limits_file  # noqa: E402
from harness import Simulator  # noqa: E402

BIG = 1_000_000_000
BODY = json.dumps({"model": "gpt-4o-mini", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})


def config(scope_rpm: str, scope_tpm: str | None) -> dict:
    limits = [{"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": BIG, "scope": scope_rpm}]
    if scope_tpm:
        limits.append({"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": BIG, "scope": scope_tpm})
    return {
        "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
        "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 200},
        "limits": limits,
    }


CONFIGS = {
    "local: one request limit": config("local", None),
    "fleet: one request limit": config("fleet", None),
    "local: request + token limits": config("local", "local"),
    "fleet: request + token limits": config("fleet", "fleet"),
}
PAIRS = [("fleet: one request limit", "local: one request limit"),
         ("fleet: request + token limits", "local: request + token limits")]


def latencies_us(port: int, n: int) -> list:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    out = []
    for i in range(n):
        started = time.perf_counter_ns()
        conn.request("POST", "/v1/chat/completions", body=BODY,
                     headers={"content-type": "application/json", "x-tenant-id": "bench",
                              "authorization": "Bearer sk-bench"})
        r = conn.getresponse()
        r.read()
        out.append((time.perf_counter_ns() - started) / 1000)
        if r.status != 200:
            raise SystemExit(f"request {i} answered {r.status}")
    conn.close()
    return out


def pct(xs: list, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--per-round", type=int, default=300)
    args = ap.parse_args()
    limits = "".join(limits_file(c) for name, c in CONFIGS.items() if name.startswith("fleet: request +"))
    with Simulator() as sim, Redis() as redis, RlsService(redis, limits) as rls:
        envoys = {name: fleet_envoy(c, sim.port, rls.port).start() for name, c in CONFIGS.items()}
        try:
            for e in envoys.values():
                latencies_us(e.port, 100)  # warm-up: connections, the service's counters
            rounds: dict = {name: [] for name in CONFIGS}
            names = list(CONFIGS)
            for r in range(args.rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    xs = latencies_us(envoys[name].port, args.per_round)
                    rounds[name].append((pct(xs, 0.5), pct(xs, 0.99)))
            errors = sum(int(e.stat("wasmcustom.llm_governor.pool.openai.fleet_errors", 0)) for e in envoys.values())
        finally:
            for e in envoys.values():
                e.stop(check=False)
                e.cleanup()
    print(f"{args.rounds} paired rounds x {args.per_round} sequential requests, one Envoy each (--concurrency 1)")
    print(f"{'configuration':34} {'p50 us (median)':>16} {'p99 us (median)':>16}")
    for name, rs in rounds.items():
        print(f"{name:34} {statistics.median(p for p, _ in rs):16.0f} {statistics.median(q for _, q in rs):16.0f}")
    print()
    print(f"{'added by the fleet (per round)':34} {'p50 us: median (min-max)':>28} {'p99 us: median (min-max)':>28}")
    for fleet, local in PAIRS:
        d50 = [f[0] - loc[0] for f, loc in zip(rounds[fleet], rounds[local])]
        d99 = [f[1] - loc[1] for f, loc in zip(rounds[fleet], rounds[local])]
        fmt = lambda d: f"{statistics.median(d):.0f} ({min(d):.0f}-{max(d):.0f})"  # noqa: E731
        print(f"{fleet:34} {fmt(d50):>28} {fmt(d99):>28}")
    print(f"\nfleet_errors over the run: {errors} (must be 0: every fleet decision was the service's)")


if __name__ == "__main__":
    main()
