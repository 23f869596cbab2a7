#!/usr/bin/env python3
"""Envoy's memory under many distinct tenant keys (issue 3, item 4: bounded memory).

Starts the provider simulator and Envoy with llm-governor and a per-tenant limit, measures
Envoy's RSS (/proc/<pid>/status VmRSS) and the admin /memory `allocated` bytes, sends one request
for each of --keys distinct `x-tenant-id` values, measures again and prints a table. One row per
--max-keys value: past max_keys, new tenants share the overflow bucket, so memory should stop
growing there; a larger max_keys shows what one key costs.

    .venv/bin/python bench/rss_keys.py                       # 100,000 keys; max_keys 10000, 100000
    .venv/bin/python bench/rss_keys.py --keys 20000 --max-keys 10000

The requests are POSTs with an empty body (content-length: 0): the filter decides on the request
headers, so the body does not matter to what is measured, and a complete request keeps its
keep-alive connection even when it is answered locally (Envoy closes an HTTP/1.1 connection when
it answers before the request body was read), so the client is not dominated by reconnects.
The client is several processes, each with one keep-alive connection, so Python's GIL does not
cap the rate.

Needs target/wasm32-wasip1/release/llm_governor.wasm (`make build`), target/release/llm-sim
(`make sim`) and an Envoy ($ENVOY_BIN or scripts/ensure-envoy.sh).
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "e2e"))

from harness import Envoy, Simulator  # noqa: E402

DEFAULT_MAX_KEYS = 10_000
POOL = "openai"
LIMIT = {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 600, "burst": 50}


def send_share(args) -> dict:
    """One client process: its share of the tenants, in order, over one keep-alive connection."""
    port, prefix, first, count = args
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    statuses: dict = {}
    reconnects = 0
    for i in range(first, first + count):
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=b"",
            headers={"authorization": "Bearer sk-rss-bench", "x-tenant-id": f"{prefix}-{i}"},
        )
        response = conn.getresponse()
        response.read()
        statuses[response.status] = statuses.get(response.status, 0) + 1
        if response.getheader("connection", "").lower() == "close":
            reconnects += 1
    conn.close()
    return {"statuses": statuses, "reconnects": reconnects}


def send_distinct_tenants(port: int, prefix: str, keys: int, clients: int) -> dict:
    share = -(-keys // clients)
    jobs = [(port, prefix, c * share, min(share, keys - c * share)) for c in range(clients) if c * share < keys]
    with multiprocessing.Pool(len(jobs)) as pool:
        results = pool.map(send_share, jobs)
    statuses: dict = {}
    for r in results:
        for status, n in r["statuses"].items():
            statuses[status] = statuses.get(status, 0) + n
    return {"statuses": statuses, "reconnects": sum(r["reconnects"] for r in results)}


def settle(envoy: Envoy, seconds: float) -> tuple:
    time.sleep(seconds)
    return envoy.rss_bytes(), envoy.memory().get("allocated", 0)


def measure(sim: Simulator, max_keys: int, keys: int, clients: int, concurrency: int) -> dict:
    config = {
        "pools": [{"name": POOL, "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
        "limits": [LIMIT],
    }
    if max_keys != DEFAULT_MAX_KEYS:
        config["max_keys"] = max_keys
    with Envoy(config, upstream_port=sim.port, concurrency=concurrency, log_level="warning") as envoy:
        # Warm every worker's VM and upstream pool, so "before" is a serving Envoy.
        send_distinct_tenants(envoy.port, "warm", clients * 4, clients)
        rss_before, alloc_before = settle(envoy, 1.0)
        start = time.monotonic()
        sent = send_distinct_tenants(envoy.port, f"rss{max_keys}", keys, clients)
        elapsed = time.monotonic() - start
        rss_after, alloc_after = settle(envoy, 1.0)
        stat = lambda name: int(envoy.stat(f"llm_governor.pool.{POOL}.{name}") or 0)  # noqa: E731
        return {
            "max_keys": max_keys,
            "keys": keys,
            "rss_before": rss_before,
            "rss_after": rss_after,
            "alloc_before": alloc_before,
            "alloc_after": alloc_after,
            "overflow_keys": stat("overflow_keys"),
            "local_reject_limit": stat("local_reject_limit"),
            "store_contention": stat("store_contention"),
            "statuses": sent["statuses"],
            "reconnects": sent["reconnects"],
            "elapsed": elapsed,
        }


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def print_table(rows: list, concurrency: int, clients: int) -> None:
    print(f"\nEnvoy --concurrency {concurrency}, {clients} client connections, limit {LIMIT}")
    header = (
        f"{'max_keys':>8} {'keys sent':>9} {'RSS before':>10} {'RSS after':>9} {'dRSS':>7} "
        f"{'alloc before':>12} {'alloc after':>11} {'dalloc':>7} {'B/key':>6} "
        f"{'overflow_keys':>13} {'elapsed':>8} {'req/s':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        stored = min(r["keys"], r["max_keys"])
        per_key = (r["alloc_after"] - r["alloc_before"]) / stored if stored else 0
        print(
            f"{r['max_keys']:>8} {r['keys']:>9} {mib(r['rss_before']):>10} {mib(r['rss_after']):>9} "
            f"{mib(r['rss_after'] - r['rss_before']):>7} {mib(r['alloc_before']):>12} "
            f"{mib(r['alloc_after']):>11} {mib(r['alloc_after'] - r['alloc_before']):>7} {per_key:>6.0f} "
            f"{r['overflow_keys']:>13} {r['elapsed']:>7.1f}s {r['keys'] / r['elapsed']:>6.0f}"
        )
    print("(memory in MiB; B/key = allocated growth / keys kept, i.e. min(keys sent, max_keys))")
    for r in rows:
        print(
            f"max_keys {r['max_keys']}: statuses {r['statuses']}, local_reject_limit {r['local_reject_limit']}, "
            f"store_contention {r['store_contention']}, connection-close answers {r['reconnects']}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000, help="distinct x-tenant-id values to send")
    parser.add_argument("--max-keys", type=int, nargs="+", default=[DEFAULT_MAX_KEYS, 100_000])
    parser.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    parser.add_argument("--clients", type=int, default=4, help="client processes (one connection each)")
    args = parser.parse_args()

    with Simulator() as sim:
        rows = []
        for max_keys in args.max_keys:
            sim.reset()
            rows.append(measure(sim, max_keys, args.keys, args.clients, args.concurrency))
            print(f"max_keys {max_keys}: done in {rows[-1]['elapsed']:.1f} s", file=sys.stderr)
    print_table(rows, args.concurrency, args.clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())
