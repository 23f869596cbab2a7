"""End-to-end: what the filter makes of each provider's answer, against a real Envoy and the
provider simulator, written from the product contract: every classification (rate limit, quota,
overload, in each dialect), what the client is told for it, the counters and their Prometheus
labels; and what is not a rate limit (other errors, successes, streams) passes through
untouched, byte for byte and unbuffered. Cooldowns are off, so every answer is the provider's.
Each case uses its own API key, and the simulator scenario is limited to that key.
"""

from __future__ import annotations

import re
import time

import pytest

from answers import MAX_MS, NO_COOLDOWN, assert_delay_within, delay_ms
from conftest import module_envoy
from harness import PROMETHEUS_LABELS, native_only, new_key, post, wasm_only

governor = pytest.fixture(scope="module", name="governor")(module_envoy(NO_COOLDOWN))


def governor_headers(response) -> dict:
    return {k.lower(): v for k, v in response.headers.items() if k.lower().startswith("x-llm-governor-")}


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
    counter_before = governor.pool_stat(pool, CLASS_COUNTER[klass])

    r = post(governor, key, dialect)

    assert r.status_code == status
    assert r.headers.get("x-llm-governor-class") == klass
    assert r.headers.get("x-llm-governor-source") == "upstream"
    assert r.headers.get("x-should-retry") == ("false" if klass == "quota_exhausted" else "true")
    ms = delay_ms(r)
    if provider_ms is None:
        assert ms == MAX_MS, f"a quota answer without a time is told the quota time capped: {ms}"
    else:
        assert_delay_within(ms, provider_ms)
    assert governor.pool_stat(pool, CLASS_COUNTER[klass]) == counter_before + 1
    assert len(sim.requests_for(key)) == 1


@pytest.mark.parametrize(
    "dialect,scenario",
    [(case[1], case[3]) for case in CLASSIFICATIONS],
    ids=[case[0] for case in CLASSIFICATIONS],
)
def test_error_body_passes_through_byte_for_byte(governor, sim, dialect, scenario):
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})

    direct = post(sim, key, dialect)
    through_envoy = post(governor, key, dialect)

    assert through_envoy.status_code == direct.status_code
    assert through_envoy.content == direct.content
    if "content-type" in direct.headers:
        assert through_envoy.headers.get("content-type") == direct.headers["content-type"]


@wasm_only(PROMETHEUS_LABELS)
def test_counters_are_tagged_by_pool_in_prometheus(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 1, "keys": [key]})
    assert post(governor, key, "openai").status_code == 429

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
    assert post(governor, key, "openai").status_code == 429

    text = governor.prometheus()
    pattern = r'^envoy_dynamicmodulescustom_llm_governor_upstream\{llm_pool="openai",class="rate_limited"\} [1-9]\d*$'
    assert re.search(pattern, text, re.M), (
        "\n".join(line for line in text.splitlines() if "llm_governor" in line) or "no llm_governor metrics"
    )


# --------------------------------------------------------------------------------------------
# What is not a rate limit is left alone


@pytest.mark.parametrize("status", [400, 401, 404, 500])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_other_errors_are_untouched(governor, sim, dialect, status):
    key = new_key()
    sim.scenario({"mode": "error", "status": status, "keys": [key]})
    direct = post(sim, key, dialect)
    r = post(governor, key, dialect)

    assert r.status_code == status
    assert governor_headers(r) == {}
    assert ("retry-after-ms" in r.headers) == ("retry-after-ms" in direct.headers)
    assert r.headers.get("retry-after") == direct.headers.get("retry-after")
    assert r.headers.get("x-should-retry") == direct.headers.get("x-should-retry")
    assert r.content == direct.content


@pytest.mark.parametrize("dialect", ["openai", "anthropic", "azure", "gemini"])
def test_success_passes_through(governor, sim, dialect):
    key = new_key()
    r = post(governor, key, dialect)
    assert r.status_code == 200, r.text
    assert governor_headers(r) == {}
    assert "retry-after-ms" not in r.headers
    r.json()  # a complete JSON body


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_streaming_passes_through_unbuffered(governor, sim, dialect):
    key = new_key()
    sim.scenario({"mode": "ok", "stream_delay_ms": 150, "keys": [key]})

    started = time.monotonic()
    with post(governor, key, dialect, stream=True, timeout=20) as r:
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
