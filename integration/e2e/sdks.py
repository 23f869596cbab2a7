"""The official OpenAI and Anthropic SDKs as a tenant's client (the token-budget tests): a client
of either dialect whose key and `x-tenant-id` are the tenant's, and one completion through it,
plain or streamed to its end."""

from __future__ import annotations

from typing import Optional, Union

import anthropic
import openai


def tenant_client(envoy, dialect: str, tenant: str, max_retries: int = 0) -> Union[openai.OpenAI, anthropic.Anthropic]:
    """An SDK client of `dialect` through envoy: API key `sk-<tenant>`, header x-tenant-id."""
    headers = {"x-tenant-id": tenant}
    if dialect == "openai":
        return openai.OpenAI(base_url=envoy.url + "/v1", api_key="sk-" + tenant, max_retries=max_retries,
                             default_headers=headers)
    return anthropic.Anthropic(base_url=envoy.url, api_key="sk-" + tenant, max_retries=max_retries,
                               default_headers=headers)


def complete(client, dialect: str, stream: bool, max_tokens: Optional[int] = None, prompt: str = "hi",
             include_usage: bool = True) -> None:
    """One completion of `prompt`, a streamed one read to its end; raises the SDK's errors.
    max_tokens None: OpenAI is sent none; Anthropic, which requires one, 64. include_usage:
    whether an OpenAI stream asks for the usage chunk."""
    messages = [{"role": "user", "content": prompt}]
    if dialect == "openai":
        kwargs = {"model": "gpt-4o-mini", "messages": messages}
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if stream:
            extra = {"stream_options": {"include_usage": True}} if include_usage else {}
            for _ in client.chat.completions.create(stream=True, **extra, **kwargs):
                pass
        else:
            client.chat.completions.create(**kwargs)
    else:
        kwargs = {"model": "claude-sonnet-4-6", "max_tokens": 64 if max_tokens is None else max_tokens,
                  "messages": messages}
        if stream:
            with client.messages.stream(**kwargs) as s:
                for _ in s:
                    pass
        else:
            client.messages.create(**kwargs)
