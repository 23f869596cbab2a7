#!/usr/bin/env python3
"""`make soak`: minutes of mixed traffic through Envoy + llm-governor, then everything checked.

Traffic, all at once, for SOAK_SECONDS (default 600):
- storms: every 20 s the provider answers 429 (`retry-after: 1..3`) for a few seconds, so
  cooldowns start, requests are held, released at the provider's pace, and failover steers
  to a second provider;
- rotating tenants: a per-tenant request limit keyed on a fresh tenant id per request, far past
  `max_keys`, so the overflow bucket is exercised;
- a `max_in_flight` cap on the account with a provider latency, so callers wait for slots;
- disconnects: clients that send a request and close the socket while it is held or upstream,
  or halfway through sending its body (while the filter reads it for the token budget);
- streaming: SSE responses read to the end, and some abandoned half way.

At the end, after the traffic stops and a short drain:
- nothing is stuck: `held_requests` and `in_flight` are 0 on every pool, Envoy has no active
  downstream request;
- the counters add up: every held request went upstream, was answered locally, or its client
  left (`held >= hold_released + hold_expired`, with the difference the leavers);
- memory: Envoy's RSS after warm-up (the first 20 % of the run) grew by less than the bound
  the key budget allows (`max_keys` keys × ~120 B × 2 budgets, plus 8 MiB of slack for
  allocator noise).

    .venv/bin/python bench/soak.py                # 10 minutes
    SOAK_SECONDS=60 .venv/bin/python bench/soak.py

Exits non-zero when a check fails; prints every figure.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "e2e"))

from harness import Envoy, Simulator, failover_bootstrap  # noqa: E402

SECONDS = float(os.environ.get("SOAK_SECONDS", "600"))
MAX_KEYS = 200
KEY = "sk-soak-account"
POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai", "fallback": ["backup"]},
    {"name": "backup", "dialect": "openai", "account": "backup",
     "match": {"header": {"name": "x-llm-governor-pool", "value": "backup"}}},
]
CONFIG = {
    "pools": POOLS,
    "max_keys": MAX_KEYS,
    "limits": [
        {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 600, "burst": 20},
        {"name": "cap", "key": "account", "max_in_flight": 16},
        # Issue 12: a reserving token budget (every request's body is read before admission)
        # settled with the simulator's usage.
        {"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": 6_000_000, "settle": "usage"},
    ],
}
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


class Load:
    def __init__(self, port: int, until: float):
        self.port = port
        self.until = until
        self.counts: dict = {}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.counts[what] = self.counts.get(what, 0) + 1

    def request(self, body: dict, tenant: bool, stream: bool, abandon: bool) -> None:
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        if tenant:
            headers["x-tenant-id"] = uuid.uuid4().hex
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": stream}), headers=headers)
            r = conn.getresponse()
            if abandon:
                r.read(10)
                self.count("abandoned")
                return
            r.read()
            self.count(f"status_{r.status}")
        except (OSError, http.client.HTTPException):
            self.count("client_error")
        finally:
            conn.close()

    def leaver(self, half: bool) -> None:
        """Send a request (or only half its body) and go away before the answer."""
        data = json.dumps(CHAT).encode()
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=5)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      + f"authorization: Bearer {KEY}\r\ncontent-length: {len(data)}\r\n\r\n".encode()
                      + data[: len(data) // 2 if half else len(data)])
            time.sleep(random.uniform(0.05, 1.5))
            s.close()
            self.count("left")
        except OSError:
            self.count("client_error")

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < self.until:
            roll = rng.random()
            if roll < 0.1:
                self.leaver(half=roll < 0.03)
            else:
                self.request(CHAT, tenant=roll < 0.5, stream=roll > 0.8, abandon=roll > 0.95)


def main() -> int:
    primary, backup = Simulator().start(), Simulator().start()
    failures = []
    try:
        primary.scenario({"mode": "ok", "latency_ms": 50})
        backup.scenario({"mode": "ok", "latency_ms": 50})
        with Envoy(None, upstream_port=primary.port, bootstrap=failover_bootstrap(primary.port, backup.port, CONFIG, backup_pools=("backup",))) as envoy:
            start = time.monotonic()
            until = start + SECONDS
            load = Load(envoy.port, until)
            threads = [threading.Thread(target=load.worker, args=(i,), daemon=True) for i in range(24)]
            for t in threads:
                t.start()
            rss = []
            storm_at = start + 10
            while time.monotonic() < until:
                now = time.monotonic()
                if now >= storm_at:
                    # A storm on both providers, the backup's shorter: holds, pacing, failover.
                    primary.scenario({"mode": "rate_limited", "retry_after_s": random.choice([1, 2, 3]),
                                      "until_ms": 4000, "latency_ms": 50})
                    backup.scenario({"mode": "rate_limited", "retry_after_s": 1, "until_ms": 1500, "latency_ms": 50})
                    storm_at = now + 20
                rss.append((now - start, envoy.rss_bytes()))
                time.sleep(1)
            for t in threads:
                t.join(60)
            primary.scenario({"mode": "ok"})
            backup.scenario({"mode": "ok"})
            time.sleep(3)  # drain: held requests expire within hold.max_ms, streams finish

            stats = envoy.stats()
            g = lambda name, pool="openai": int(stats.get(f"wasmcustom.llm_governor.pool.{pool}.{name}") or 0)  # noqa: E731
            active = int(stats.get("http.llm_gateway.downstream_rq_active") or 0)
            warm = [b for t, b in rss if t >= SECONDS * 0.2]
            growth = (max(warm) - warm[0]) if warm else 0
            bound = MAX_KEYS * 120 * 2 + 8 * 2**20
            print(f"soak: {SECONDS:.0f} s, client outcomes {dict(sorted(load.counts.items()))}")
            for pool in ("openai", "backup"):
                print(f"  {pool}: " + ", ".join(f"{n}={g(n, pool)}" for n in (
                    "held", "hold_released", "hold_expired", "held_requests", "in_flight", "failover",
                    "upstream_rate_limited", "local_reject_cooldown", "local_reject_limit", "overflow_keys",
                    "store_contention")))
            print(f"  provider requests: primary {primary.requests()['total']}, backup {backup.requests()['total']}")
            print(f"  RSS: start {rss[0][1] / 2**20:.1f} MiB, after warm-up {warm[0] / 2**20:.1f} MiB, "
                  f"max {max(b for _, b in rss) / 2**20:.1f} MiB, end {rss[-1][1] / 2**20:.1f} MiB; "
                  f"growth after warm-up {growth / 2**20:.2f} MiB (bound {bound / 2**20:.1f} MiB)")
            print(f"  downstream requests active at the end: {active}")
            for pool in ("openai", "backup"):
                if g("held_requests", pool) != 0:
                    failures.append(f"{pool}: held_requests {g('held_requests', pool)} at the end")
                if g("in_flight", pool) != 0:
                    failures.append(f"{pool}: in_flight {g('in_flight', pool)} at the end")
                if g("held", pool) < g("hold_released", pool) + g("hold_expired", pool):
                    failures.append(f"{pool}: held < released + expired")
            if active:
                failures.append(f"{active} downstream requests still active")
            if growth > bound:
                failures.append(f"RSS grew {growth} B after warm-up (bound {bound})")
            if g("held") == 0 or g("failover") == 0 or g("overflow_keys") == 0:
                failures.append("the soak did not exercise holding, failover and the key bound")
            critical = envoy.critical_wasm_lines()
            if critical:
                failures.append(f"critical wasm lines: {critical[:3]}")
    finally:
        primary.cleanup()
        backup.cleanup()
    for f in failures:
        print(f"FAILED: {f}")
    print("soak: " + ("FAILED" if failures else "ok"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
