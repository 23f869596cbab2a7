"""Counting as the provider counts (issue 32), end to end: an agent on the official Anthropic
SDK through Envoy, against a simulator that counts as Anthropic documents (input = uncached
input + cache writes, output = tokens generated, its prompt cache), with the provider's own
limits written as per-dimension local limits; and per-day limits, with their `RateLimit`
fields."""

from __future__ import annotations

import re
import time
import uuid

import anthropic
import pytest
import requests

from harness import post, wait_for
from stats import prometheus_series

ANTHROPIC_POOL = {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"}


def agent_config(itpm: int, otpm: int) -> dict:
    return {
        "pools": [ANTHROPIC_POOL],
        "limits": [
            {"name": "itpm", "key": "account", "input_tokens_per_minute": itpm},
            {"name": "otpm", "key": "account", "output_tokens_per_minute": otpm},
        ],
    }


# About 2,000 tokens as the simulator counts them (bytes / 4), marked for the cache.
SYSTEM = [{"type": "text", "text": "You are a careful agent. Read the code before you change it. " * 130,
           "cache_control": {"type": "ephemeral"}}]


def turn(text: str) -> list:
    return [{"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}]


def agent(envoy, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=envoy.url, api_key=key, max_retries=0)


def series_count(envoy, stat: str) -> int:
    text = envoy.prometheus()
    want = prometheus_series("anthropic", stat, "_count")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def test_a_cached_prompt_and_a_large_max_tokens_are_not_counted(envoy_factory, sim):
    """ITPM 2,500 and OTPM 1,000 on the key, as the provider's own: the first call writes its
    2,000-token system prompt to the cache; the next one reads it, and reserves only its new
    turn, so it goes at once (reserved as a whole prompt it would not fit what is left). Neither
    is refused for a max_tokens of 16,000, which the provider does not count."""
    envoy = envoy_factory(agent_config(2_500, 1_000), concurrency=2)
    sim.scenario({"itpm": {"tokens": 2_500}, "otpm": {"tokens": 1_000}, "usage": {"output_tokens": 40}})
    key = "sk-ant-" + uuid.uuid4().hex[:8]
    client = agent(envoy, key)
    first = client.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=16_000, system=SYSTEM, messages=turn("Fix the test."))
    assert first.http_response.status_code == 200
    usage = first.parse().usage
    assert usage.cache_creation_input_tokens > 1_500 and usage.cache_read_input_tokens == 0
    second = client.messages.with_raw_response.create(
        model="claude-sonnet-4-5", max_tokens=16_000, system=SYSTEM,
        messages=turn("Fix the test.") + [{"role": "assistant", "content": "Reading it."}] + turn("Here it is."))
    assert second.http_response.status_code == 200
    assert "x-llm-governor-held-ms" not in second.http_response.headers
    assert second.parse().usage.cache_read_input_tokens > 1_500
    # A streamed turn settles from message_start / message_delta like a plain one.
    with client.messages.stream(model="claude-sonnet-4-5", max_tokens=16_000, system=SYSTEM,
                                messages=turn("Fix the test.")) as s:
        for _ in s:
            pass
    seen = sim.requests_for(key)
    assert [q["status"] for q in seen] == [200, 200, 200], seen
    assert [q["cache_read_tokens"] > 0 for q in seen] == [False, True, True]
    # Every settle recorded its prediction's error, input and output (histograms reach the
    # admin API at a stats flush, every 5 s by default).
    counts = lambda: (series_count(envoy, "input_prediction_error_pct"),  # noqa: E731
                      series_count(envoy, "output_prediction_error_pct"))
    assert wait_for(lambda: counts() == (3, 2), timeout_s=12), counts()


def test_the_input_limit_holds_what_the_provider_would_refuse(envoy_factory, sim):
    """With nothing cached, a second 2,000-token prompt does not fit an ITPM of 2,500 after the
    first: the gateway waits for the refill instead of the provider answering 429 (held, or
    answered locally with the `RateLimit` fields of a minute's window)."""
    envoy = envoy_factory(agent_config(2_500, 1_000), concurrency=1)
    sim.scenario({"itpm": {"tokens": 2_500}, "otpm": {"tokens": 1_000}, "usage": {"output_tokens": 40}})
    key = "sk-ant-" + uuid.uuid4().hex[:8]
    no_cache = [{"type": "text", "text": SYSTEM[0]["text"]}]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 16_000, "system": no_cache,
            "messages": [{"role": "user", "content": "go"}]}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01", "x-envoy-expected-rq-timeout-ms": "0"}
    first = requests.post(envoy.url + "/v1/messages", json=body, headers=headers, timeout=10)
    assert first.status_code == 200
    second = requests.post(envoy.url + "/v1/messages", json=body, headers=headers, timeout=10)
    assert second.status_code == 429 and second.headers["x-llm-governor-source"] == "limit"
    assert second.headers["ratelimit-policy"] == '"itpm";q=2500;w=60'
    assert [q["status"] for q in sim.requests_for(key)] == [200]


def test_a_per_day_limit_says_its_window(envoy_factory, sim):
    """`requests_per_day`: a day's budget, its bucket refilled over the day; the local answer's
    `RateLimit-Policy` says `w=86400` and the wait is the day's refill of one request."""
    config = {"pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
              "limits": [{"name": "rpd", "key": "account", "requests_per_day": 2}], "hold": {"max_ms": 0}}
    envoy = envoy_factory(config, concurrency=1)
    sim.scenario({"mode": "ok"})
    key = "sk-" + uuid.uuid4().hex[:8]
    assert [post(envoy, key).status_code for _ in range(2)] == [200, 200]
    r = post(envoy, key)
    assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "limit"
    assert r.headers["ratelimit-policy"] == '"rpd";q=2;w=86400'
    # Half a day until one request is back; clients are told the cap (retry_after.max_ms).
    assert re.fullmatch(r'"rpd";r=0;t=\d+', r.headers["ratelimit"])
    assert 43_000 <= int(r.headers["ratelimit"].rsplit("=", 1)[1]) <= 43_200
    assert len(sim.requests_for(key)) == 2


@pytest.mark.parametrize("bad", [
    {"cache_control": {"type": "ephemeral"}},  # at the top level
    {"system": [{"type": "mystery", "cache_control": {"type": "ephemeral", "ttl": "2d"}}]},
    {"system": [{"type": "text", "text": "x" * 400_000, "cache_control": {"type": "ephemeral"}}]},  # past the read limit
])
def test_odd_cache_control_is_estimated_never_refused(envoy_factory, sim, bad):
    envoy = envoy_factory(agent_config(1_000_000, 100_000), concurrency=1)
    sim.scenario({"mode": "ok"})
    key = "sk-ant-" + uuid.uuid4().hex[:8]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 16_000, "messages": [{"role": "user", "content": "hi"}], **bad}
    r = requests.post(envoy.url + "/v1/messages", json=body,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01"}, timeout=15)
    assert r.status_code == 200, r.text
    assert envoy.running
    time.sleep(0.05)
    assert len(sim.requests_for(key)) == 1
