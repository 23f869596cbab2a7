"""End-to-end checks of the foundation (issue 2) against a real Envoy and the provider simulator.

Written from the product contract, not from the filter's code: every classification, every
delay source, body passthrough, untouched non-rate-limit errors, invalid configuration, the
missing allow_on_headers_stop_iteration case, and the official OpenAI and Anthropic SDKs as
clients. Each case uses its own API key, so the filter's per-(pool, account) memory cannot
couple cases, and the simulator scenario is limited to that key.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import anthropic
import openai
import pytest
import requests

from conftest import module_envoy
from harness import NATIVE, NO_STOP_ITERATION_OPTION, PROMETHEUS_LABELS, native_only, wasm_only

JITTER = 0.2
MAX_MS = 60_000
POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    {"name": "gemini", "match": {"path_prefix": "/v1beta/"}, "dialect": "gemini"},
    {"name": "azure", "match": {"path_prefix": "/openai/"}, "dialect": "azure_openai"},
]
# Every request reaches the upstream: these tests look at the rewriting of upstream answers.
NO_COOLDOWN = {
    "pools": POOLS,
    "retry_after": {"default_ms": 1000, "max_ms": MAX_MS, "jitter": JITTER},
    "cooldown": {"enabled": False},
}
DEFAULTS = {"pools": POOLS}
# The defaults without holding: for the tests of what a local answer says (test_hold.py holds).
NO_HOLD = {"pools": POOLS, "hold": {"max_ms": 0}}

governor = pytest.fixture(scope="module", name="governor")(module_envoy(NO_COOLDOWN))


# --------------------------------------------------------------------------------------------
# Requests in each provider's dialect


def new_key(prefix: str = "sk-e2e") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def provider_request(dialect: str, key: str, stream: bool = False):
    """(path, headers, json body) of a minimal real request in the dialect."""
    if dialect == "openai":
        body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", {"authorization": f"Bearer {key}"}, body
    if dialect == "anthropic":
        body = {
            "model": "claude-sonnet-4-6",
            "max_tokens": 32,
            "messages": [{"role": "user", "content": "hi"}],
        }
        if stream:
            body["stream"] = True
        return "/v1/messages", {"x-api-key": key, "anthropic-version": "2023-06-01"}, body
    if dialect == "azure":
        body = {"messages": [{"role": "user", "content": "hi"}]}
        return (
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
            {"api-key": key},
            body,
        )
    if dialect == "gemini":
        body = {"contents": [{"parts": [{"text": "hi"}]}]}
        return "/v1beta/models/gemini-2.0-flash:generateContent", {"x-goog-api-key": key}, body
    raise ValueError(dialect)


def send(base_url: str, dialect: str, key: str, stream: bool = False, timeout: float = 10.0):
    path, headers, body = provider_request(dialect, key, stream)
    return requests.post(base_url + path, headers=headers, json=body, timeout=timeout, stream=stream)


def governor_headers(response) -> dict:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-llm-governor-")}


def delay_ms(response) -> int:
    """retry-after-ms as the client sees it, after checking retry-after agrees with it."""
    assert "retry-after-ms" in response.headers, f"no retry-after-ms in {dict(response.headers)}"
    ms_text = response.headers["retry-after-ms"]
    assert re.fullmatch(r"\d+", ms_text), f"retry-after-ms {ms_text!r} is not whole milliseconds"
    ms = int(ms_text)
    seconds = response.headers.get("retry-after")
    assert seconds is not None and re.fullmatch(r"\d+", seconds), f"retry-after {seconds!r}"
    assert int(seconds) == math.ceil(ms / 1000), f"retry-after {seconds} != ceil({ms} ms / 1000)"
    return ms


def assert_delay_within(ms: int, provider_ms: float, provider_ms_high: float = None, slack_below_ms: float = 0.0):
    """Never earlier than the provider said; at most the provider's time plus jitter.

    provider_ms_high: for hints with whole-second precision (HTTP-date, RFC 3339), which the
    simulator rounds up, the provider's time lies in [provider_ms, provider_ms_high].
    """
    high = provider_ms if provider_ms_high is None else provider_ms_high
    lowest = provider_ms - slack_below_ms
    highest = math.ceil(high * (1 + JITTER)) + 1
    assert lowest <= ms <= highest, (
        f"retry-after-ms {ms} outside [{lowest:.0f}, {highest}] for a provider delay of "
        f"{provider_ms:.0f}..{high:.0f} ms (jitter {JITTER})"
    )


_ORACLES = {
    "openai": openai.OpenAI(api_key="oracle", base_url="http://127.0.0.1:9"),
    "anthropic": anthropic.Anthropic(api_key="oracle", base_url="http://127.0.0.1:9"),
}


def check_delay(response, provider_ms: float, provider_ms_high: float = None, slack_below_ms: float = 0.0):
    """The delay headers, and what each official SDK's own Retry-After parser makes of them."""
    ms = delay_ms(response)
    assert_delay_within(ms, provider_ms, provider_ms_high, slack_below_ms)
    for name, client in _ORACLES.items():
        waits_s = client._parse_retry_after_header(response.headers)
        assert waits_s is not None, f"the {name} SDK finds no delay in {dict(response.headers)}"
        assert waits_s * 1000 >= provider_ms - slack_below_ms, (
            f"the {name} SDK would come back after {waits_s * 1000:.0f} ms; the provider said {provider_ms:.0f} ms"
        )
    return ms


def counter(envoy, pool: str, name: str) -> int:
    return int(envoy.stat(f"llm_governor.pool.{pool}.{name}") or 0)


# --------------------------------------------------------------------------------------------
# Classification


# What the client is told for each: the provider's time in ms (told that plus up to 20 %), or
# None for a quota answer without one, which is told cooldown.quota_ms (300 s by default)
# capped by retry_after.max_ms: exactly MAX_MS. The simulator's 503s, 529s and Gemini
# RetryInfo carry its default hint of 1 s.
CLASSIFICATIONS = [
    # id, dialect, pool, scenario, status, class, provider ms
    ("openai-rate-limit", "openai", "openai", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3}, 429, "rate_limited", 3000),
    ("openai-insufficient-quota", "openai", "openai", {"mode": "quota"}, 429, "quota_exhausted", None),
    ("openai-503", "openai", "openai", {"mode": "unavailable"}, 503, "overloaded", 1000),
    ("anthropic-rate-limit", "anthropic", "anthropic", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3}, 429, "rate_limited", 3000),
    ("anthropic-spend-cap", "anthropic", "anthropic", {"mode": "quota"}, 429, "quota_exhausted", None),
    ("anthropic-529-overloaded", "anthropic", "anthropic", {"mode": "overloaded"}, 529, "overloaded", 1000),
    ("anthropic-503", "anthropic", "anthropic", {"mode": "unavailable"}, 503, "overloaded", 1000),
    ("azure-rate-limit", "azure", "azure", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3}, 429, "rate_limited", 3000),
    ("gemini-per-minute", "gemini", "gemini", {"mode": "gemini_minute"}, 429, "rate_limited", 1000),
    ("gemini-per-day", "gemini", "gemini", {"mode": "gemini_day"}, 429, "quota_exhausted", 1000),
]
CLASS_COUNTER = {
    "rate_limited": "upstream_rate_limited",
    "quota_exhausted": "upstream_quota_exhausted",
    "overloaded": "upstream_overloaded",
}


@pytest.mark.parametrize(
    "dialect,pool,scenario,status,klass,provider_ms",
    [case[1:] for case in CLASSIFICATIONS],
    ids=[case[0] for case in CLASSIFICATIONS],
)
def test_classification(governor, sim, dialect, pool, scenario, status, klass, provider_ms):
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})
    counter_before = counter(governor, pool, CLASS_COUNTER[klass])

    r = send(governor.url, dialect, key)

    assert r.status_code == status
    assert r.headers.get("x-llm-governor-class") == klass
    assert r.headers.get("x-llm-governor-source") == "upstream"
    assert r.headers.get("x-should-retry") == ("false" if klass == "quota_exhausted" else "true")
    ms = delay_ms(r)
    if provider_ms is None:
        assert ms == MAX_MS, f"a quota answer without a time is told the quota time capped: {ms}"
    else:
        assert_delay_within(ms, provider_ms)
    assert counter(governor, pool, CLASS_COUNTER[klass]) == counter_before + 1
    assert len(sim.requests_for(key)) == 1


@pytest.mark.parametrize(
    "dialect,scenario",
    [(case[1], case[3]) for case in CLASSIFICATIONS],
    ids=[case[0] for case in CLASSIFICATIONS],
)
def test_error_body_passes_through_byte_for_byte(governor, sim, dialect, scenario):
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})

    direct = send(sim.url, dialect, key)
    through_envoy = send(governor.url, dialect, key)

    assert through_envoy.status_code == direct.status_code
    assert through_envoy.content == direct.content
    if "content-type" in direct.headers:
        assert through_envoy.headers.get("content-type") == direct.headers["content-type"]


@wasm_only(PROMETHEUS_LABELS)
def test_counters_are_tagged_by_pool_in_prometheus(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 1, "keys": [key]})
    assert send(governor.url, "openai", key).status_code == 429

    text = governor.prometheus()
    assert re.search(r'^llm_governor_pool_upstream_rate_limited\{llm_pool="openai"\} [1-9]\d*$', text, re.M), (
        "\n".join(line for line in text.splitlines() if "llm_governor" in line) or "no llm_governor metrics"
    )


@native_only(PROMETHEUS_LABELS)
def test_counters_carry_pool_and_class_labels_in_prometheus_native(governor, sim):
    """The native module's stats are families with real labels, no stats_tags needed; the pool's
    label has the name the wasm build's stats_tags give it (llm_pool)."""
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 1, "keys": [key]})
    assert send(governor.url, "openai", key).status_code == 429

    text = governor.prometheus()
    pattern = r'^envoy_dynamicmodulescustom_llm_governor_upstream\{llm_pool="openai",class="rate_limited"\} [1-9]\d*$'
    assert re.search(pattern, text, re.M), (
        "\n".join(line for line in text.splitlines() if "llm_governor" in line) or "no llm_governor metrics"
    )


# --------------------------------------------------------------------------------------------
# Delay sources: the client is never told to come back earlier than the provider said


def test_delay_from_retry_after_ms(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "ms", "retry_after_s": 2.345, "keys": [key]})
    r = send(governor.url, "openai", key)
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-source") == "upstream"
    check_delay(r, 2345)


def test_delay_prefers_retry_after_ms_over_retry_after(governor, sim):
    key = new_key()
    # retry-after-ms: 1200 and retry-after: 2 — the finer one wins.
    sim.scenario({"mode": "rate_limited", "retry_after": "both", "retry_after_s": 1.2, "keys": [key]})
    direct = send(sim.url, "openai", key)
    assert (direct.headers.get("retry-after-ms"), direct.headers.get("retry-after")) == ("1200", "2")
    r = send(governor.url, "openai", key)
    assert r.status_code == 429
    check_delay(r, 1200)


def test_delay_from_retry_after_seconds(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 7, "keys": [key]})
    r = send(governor.url, "anthropic", key)
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-source") == "upstream"
    check_delay(r, 7000)


def provider_deadline_window(sim, key: str, hint_ms: int, sent_unix_ms: float, received_unix_ms: float):
    """For a hint given as an absolute time with whole seconds (HTTP-date, RFC 3339): the span in
    which the provider's remaining time lay while the filter handled the answer.

    The simulator writes the deadline as its clock at the request plus the hint, rounded up to
    the second; its log has that clock, so the deadline is known to the millisecond.
    """
    answered_at = sim.requests_for(key)[-1]["unix_ms"]
    deadline = math.ceil((answered_at + hint_ms) / 1000) * 1000
    return deadline - received_unix_ms, deadline - sent_unix_ms


def test_delay_from_retry_after_http_date(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "date", "retry_after_s": 10, "keys": [key]})
    sent = time.time() * 1000
    r = send(governor.url, "openai", key)
    received = time.time() * 1000
    assert r.status_code == 429
    check_delay(r, *provider_deadline_window(sim, key, 10_000, sent, received))


def test_delay_from_openai_reset_duration(governor, sim):
    key = new_key()
    # No retry-after at all: the simulator reports the exhausted dimension's reset instead.
    sim.scenario({"mode": "rate_limited", "retry_after": "none", "retry_after_s": 6.5, "keys": [key]})
    direct = send(sim.url, "openai", key)
    assert "retry-after" not in direct.headers and "retry-after-ms" not in direct.headers
    assert direct.headers.get("x-ratelimit-remaining-requests") == "0", dict(direct.headers)
    assert direct.headers.get("x-ratelimit-reset-requests"), dict(direct.headers)

    r = send(governor.url, "openai", key)
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-class") == "rate_limited"
    check_delay(r, 6500)


def test_delay_from_openai_reset_of_exhausted_token_dimension(governor, sim):
    key = new_key()
    sim.scenario(
        {
            "mode": "rate_limited",
            "retry_after": "none",
            "retry_after_s": 5.5,
            "dimension": "tokens",
            "ratelimit": {"remaining_requests": 499, "reset_requests_ms": 120},
            "keys": [key],
        }
    )
    direct = send(sim.url, "openai", key)
    assert direct.headers.get("x-ratelimit-remaining-tokens") == "0", dict(direct.headers)

    r = send(governor.url, "openai", key)
    assert r.status_code == 429
    # The requests dimension resets in 120 ms but is not the one exhausted.
    check_delay(r, 5500)


def test_delay_from_anthropic_rfc3339_reset(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "none", "retry_after_s": 8, "keys": [key]})
    direct = send(sim.url, "anthropic", key)
    assert "retry-after" not in direct.headers
    assert direct.headers.get("anthropic-ratelimit-requests-remaining") == "0", dict(direct.headers)
    assert direct.headers.get("anthropic-ratelimit-requests-reset"), dict(direct.headers)

    sent = time.time() * 1000
    r = send(governor.url, "anthropic", key)
    received = time.time() * 1000
    assert r.status_code == 429
    check_delay(r, *provider_deadline_window(sim, key, 8_000, sent, received))


def test_delay_from_gemini_retry_info(governor, sim):
    key = new_key()
    sim.scenario({"mode": "gemini_minute", "retry_after_s": 9, "keys": [key]})
    direct = send(sim.url, "gemini", key)
    assert "retryDelay" in direct.text, direct.text
    r = send(governor.url, "gemini", key)
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-class") == "rate_limited"
    check_delay(r, 9000)


def test_delay_is_capped_by_max_ms(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 600, "keys": [key]})
    r = send(governor.url, "openai", key)
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
        r = send(governor.url, "openai", key)
        assert r.status_code == 429
        assert r.headers.get("x-llm-governor-source") == "upstream"
        told.append(delay_ms(r))
    assert all(1 <= ms <= 1000 for ms in told), told
    assert len(set(told)) >= 4, f"not spread over [1, 1000] ms: {told}"


def test_clients_told_the_same_provider_time_are_spread_by_jitter(governor, sim):
    # Twelve accounts each told "2 s": between 2000 and 2400 ms, and not on the same tick.
    keys = [new_key() for _ in range(12)]
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 2, "keys": keys})
    told = [delay_ms(send(governor.url, "openai", key)) for key in keys]
    assert all(2000 <= ms <= 2400 for ms in told), told
    # Uniform over 400 ms: twelve values all within 80 ms of each other has odds below 1e-6.
    assert max(told) - min(told) >= 80, f"jitter does not spread clients: {told}"


# --------------------------------------------------------------------------------------------
# What is not a rate limit is left alone


@pytest.mark.parametrize("status", [400, 401, 404, 500])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_other_errors_are_untouched(governor, sim, dialect, status):
    key = new_key()
    sim.scenario({"mode": "error", "status": status, "keys": [key]})
    direct = send(sim.url, dialect, key)
    r = send(governor.url, dialect, key)

    assert r.status_code == status
    assert governor_headers(r) == {}
    assert ("retry-after-ms" in r.headers) == ("retry-after-ms" in direct.headers)
    assert r.headers.get("retry-after") == direct.headers.get("retry-after")
    assert r.headers.get("x-should-retry") == direct.headers.get("x-should-retry")
    assert r.content == direct.content


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "azure", "gemini"])
def test_success_passes_through(governor, sim, dialect):
    key = new_key()
    r = send(governor.url, dialect, key)
    assert r.status_code == 200, r.text
    assert governor_headers(r) == {}
    assert "retry-after-ms" not in r.headers
    r.json()  # a complete JSON body


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_streaming_passes_through_unbuffered(governor, sim, dialect):
    key = new_key()
    sim.scenario({"mode": "ok", "stream_delay_ms": 150, "keys": [key]})

    started = time.monotonic()
    with send(governor.url, dialect, key, stream=True, timeout=20) as r:
        assert r.status_code == 200
        assert r.headers.get("content-type", "").startswith("text/event-stream")
        assert governor_headers(r) == {}
        chunks = []
        first_chunk_at = None
        for chunk in r.iter_content(chunk_size=None):
            if first_chunk_at is None:
                first_chunk_at = time.monotonic() - started
            chunks.append(chunk)
    total = time.monotonic() - started
    text = b"".join(chunks).decode()

    if dialect == "openai":
        assert text.rstrip().endswith("data: [DONE]"), text[-200:]
    else:
        assert "event: message_stop" in text, text[-200:]
    # Events arrive as they are produced, not after the whole stream was buffered.
    assert len(chunks) > 1
    assert first_chunk_at < total - 0.2, f"first chunk at {first_chunk_at:.2f}s of {total:.2f}s"


# --------------------------------------------------------------------------------------------
# Configuration


def test_empty_configuration_uses_defaults(envoy_factory, sim):
    envoy = envoy_factory({})
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 2, "keys": [key]})
    r = send(envoy.url, "openai", key)
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-class") == "rate_limited"
    assert r.headers.get("x-llm-governor-source") == "upstream"
    # The default jitter (0.2) on top of the provider's 2 s, never below it.
    assert_delay_within(delay_ms(r), 2000)
    assert counter(envoy, "default", "upstream_rate_limited") == 1


@pytest.mark.parametrize(
    "config,field",
    [
        ({"retry_after": {"jitter": 5}}, "retry_after.jitter"),
        ({"bogus": 1}, "bogus"),
        ({"limits": [{"name": "x", "key": "header:x-t", "requests_per_minute": 0}]}, "limits[0].requests_per_minute"),
        ({"pools": [{"name": "Not A Valid Name", "match": {"path_prefix": "/"}, "dialect": "openai"}]}, "pools[0].name"),
        ({"retry_after": {"max_ms": "soon"}}, "retry_after.max_ms"),
        ("{not json", None),
    ],
    ids=["jitter-out-of-range", "unknown-field", "zero-rpm", "pool-name", "wrong-type", "not-json"],
)
def test_invalid_configuration_is_refused(simulator, config, field):
    from harness import Envoy

    failure = Envoy(config, upstream_port=simulator.port).start_expecting_failure()

    assert not failure.ready
    lines = [line for line in failure.log.splitlines() if "llm_governor: invalid configuration:" in line]
    assert lines, "no 'llm_governor: invalid configuration:' line in the log:\n" + failure.log[-3000:]
    message = lines[0].split("llm_governor: invalid configuration:", 1)[1].strip()
    assert re.match(r"\S.*: \S", message), f"not '<field>: <reason>': {message!r}"
    if field is not None:
        assert message.startswith(field + ":") or field in message.split(": ")[0], (
            f"expected the field {field!r} named first: {message!r}"
        )


# --------------------------------------------------------------------------------------------
# allow_on_headers_stop_iteration: false must not hang a response


@pytest.fixture(scope="module")
def governor_without_stop_iteration(simulator):
    yield from module_envoy(NO_COOLDOWN, allow_on_headers_stop_iteration=False)(simulator)


@wasm_only(NO_STOP_ITERATION_OPTION)
@pytest.mark.parametrize(
    "dialect,scenario,status,provider_ms",
    [
        ("openai", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3}, 429, 3000),
        ("openai", {"mode": "quota"}, 429, None),
        ("anthropic", {"mode": "overloaded"}, 529, 1000),
        ("anthropic", {"mode": "quota"}, 429, None),
    ],
    ids=["openai-rate-limit", "openai-quota", "anthropic-529", "anthropic-spend-cap"],
)
def test_without_stop_iteration_never_hangs(governor_without_stop_iteration, sim, dialect, scenario, status, provider_ms):
    envoy = governor_without_stop_iteration
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})
    direct = send(sim.url, dialect, key)

    started = time.monotonic()
    r = send(envoy.url, dialect, key, timeout=10)
    elapsed = time.monotonic() - started

    assert elapsed < 3.0, f"response took {elapsed:.1f}s"
    assert r.status_code == status
    assert r.content == direct.content
    # Classified by status and headers alone: the body that says "quota" never reached the
    # filter, so a quota 429 is a rate limit (the safe default: wait, do not give up).
    klass = "overloaded" if status == 529 else "rate_limited"
    assert r.headers.get("x-llm-governor-class") == klass
    assert r.headers.get("x-should-retry") == "true"
    assert r.headers.get("x-llm-governor-source") == "upstream"
    if provider_ms is None:
        # No time in the headers either: the first hint-less rate limit's backoff.
        assert 1 <= delay_ms(r) <= 1000
    else:
        assert_delay_within(delay_ms(r), provider_ms)


@wasm_only(NO_STOP_ITERATION_OPTION)
def test_without_stop_iteration_the_log_says_so(governor_without_stop_iteration, sim):
    envoy = governor_without_stop_iteration
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})
    send(envoy.url, "openai", key)
    send(envoy.url, "openai", key)

    lines = [line for line in envoy.log().splitlines() if "allow_on_headers_stop_iteration" in line]
    assert lines, "the fallback to status-and-headers classification is not logged"
    # Once, not once per response (each worker VM may say it once).
    assert len(lines) <= envoy.concurrency + 1, "\n".join(lines)


@wasm_only(NO_STOP_ITERATION_OPTION)
def test_without_stop_iteration_the_worker_stops_holding_for_a_minute_and_counts_it(envoy_factory, sim):
    """README: after 1 s without a body the filter classifies by status and headers alone,
    logs once, counts body_unavailable, and stops holding responses on that worker for a
    minute (then it tries again). One worker, so every response meets the same one."""
    envoy = envoy_factory(NO_COOLDOWN, allow_on_headers_stop_iteration=False, concurrency=1)
    sim.scenario({"mode": "quota"})

    def quota_429():
        started = time.monotonic()
        r = send(envoy.url, "openai", new_key(), timeout=10)
        assert r.status_code == 429 and r.headers.get("x-llm-governor-class") == "rate_limited", dict(r.headers)
        return time.monotonic() - started

    # The first one is held for its body, which never comes: answered after the 1 s wait.
    first = quota_429()
    gave_up_at = time.monotonic()
    assert 0.9 <= first < 3.0, f"the first 429 took {first:.2f} s (the body wait is 1 s)"
    assert counter(envoy, "openai", "body_unavailable") == 1
    # For the next minute nothing is held: answered at once, nothing more counted.
    for _ in range(3):
        assert quota_429() < 0.5
    assert counter(envoy, "openai", "body_unavailable") == 1
    time.sleep(max(0.0, gave_up_at + 55 - time.monotonic()))
    assert quota_429() < 0.5, "held again before the minute was over"
    assert counter(envoy, "openai", "body_unavailable") == 1
    # After the minute it tries again: held for the body, which still does not come.
    time.sleep(max(0.0, gave_up_at + 61 - time.monotonic()))
    again = quota_429()
    assert 0.9 <= again < 3.0, f"not held again after the minute: {again:.2f} s"
    assert counter(envoy, "openai", "body_unavailable") == 2
    warnings = [line for line in envoy.log().splitlines() if "held body never arrived" in line]
    assert len(warnings) == 1, warnings


# --------------------------------------------------------------------------------------------
# The official SDKs as clients


def openai_client(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, timeout=30)  # default max_retries=2


def anthropic_client(base_url: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=key, timeout=30)


def openai_call(client):
    return client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])


def anthropic_call(client):
    return client.messages.create(
        model="claude-sonnet-4-6", max_tokens=32, messages=[{"role": "user", "content": "hi"}]
    )


SDKS = {
    "openai-insufficient-quota": (openai_client, openai_call, openai.RateLimitError),
    "anthropic-spend-cap": (anthropic_client, anthropic_call, anthropic.RateLimitError),
}


@pytest.mark.parametrize("sdk", list(SDKS))
def test_sdk_does_not_retry_quota_through_governor(governor, sim, sdk):
    make_client, call, error = SDKS[sdk]
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})
    client = make_client(governor.url, key)

    for calls in (1, 2):
        with pytest.raises(error) as raised:
            call(client)
        assert raised.value.response.headers.get("x-llm-governor-class") == "quota_exhausted"
        assert len(sim.requests_for(key)) == calls, "the SDK retried a quota answer"


@pytest.mark.parametrize("sdk", list(SDKS))
def test_sdk_retries_quota_three_times_without_governor(envoy_factory, sim, sdk):
    make_client, call, error = SDKS[sdk]
    bare = envoy_factory(None)
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})

    with pytest.raises(error):
        call(make_client(bare.url, key))
    assert len(sim.requests_for(key)) == 3


@pytest.fixture(scope="module")
def governor_defaults(simulator):
    yield from module_envoy(DEFAULTS)(simulator)


@pytest.fixture(scope="module")
def governor_no_hold(simulator):
    yield from module_envoy(NO_HOLD)(simulator)


SDK_TRANSIENT = {
    "openai": (openai_client, openai_call),
    "anthropic": (anthropic_client, anthropic_call),
}


@pytest.mark.parametrize("sdk", list(SDK_TRANSIENT))
def test_sdk_waits_as_told_and_succeeds(governor_defaults, sim, sdk):
    make_client, call = SDK_TRANSIENT[sdk]
    key = new_key()
    sim.scenario(
        {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 2, "count": 1, "keys": [key]}
    )

    call(make_client(governor_defaults.url, key))  # raises if the call did not succeed

    seen = sim.requests_for(key)
    assert [q["status"] for q in seen] == [429, 200], json.dumps(seen)
    gap_ms = seen[1]["t_ms"] - seen[0]["t_ms"]
    assert gap_ms >= 2000, f"the retry came {gap_ms} ms after the 429 that asked for 2 s"


# --------------------------------------------------------------------------------------------
# Cooldown: while the provider says "not now", the gateway answers for it


def test_cooldown_answers_locally_until_the_provider_time(governor_no_hold, sim):
    envoy = governor_no_hold
    key, other_key = new_key(), new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
    local_before = counter(envoy, "openai", "local_reject_cooldown")

    first_sent = time.monotonic()
    first = send(envoy.url, "openai", key)
    assert first.headers.get("x-llm-governor-source") == "upstream"
    second = send(envoy.url, "openai", key)
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
    assert counter(envoy, "openai", "local_reject_cooldown") == local_before + 1

    # Another account in the same pool is not cooling.
    assert send(envoy.url, "openai", other_key).status_code == 200


def test_quota_answer_is_remembered_and_answered_locally(governor_no_hold, sim):
    envoy = governor_no_hold
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})
    local_before = counter(envoy, "anthropic", "local_reject_quota")

    first = send(envoy.url, "anthropic", key)
    assert first.headers.get("x-llm-governor-source") == "upstream"
    second = send(envoy.url, "anthropic", key)

    assert second.status_code == 429
    assert second.headers.get("x-llm-governor-source") == "cooldown"
    assert second.headers.get("x-llm-governor-class") == "quota_exhausted"
    assert second.headers.get("x-should-retry") == "false"
    body = second.json()  # the Anthropic dialect's error shape
    assert body.get("type") == "error" and body["error"].get("type") == "rate_limit_error", second.text
    assert len(sim.requests_for(key)) == 1
    assert counter(envoy, "anthropic", "local_reject_quota") == local_before + 1


def test_cap_shortens_what_clients_are_told_never_the_cooldown(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS, "retry_after": {"max_ms": 1000, "jitter": JITTER}, "hold": {"max_ms": 0}})
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 4, "keys": [key]})

    first = send(envoy.url, "openai", key)
    assert first.headers.get("x-llm-governor-source") == "upstream"
    assert delay_ms(first) == 1000

    time.sleep(1.1)  # the client obeys the capped delay; the provider's 4 s have not passed
    again = send(envoy.url, "openai", key)
    assert again.status_code == 429
    assert again.headers.get("x-llm-governor-source") == "cooldown"
    # About 2.9 s of the provider's 4 s are left: capped, the client is told the cap again.
    assert delay_ms(again) == 1000
    assert len(sim.requests_for(key)) == 1


def assert_local_body_shape(r, shape: str) -> None:
    """The local answer's JSON error body in the shape of `shape`'s API."""
    assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "cooldown", dict(r.headers)
    assert r.headers.get("content-type", "").startswith("application/json"), dict(r.headers)
    body = r.json()
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        assert body["error"]["message"], body
    elif shape == "gemini":
        assert body["error"]["code"] == 429 and body["error"]["status"] == "RESOURCE_EXHAUSTED", body
        assert body["error"]["message"], body
    else:  # OpenAI and Azure OpenAI share one error shape
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error", body
        assert body["error"]["message"], body


@pytest.mark.parametrize("dialect", ["gemini", "azure"])
def test_gemini_and_azure_pools_answer_locally_in_their_dialect(governor_no_hold, sim, dialect):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
    assert send(governor_no_hold.url, dialect, key).headers.get("x-llm-governor-source") == "upstream"
    assert_local_body_shape(send(governor_no_hold.url, dialect, key), dialect)
    assert len(sim.requests_for(key)) == 1


def test_auto_dialect_answers_locally_in_the_requests_own_dialect(envoy_factory, sim):
    # No pools: every request is in `default`, dialect auto, decided from the request.
    envoy = envoy_factory({"hold": {"max_ms": 0}})
    for dialect in ("openai", "anthropic", "gemini", "azure"):
        key = new_key()
        sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3, "keys": [key]})
        assert send(envoy.url, dialect, key).headers.get("x-llm-governor-source") == "upstream", dialect
        assert_local_body_shape(send(envoy.url, dialect, key), dialect)
