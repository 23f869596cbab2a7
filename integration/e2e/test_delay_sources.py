"""End-to-end: every way a provider says when to come back (retry-after-ms, retry-after in
seconds or as an HTTP date, OpenAI's and Anthropic's reset headers, Gemini's RetryInfo) becomes
one delay the client is told, never earlier than the provider said and at most the jitter
later, in headers each official SDK reads; capped by retry_after.max_ms; and clients told the
same time are spread apart. Cooldowns are off, so every answer is the provider's.
"""

from __future__ import annotations

import math
import time

import pytest

from answers import MAX_MS, NO_COOLDOWN, check_delay, delay_ms
from conftest import module_envoy
from harness import new_key, post

governor = pytest.fixture(scope="module", name="governor")(module_envoy(NO_COOLDOWN))

# What the provider's own answer carries, checked on a request straight to the simulator: a
# header's value, ABSENT, or PRESENT (any value); under BODY, text its body contains.
ABSENT, PRESENT, BODY = None, ..., "body"

DELAY_SOURCES = [
    # id, dialect, scenario, the provider's answer, the provider's delay in ms, whether it is
    # given as an absolute time in whole seconds (an HTTP date, an RFC 3339 time)
    ("retry-after-ms", "openai", {"mode": "rate_limited", "retry_after": "ms", "retry_after_s": 2.345}, {},
     2345, False),
    # retry-after-ms: 1200 and retry-after: 2: the finer one wins.
    ("retry-after-ms-over-retry-after", "openai", {"mode": "rate_limited", "retry_after": "both", "retry_after_s": 1.2},
     {"retry-after-ms": "1200", "retry-after": "2"}, 1200, False),
    ("retry-after-seconds", "anthropic", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 7}, {},
     7000, False),
    ("retry-after-http-date", "openai", {"mode": "rate_limited", "retry_after": "date", "retry_after_s": 10}, {},
     10_000, True),
    # No retry-after at all: the simulator reports the exhausted dimension's reset instead.
    ("openai-reset-duration", "openai", {"mode": "rate_limited", "retry_after": "none", "retry_after_s": 6.5},
     {"retry-after": ABSENT, "retry-after-ms": ABSENT, "x-ratelimit-remaining-requests": "0",
      "x-ratelimit-reset-requests": PRESENT}, 6500, False),
    # The requests dimension resets in 120 ms but is not the one exhausted.
    ("openai-reset-of-exhausted-token-dimension", "openai",
     {"mode": "rate_limited", "retry_after": "none", "retry_after_s": 5.5, "dimension": "tokens",
      "ratelimit": {"remaining_requests": 499, "reset_requests_ms": 120}},
     {"x-ratelimit-remaining-tokens": "0"}, 5500, False),
    ("anthropic-rfc3339-reset", "anthropic", {"mode": "rate_limited", "retry_after": "none", "retry_after_s": 8},
     {"retry-after": ABSENT, "anthropic-ratelimit-requests-remaining": "0",
      "anthropic-ratelimit-requests-reset": PRESENT}, 8_000, True),
    ("gemini-retry-info", "gemini", {"mode": "gemini_minute", "retry_after_s": 9}, {BODY: "retryDelay"},
     9000, False),
]


def assert_provider_answer(direct, want: dict) -> None:
    for name, value in want.items():
        if name == BODY:
            assert value in direct.text, direct.text
        elif value is ABSENT:
            assert name not in direct.headers, dict(direct.headers)
        elif value is PRESENT:
            assert direct.headers.get(name), dict(direct.headers)
        else:
            assert direct.headers.get(name) == value, dict(direct.headers)


def provider_deadline_window(sim, key: str, hint_ms: int, sent_unix_ms: float, received_unix_ms: float):
    """For a hint given as an absolute time with whole seconds (HTTP-date, RFC 3339): the span in
    which the provider's remaining time lay while the filter handled the answer.

    The simulator writes the deadline as its clock at the request plus the hint, rounded up to
    the second; its log has that clock, so the deadline is known to the millisecond.
    """
    answered_at = sim.requests_for(key)[-1]["unix_ms"]
    deadline = math.ceil((answered_at + hint_ms) / 1000) * 1000
    return deadline - received_unix_ms, deadline - sent_unix_ms


@pytest.mark.parametrize(
    "dialect,scenario,provider_answer,provider_ms,absolute",
    [case[1:] for case in DELAY_SOURCES],
    ids=[case[0] for case in DELAY_SOURCES],
)
def test_the_client_is_never_told_to_come_back_earlier_than_the_provider_said(
    governor, sim, dialect, scenario, provider_answer, provider_ms, absolute
):
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})
    if provider_answer:
        assert_provider_answer(post(sim, key, dialect), provider_answer)

    sent = time.time() * 1000
    r = post(governor, key, dialect)
    received = time.time() * 1000
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-source") == "upstream"
    assert r.headers.get("x-llm-governor-class") == "rate_limited"
    if absolute:
        check_delay(r, *provider_deadline_window(sim, key, provider_ms, sent, received))
    else:
        check_delay(r, provider_ms)


def test_delay_is_capped_by_max_ms(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 600, "keys": [key]})
    r = post(governor, key, "openai")
    assert r.status_code == 429
    assert delay_ms(r) == MAX_MS
    assert r.headers["retry-after"] == str(MAX_MS // 1000)


def test_zero_retry_after_is_ignored_and_the_backoff_applies(governor, sim):
    # `retry-after: 0` is ignored, never trusted; the simulator's 429 has no other time (its
    # reset header says 1 s but remaining is not 0). So each client gets the backoff of a first
    # hint-less rate limit: uniform in [1, default_ms = 1000]. Eight accounts, each a first
    # 429: a filter that trusted the 0 would tell them all the same 1 ms, and one without the
    # backoff's full jitter the same 1000 ms.
    keys = [new_key() for _ in range(8)]
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 0, "keys": keys})
    told = []
    for key in keys:
        r = post(governor, key, "openai")
        assert r.status_code == 429
        assert r.headers.get("x-llm-governor-source") == "upstream"
        told.append(delay_ms(r))
    assert all(1 <= ms <= 1000 for ms in told), told
    assert len(set(told)) >= 4, f"not spread over [1, 1000] ms: {told}"


def test_clients_told_the_same_provider_time_are_spread_by_jitter(governor, sim):
    # Twelve accounts each told "2 s": between 2000 and 2400 ms, and not on the same tick.
    keys = [new_key() for _ in range(12)]
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 2, "keys": keys})
    told = [delay_ms(post(governor, key, "openai")) for key in keys]
    assert all(2000 <= ms <= 2400 for ms in told), told
    # Uniform over 400 ms: twelve values all within 80 ms of each other has odds below 1e-6.
    assert max(told) - min(told) >= 80, f"jitter does not spread clients: {told}"
