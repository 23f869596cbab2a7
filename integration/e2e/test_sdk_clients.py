"""End-to-end: the official OpenAI and Anthropic SDKs as clients. Through the governor an SDK
does not retry a quota answer (without it, it retries twice more), and it waits as long as it
is told after a rate limit, then succeeds.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from answers import NO_COOLDOWN, POOLS
from conftest import module_envoy
from harness import new_key

governor = pytest.fixture(scope="module", name="governor")(module_envoy(NO_COOLDOWN))
governor_defaults = pytest.fixture(scope="module", name="governor_defaults")(module_envoy({"pools": POOLS}))


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
