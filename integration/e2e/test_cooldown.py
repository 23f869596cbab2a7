"""End-to-end: while the provider says "not now" for an account, the gateway answers for it.

The cooldown is shared per (pool, account) across Envoy workers: no worker sends that account
anything, every request is answered locally in the pool's dialect (or, with no pools, the
request's own), and the simulator's request log proves that nothing reached the upstream.
Clients are told what is left of the provider's time (capped by retry_after.max_ms, never the
cooldown itself); a quota or spend cap is remembered for cooldown.quota_ms and clients are told
not to retry. Other accounts are untouched, the account flows again once the provider's time has
passed, and a local answer keeps the connection open.

Timing is judged per request from the client's own clock (when it sent, when it got the answer),
so the assertions keep the real semantics without depending on a quiet machine.
"""

from __future__ import annotations

import http.client
import json
import time

import pytest

from answers import JITTER, MAX_MS, POOLS, assert_local_body, check_delay, delay_ms
from conftest import module_envoy
from harness import new_key, post, post_concurrently, request_in

HINT_S = 4
# Envoy counts whole wall-clock ms, the client measures with time.monotonic().
CLOCK_SLACK_MS = 5
CONFIG = {
    "pools": POOLS,
    "retry_after": {"default_ms": 1000, "max_ms": MAX_MS, "jitter": JITTER},
    "cooldown": {"enabled": True, "max_ms": 300_000, "quota_ms": 300_000},
    # These tests are about the local answers; holding (test_hold.py) would wait them out.
    "hold": {"max_ms": 0},
}
# The defaults, without holding.
NO_HOLD = {"pools": POOLS, "hold": {"max_ms": 0}}

governor = pytest.fixture(scope="module", name="governor")(module_envoy(CONFIG, concurrency=2))
governor_no_hold = pytest.fixture(scope="module", name="governor_no_hold")(module_envoy(NO_HOLD))


def burst(url: str, dialect: str, key: str, connections: int = 1, per_connection: int = 1) -> list:
    """connections x per_connection requests for `key` at once, over keep-alive connections."""
    job = request_in(dialect, key)
    return post_concurrently(url, [[job] * per_connection for _ in range(connections)])


# --------------------------------------------------------------------------------------------
# While the provider's time lasts, the gateway answers for it


def test_cooldown_answers_locally_until_the_provider_time(governor_no_hold, sim):
    envoy = governor_no_hold
    key, other_key = new_key(), new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
    local_before = envoy.pool_stat("openai", "local_reject_cooldown")

    first_sent = time.monotonic()
    first = post(envoy, key, "openai")
    assert first.headers.get("x-llm-governor-source") == "upstream"
    second = post(envoy, key, "openai")
    elapsed_ms = (time.monotonic() - first_sent) * 1000

    assert second.status_code == 429
    assert second.headers.get("x-llm-governor-source") == "cooldown"
    assert second.headers.get("x-llm-governor-class") == "rate_limited"
    assert second.headers.get("x-should-retry") == "true"
    # What is left of the provider's 3 s, never less.
    check_delay(second, 3000 - elapsed_ms, 3000)
    error = second.json()["error"]  # the OpenAI dialect's error shape
    assert {"type", "code", "message"} <= set(error), second.text
    assert len(sim.requests_for(key)) == 1, "a locally rejected request reached the upstream"
    assert envoy.pool_stat("openai", "local_reject_cooldown") == local_before + 1

    # Another account in the same pool is not cooling.
    assert post(envoy, other_key, "openai").status_code == 200


def test_cap_shortens_what_clients_are_told_never_the_cooldown(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS, "retry_after": {"max_ms": 1000, "jitter": JITTER}, "hold": {"max_ms": 0}})
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 4, "keys": [key]})

    first = post(envoy, key, "openai")
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert delay_ms(first) == 1000

    time.sleep(1.1)  # the client obeys the capped delay; the provider's 4 s have not passed
    again = post(envoy, key, "openai")
    assert again.status_code == 429
    assert again.headers.get("x-llm-governor-source") == "cooldown"
    # About 2.9 s of the provider's 4 s are left: capped, the client is told the cap again.
    assert delay_ms(again) == 1000
    assert len(sim.requests_for(key)) == 1


# --------------------------------------------------------------------------------------------
# A transient rate limit cools the account on every worker


@pytest.mark.parametrize("concurrency", [2, 4])
def test_rate_limit_cools_the_account_on_every_worker(envoy_factory, sim, concurrency):
    envoy = envoy_factory(CONFIG, concurrency=concurrency)
    a, b = new_key("sk-a"), new_key("sk-b")
    sim.scenario({"mode": "rate_limited", "count": 1, "keys": [a], "retry_after": "seconds", "retry_after_s": HINT_S})

    (first,) = burst(envoy.url, "openai", a)
    assert first.status == 429
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert first.headers.get("x-llm-governor-class") == "rate_limited"
    # The cooldown's deadline was set by Envoy between these two instants, 4 s on.
    deadline_low = first.sent + HINT_S
    deadline_high = first.received + HINT_S

    # 100 more calls for A, over 20 connections, so every worker answers some of them.
    cooled = burst(envoy.url, "openai", a, connections=20, per_connection=5)
    on_b = burst(envoy.url, "openai", b)

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

    assert envoy.pool_stat("openai", "local_reject_cooldown") == 100
    assert envoy.pool_stat("openai", "upstream_rate_limited") == 1
    assert envoy.pool_stat("openai", "local_reject_quota") == 0

    # After the provider's time plus the jitter clients were given, A flows again.
    time.sleep(max(0.0, first.sent + HINT_S * (1 + JITTER) + 0.1 - time.monotonic()))
    after = burst(envoy.url, "openai", a, connections=concurrency, per_connection=1)
    assert [r.status for r in after] == [200] * concurrency, [(r.status, r.headers) for r in after]
    assert [q["status"] for q in sim.requests_for(a)] == [429] + [200] * concurrency
    assert envoy.pool_stat("openai", "local_reject_cooldown") == 100


# --------------------------------------------------------------------------------------------
# Quota and spend caps: answered locally, and clients are told not to retry

QUOTA = [("openai", "openai"), ("anthropic", "anthropic")]


@pytest.mark.parametrize("dialect,pool", QUOTA, ids=["openai-insufficient-quota", "anthropic-spend-cap"])
def test_quota_is_answered_locally_without_retry(governor, sim, dialect, pool):
    key, other = new_key("sk-quota"), new_key("sk-other")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    quota_before = governor.pool_stat(pool, "local_reject_quota")
    cooldown_before = governor.pool_stat(pool, "local_reject_cooldown")

    (first,) = burst(governor.url, dialect, key)
    assert first.status == 429
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert first.headers.get("x-llm-governor-class") == "quota_exhausted"
    assert first.headers.get("x-should-retry") == "false"

    # The simulator's one quota answer is spent: anything that reached it now would get a 200.
    later = burst(governor.url, dialect, key, connections=4, per_connection=3)
    assert [q["status"] for q in sim.requests_for(key)] == [429], "a call reached the upstream after the quota answer"
    for r in later:
        assert r.status == 429, (r.status, r.headers)
        assert r.headers.get("x-llm-governor-source") == "cooldown", r.headers
        assert r.headers.get("x-llm-governor-class") == "quota_exhausted", r.headers
        assert r.headers.get("x-should-retry") == "false", r.headers
        # What is left of cooldown.quota_ms (300 s), capped by retry_after.max_ms.
        assert delay_ms(r) == MAX_MS
        assert_local_body(r, dialect, "quota_exhausted")

    assert burst(governor.url, dialect, other)[0].status == 200
    assert governor.pool_stat(pool, "local_reject_quota") == quota_before + len(later)
    assert governor.pool_stat(pool, "local_reject_cooldown") == cooldown_before


def test_quota_answer_is_remembered_and_answered_locally(governor_no_hold, sim):
    envoy = governor_no_hold
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})
    local_before = envoy.pool_stat("anthropic", "local_reject_quota")

    first = post(envoy, key, "anthropic")
    assert first.headers.get("x-llm-governor-source") == "upstream"
    second = post(envoy, key, "anthropic")

    assert second.status_code == 429
    assert second.headers.get("x-llm-governor-source") == "cooldown"
    assert second.headers.get("x-llm-governor-class") == "quota_exhausted"
    assert second.headers.get("x-should-retry") == "false"
    body = second.json()  # the Anthropic dialect's error shape
    assert body.get("type") == "error" and body["error"].get("type") == "rate_limit_error", second.text
    assert len(sim.requests_for(key)) == 1
    assert envoy.pool_stat("anthropic", "local_reject_quota") == local_before + 1


def test_a_remembered_quota_is_told_exactly_the_time_left_of_quota_ms(envoy_factory, sim):
    # quota_ms below the cap: a local quota answer is the time left, to the millisecond, with
    # no jitter (there is no one to spread: clients are told not to retry).
    quota_ms = 20_000
    envoy = envoy_factory({**CONFIG, "cooldown": {"enabled": True, "quota_ms": quota_ms}}, concurrency=2)
    key = new_key("sk-quota")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    (first,) = burst(envoy.url, "openai", key)
    assert first.headers.get("x-llm-governor-class") == "quota_exhausted"
    # The upstream answer: the quota time plus jitter.
    assert quota_ms <= delay_ms(first) <= quota_ms * (1 + JITTER)
    deadline_low, deadline_high = first.sent + quota_ms / 1000, first.received + quota_ms / 1000
    time.sleep(0.5)
    later = burst(envoy.url, "openai", key, connections=4, per_connection=2)
    for r in later:
        assert r.headers.get("x-llm-governor-source") == "cooldown", r.headers
        left_low = (deadline_low - r.received) * 1000 - CLOCK_SLACK_MS
        left_high = (deadline_high - r.sent) * 1000 + CLOCK_SLACK_MS
        assert left_low <= delay_ms(r) <= left_high, (delay_ms(r), left_low, left_high)
    assert [q["status"] for q in sim.requests_for(key)] == [429]


# --------------------------------------------------------------------------------------------
# Local answers in each dialect


@pytest.mark.parametrize("dialect", ["gemini", "azure"])
def test_gemini_and_azure_pools_answer_locally_in_their_dialect(governor_no_hold, sim, dialect):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
    assert post(governor_no_hold, key, dialect).headers.get("x-llm-governor-source") == "upstream"
    r = post(governor_no_hold, key, dialect)
    assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "cooldown", dict(r.headers)
    assert_local_body(r, dialect)
    assert len(sim.requests_for(key)) == 1


def test_auto_dialect_answers_locally_in_the_requests_own_dialect(envoy_factory, sim):
    # No pools: every request is in `default`, dialect auto, decided from the request.
    envoy = envoy_factory({"hold": {"max_ms": 0}})
    for dialect in ("openai", "anthropic", "gemini", "azure"):
        key = new_key()
        sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
        assert post(envoy, key, dialect).headers.get("x-llm-governor-source") == "upstream", dialect
        r = post(envoy, key, dialect)
        assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "cooldown", dict(r.headers)
        assert_local_body(r, dialect)


# --------------------------------------------------------------------------------------------
# Keep-alive across local answers


def test_local_answer_keeps_the_connection_alive(governor, sim):
    key = new_key("sk-keepalive")
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    path, headers, body = request_in("openai", key)
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
