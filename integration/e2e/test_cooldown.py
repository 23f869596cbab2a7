"""End-to-end: shared cooldowns per (pool, account) across Envoy workers (issue 3, items 2 and 6).

While the provider says "not now" for an account, no worker sends it anything: every request is
answered locally, in the pool's dialect, and the simulator's request log proves that nothing
reached the upstream. Other accounts are untouched, and the account flows again once the
provider's time has passed.

Timing is judged per request from the client's own clock (when it sent, when it got the answer),
so the assertions keep the real semantics without depending on a quiet machine.
"""

from __future__ import annotations

import http.client
import json
import math
import time
import uuid

import pytest

from conftest import module_envoy
from harness import post_concurrently

JITTER = 0.2
MAX_MS = 60_000
HINT_S = 4
# Envoy counts whole wall-clock ms, the client measures with time.monotonic().
CLOCK_SLACK_MS = 5
POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
]
CONFIG = {
    "pools": POOLS,
    "retry_after": {"default_ms": 1000, "max_ms": MAX_MS, "jitter": JITTER},
    "cooldown": {"enabled": True, "max_ms": 300_000, "quota_ms": 300_000},
    # These tests are about the local answers; holding (test_hold.py) would wait them out.
    "hold": {"max_ms": 0},
}


def new_key(prefix: str = "sk-cool") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def request_for(dialect: str, key: str):
    """(path, headers, json body) of a minimal real request in the dialect."""
    if dialect == "openai":
        return (
            "/v1/chat/completions",
            {"authorization": f"Bearer {key}"},
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]},
        )
    if dialect == "anthropic":
        return (
            "/v1/messages",
            {"x-api-key": key, "anthropic-version": "2023-06-01"},
            {"model": "claude-sonnet-4-6", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]},
        )
    raise ValueError(dialect)


def send(url: str, dialect: str, key: str, connections: int = 1, per_connection: int = 1) -> list:
    job = request_for(dialect, key)
    return post_concurrently(url, [[job] * per_connection for _ in range(connections)])


def counter(envoy, pool: str, name: str) -> int:
    return int(envoy.stat(f"llm_governor.pool.{pool}.{name}") or 0)


def delay_ms(reply) -> int:
    """retry-after-ms, after checking retry-after is the same delay in whole seconds, rounded up."""
    ms = int(reply.headers["retry-after-ms"])
    assert int(reply.headers["retry-after"]) == math.ceil(ms / 1000), reply.headers
    return ms


def assert_local_body(reply, dialect: str, klass: str) -> None:
    """A local rejection carries a JSON error body in the pool's dialect."""
    assert reply.headers.get("content-type", "").startswith("application/json"), reply.headers
    body = json.loads(reply.body)
    if dialect == "openai":
        error = body["error"]
        assert error["code"] == ("insufficient_quota" if klass == "quota_exhausted" else "rate_limit_exceeded"), body
        assert error["type"] and error["message"], body
    else:
        assert body["type"] == "error", body
        assert body["error"]["type"] == "rate_limit_error", body
        assert body["error"]["message"], body


# --------------------------------------------------------------------------------------------
# A transient rate limit cools the account on every worker


@pytest.mark.parametrize("concurrency", [2, 4])
def test_rate_limit_cools_the_account_on_every_worker(envoy_factory, sim, concurrency):
    envoy = envoy_factory(CONFIG, concurrency=concurrency)
    a, b = new_key("sk-a"), new_key("sk-b")
    sim.scenario({"mode": "rate_limited", "count": 1, "keys": [a], "retry_after": "seconds", "retry_after_s": HINT_S})

    (first,) = send(envoy.url, "openai", a)
    assert first.status == 429
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert first.headers.get("x-llm-governor-class") == "rate_limited"
    # The cooldown's deadline was set by Envoy between these two instants, 4 s on.
    deadline_low = first.sent + HINT_S
    deadline_high = first.received + HINT_S

    # 100 more calls for A, over 20 connections, so every worker answers some of them.
    cooled = send(envoy.url, "openai", a, connections=20, per_connection=5)
    on_b = send(envoy.url, "openai", b)

    assert len(cooled) == 100
    band_ms = JITTER * HINT_S * 1000
    last_sent = max(r.sent for r in cooled)
    assert last_sent < deadline_low, (
        f"the burst took too long ({last_sent - first.received:.2f} s after the 429): it is no "
        f"longer inside the {HINT_S} s cooldown"
    )
    upstream_a = sim.requests_for(a)
    assert [q["status"] for q in upstream_a] == [429], f"requests for A reached the upstream while cooling: {upstream_a}"
    jittered = 0
    for r in cooled:
        assert r.status == 429, (r.status, r.headers)
        assert r.headers.get("x-llm-governor-source") == "cooldown", r.headers
        assert r.headers.get("x-llm-governor-class") == "rate_limited", r.headers
        assert r.headers.get("x-should-retry") == "true", r.headers
        ms = delay_ms(r)
        # Told = remaining + up to jitter x the cooldown's length; never before the deadline.
        remaining_high_ms = (deadline_high - r.sent) * 1000
        remaining_low_ms = (deadline_low - r.received) * 1000
        assert ms <= remaining_high_ms + band_ms + CLOCK_SLACK_MS, (ms, remaining_high_ms)
        assert ms >= remaining_low_ms - CLOCK_SLACK_MS, f"told {ms} ms, but {remaining_low_ms:.0f} ms of cooldown were left"
        jittered += ms > remaining_high_ms + band_ms / 4
        assert_local_body(r, "openai", "rate_limited")
    # The jitter is real: uniform over the band, about three answers in four lie more than a
    # quarter of it above what was left (fewer when a slow machine widens remaining_high).
    assert jittered >= 10, f"only {jittered} of 100 local answers carry more than {band_ms / 4:.0f} ms of jitter"

    workers = envoy.worker_connections()
    assert sum(1 for n in workers.values() if n > 0) >= 2, f"the burst did not spread over workers: {workers}"
    print(
        f"\n--concurrency {concurrency}: 100 cooled calls sent {min(r.sent for r in cooled) - first.received:.2f}"
        f"..{last_sent - first.received:.2f} s after the 429, told {min(map(delay_ms, cooled))}"
        f"..{max(map(delay_ms, cooled))} ms; connections by worker {workers}"
    )

    # Another account of the same pool is untouched.
    assert on_b[0].status == 200 and "x-llm-governor-source" not in on_b[0].headers
    assert [q["status"] for q in sim.requests_for(b)] == [200]

    assert counter(envoy, "openai", "local_reject_cooldown") == 100
    assert counter(envoy, "openai", "upstream_rate_limited") == 1
    assert counter(envoy, "openai", "local_reject_quota") == 0

    # After the provider's time plus the jitter clients were given, A flows again.
    time.sleep(max(0.0, first.sent + HINT_S * (1 + JITTER) + 0.1 - time.monotonic()))
    after = send(envoy.url, "openai", a, connections=concurrency, per_connection=1)
    assert [r.status for r in after] == [200] * concurrency, [(r.status, r.headers) for r in after]
    assert [q["status"] for q in sim.requests_for(a)] == [429] + [200] * concurrency
    assert counter(envoy, "openai", "local_reject_cooldown") == 100


# --------------------------------------------------------------------------------------------
# Quota and spend caps: answered locally, and clients are told not to retry

governor = pytest.fixture(scope="module", name="governor")(module_envoy(CONFIG, concurrency=2))

QUOTA = [("openai", "openai"), ("anthropic", "anthropic")]


@pytest.mark.parametrize("dialect,pool", QUOTA, ids=["openai-insufficient-quota", "anthropic-spend-cap"])
def test_quota_is_answered_locally_without_retry(governor, sim, dialect, pool):
    key, other = new_key("sk-quota"), new_key("sk-other")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    quota_before = counter(governor, pool, "local_reject_quota")
    cooldown_before = counter(governor, pool, "local_reject_cooldown")

    (first,) = send(governor.url, dialect, key)
    assert first.status == 429
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert first.headers.get("x-llm-governor-class") == "quota_exhausted"
    assert first.headers.get("x-should-retry") == "false"

    # The simulator's one quota answer is spent: anything that reached it now would get a 200.
    later = send(governor.url, dialect, key, connections=4, per_connection=3)
    assert [q["status"] for q in sim.requests_for(key)] == [429], "a call reached the upstream after the quota answer"
    for r in later:
        assert r.status == 429, (r.status, r.headers)
        assert r.headers.get("x-llm-governor-source") == "cooldown", r.headers
        assert r.headers.get("x-llm-governor-class") == "quota_exhausted", r.headers
        assert r.headers.get("x-should-retry") == "false", r.headers
        # What is left of cooldown.quota_ms (300 s), capped by retry_after.max_ms.
        assert delay_ms(r) == MAX_MS
        assert_local_body(r, dialect, "quota_exhausted")

    assert send(governor.url, dialect, other)[0].status == 200
    assert counter(governor, pool, "local_reject_quota") == quota_before + len(later)
    assert counter(governor, pool, "local_reject_cooldown") == cooldown_before


def test_a_remembered_quota_is_told_exactly_the_time_left_of_quota_ms(envoy_factory, sim):
    # quota_ms below the cap: a local quota answer is the time left, to the millisecond, with
    # no jitter (there is no one to spread: clients are told not to retry).
    quota_ms = 20_000
    envoy = envoy_factory({**CONFIG, "cooldown": {"enabled": True, "quota_ms": quota_ms}}, concurrency=2)
    key = new_key("sk-quota")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    (first,) = send(envoy.url, "openai", key)
    assert first.headers.get("x-llm-governor-class") == "quota_exhausted"
    # The upstream answer: the quota time plus jitter.
    assert quota_ms <= delay_ms(first) <= quota_ms * (1 + JITTER)
    deadline_low, deadline_high = first.sent + quota_ms / 1000, first.received + quota_ms / 1000
    time.sleep(0.5)
    later = send(envoy.url, "openai", key, connections=4, per_connection=2)
    for r in later:
        assert r.headers.get("x-llm-governor-source") == "cooldown", r.headers
        left_low = (deadline_low - r.received) * 1000 - CLOCK_SLACK_MS
        left_high = (deadline_high - r.sent) * 1000 + CLOCK_SLACK_MS
        assert left_low <= delay_ms(r) <= left_high, (delay_ms(r), left_low, left_high)
    assert [q["status"] for q in sim.requests_for(key)] == [429]


# --------------------------------------------------------------------------------------------
# Keep-alive across local answers


def test_local_answer_keeps_the_connection_alive(governor, sim):
    key = new_key("sk-keepalive")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    path, headers, body = request_for("openai", key)
    connections_before = int(governor.stat("http.llm_gateway.downstream_cx_total") or 0)
    conn = http.client.HTTPConnection("127.0.0.1", governor.port, timeout=10)
    answers = []
    try:
        for _ in range(3):  # the provider's quota answer, then two local ones
            conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json", **headers})
            response = conn.getresponse()
            response.read()
            answers.append((response.status, response.getheader("x-llm-governor-source"), response.getheader("connection")))
    finally:
        conn.close()
    assert [a[:2] for a in answers] == [(429, "upstream"), (429, "cooldown"), (429, "cooldown")]
    assert [a[2] for a in answers] == [None, None, None], f"a local answer closed the connection: {answers}"
    assert int(governor.stat("http.llm_gateway.downstream_cx_total") or 0) == connections_before + 1
