"""What a client is told, and how the tests of classification, delays, configuration and
cooldowns check it: the pools of the four dialects (`harness.request_in`'s paths), the
configuration that lets every answer through from the provider, the delay headers
(`delay_ms`), their bounds (`assert_delay_within`), what each official SDK makes of them
(`check_delay`), and a local answer's body in each dialect (`assert_local_body`)."""

from __future__ import annotations

import math
import re

import anthropic
import openai

JITTER = 0.2
MAX_MS = 60_000
POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    {"name": "gemini", "match": {"path_prefix": "/v1beta/"}, "dialect": "gemini"},
    {"name": "azure", "match": {"path_prefix": "/openai/"}, "dialect": "azure_openai"},
]
# Every request reaches the upstream: for the tests of how upstream answers are rewritten.
NO_COOLDOWN = {
    "pools": POOLS,
    "retry_after": {"default_ms": 1000, "max_ms": MAX_MS, "jitter": JITTER},
    "cooldown": {"enabled": False},
}


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


def assert_local_body(r, dialect: str, klass: str = "rate_limited") -> None:
    """A local answer's JSON error body in the shape of `dialect`'s API (a requests.Response or
    a harness.Reply)."""
    assert r.headers.get("content-type", "").startswith("application/json"), dict(r.headers)
    body = r.json()
    if dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error", body
        assert body["error"]["message"], body
    elif dialect == "gemini":
        assert body["error"]["code"] == 429 and body["error"]["status"] == "RESOURCE_EXHAUSTED", body
        assert body["error"]["message"], body
    elif klass == "quota_exhausted":  # OpenAI and Azure OpenAI share one error shape
        assert body["error"]["code"] == "insufficient_quota", body
        assert body["error"]["type"] and body["error"]["message"], body
    else:
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error", body
        assert body["error"]["message"], body
