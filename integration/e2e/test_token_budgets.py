"""Token budgets end to end: usage read from real SDK responses (plain and streamed) through
Envoy, charged after the response, enforced on the tenant's next request on any worker."""

from __future__ import annotations

import uuid

import anthropic
import openai
import pytest

TPM = {
    "pools": [
        {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
        {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    ],
    # 600 tokens a minute = 10 a second; at most 100 banked.
    "limits": [{"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": 600, "burst": 100}],
    # The local answer of an exhausted budget is what these tests read; holding would wait it out.
    "hold": {"max_ms": 0},
}


def _openai(envoy, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=envoy.url + "/v1",
        api_key="sk-" + tenant,
        max_retries=0,
        default_headers={"x-tenant-id": tenant},
    )


def _anthropic(envoy, tenant: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=envoy.url,
        api_key="sk-" + tenant,
        max_retries=0,
        default_headers={"x-tenant-id": tenant},
    )


def _call(dialect: str, client, stream: bool) -> None:
    if dialect == "openai":
        kwargs = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            for _ in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
                pass
        else:
            client.chat.completions.create(**kwargs)
    else:
        kwargs = {"model": "claude-sonnet-4-6", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            with client.messages.stream(**kwargs) as s:
                for _ in s:
                    pass
        else:
            client.messages.create(**kwargs)


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_usage_is_charged_and_the_next_request_waits(envoy_factory, sim, dialect, stream):
    envoy = envoy_factory(TPM, concurrency=2)
    # 120 tokens per call: more than the 100 banked, so one call puts the tenant 20 in debt.
    sim.scenario({"mode": "ok", "usage": {"input_tokens": 80, "output_tokens": 40}})
    tenant = "tpm-" + uuid.uuid4().hex[:8]
    client = _openai(envoy, tenant) if dialect == "openai" else _anthropic(envoy, tenant)
    _call(dialect, client, stream)

    error = openai.RateLimitError if dialect == "openai" else anthropic.RateLimitError
    with pytest.raises(error) as refused:
        _call(dialect, client, stream)
    headers = refused.value.response.headers
    assert headers["x-llm-governor-source"] == "limit"
    assert headers["ratelimit-policy"] == '"tenant-tpm";q=600;w=60'
    # 21 tokens to refill at 10 per second, minus the time the first call took.
    assert 1000 < int(headers["retry-after-ms"]) <= 2100
    # The refused call never reached the provider; another tenant is unaffected.
    assert len(sim.requests_for("sk-" + tenant)) == 1
    other = "tpm-" + uuid.uuid4().hex[:8]
    _call(dialect, _openai(envoy, other) if dialect == "openai" else _anthropic(envoy, other), stream)
