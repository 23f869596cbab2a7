"""Token budgets that reserve before the call, end to end through Envoy with the
official SDKs, plain and streamed: the estimate plus max_tokens is taken from the bucket before
the request goes upstream, the reservation is replaced by the provider's usage when the stream
ends (kept when no usage is reported), a request larger than the bucket is refused for good, and
the body reaches the provider byte for byte."""

from __future__ import annotations

import gzip
import re
import threading
import time
import uuid

import anthropic
import openai
import pytest
import requests

from harness import NO_STOP_ITERATION_OPTION, RawUpstream, envoy_bootstrap, governor_filter, wasm_only
from sdks import complete, tenant_client

BURST = 3000
CONFIG = {
    "pools": [
        {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
        {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    ],
    # 600 a minute (10 tokens a second: the bucket barely moves during a test), 3,000 banked;
    # settled with usage whatever the provider (the default, auto, counts OpenAI requests as
    # OpenAI's limiter does: see the last test). `output: "max_tokens"` keeps Anthropic's older
    # rule, max_tokens reserved, so both dialects reserve what these tests can read off; the
    # default (output predicted from usage) is test_counting.py's.
    "limits": [{"name": "tpm", "key": "header:x-tenant-id", "tokens_per_minute": 600, "burst": BURST,
                "settle": "usage", "output": "max_tokens"}],
    # These tests read the local answers; holding would wait them out.
    "hold": {"max_ms": 0},
}
# What the simulator reports for every call below: 50 in, 100 out.
USAGE = 150
# A one-line prompt, and its estimate: role, a few words, the message overhead.
PROMPT = "Say hi to the gateway."
MAX_INPUT = 40


@pytest.fixture
def governor(envoy_factory):
    return envoy_factory(CONFIG)


def new_tenant() -> str:
    return "res-" + uuid.uuid4().hex[:8]


def call(envoy, dialect: str, tenant: str, stream: bool, max_tokens: int, max_retries: int = 0,
         include_usage: bool = True):
    """One SDK call; returns None, or the SDK's status error."""
    try:
        client = tenant_client(envoy, dialect, tenant, max_retries)
        complete(client, dialect, stream, max_tokens, PROMPT, include_usage)
    except (openai.APIStatusError, anthropic.APIStatusError) as e:
        return e
    return None


def remaining(err) -> int:
    """The tokens left in the bucket, from a local answer's `ratelimit` field."""
    assert err is not None and err.status_code == 429, err
    assert err.response.headers["x-llm-governor-source"] == "limit", dict(err.response.headers)
    m = re.fullmatch(r'"tpm";r=(\d+);t=\d+', err.response.headers["ratelimit"])
    assert m, err.response.headers["ratelimit"]
    return int(m.group(1))


def slow_upstream(sim, tenant: str, latency_ms: int = 1500) -> None:
    sim.scenario({"mode": "ok", "latency_ms": latency_ms, "keys": ["sk-" + tenant],
                  "usage": {"input_tokens": 50, "output_tokens": 100}})


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_reservation_is_taken_before_the_call_and_settled_with_usage(governor, sim, dialect, stream):
    tenant = new_tenant()
    slow_upstream(sim, tenant)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("err", call(governor, dialect, tenant, stream, 2000)))
    t.start()
    time.sleep(0.5)
    # While the first call is upstream, its ~2,020 tokens are already gone from the bucket: a
    # second one like it does not fit (charged after the response, it would have gone).
    left = remaining(call(governor, dialect, tenant, stream, 2000))
    assert BURST - 2000 - MAX_INPUT <= left <= BURST - 2000, left
    t.join(10)
    assert not t.is_alive() and first["err"] is None, first
    # The first call's stream ended with usage 150: its reservation was replaced by it, so the
    # bucket holds ~2,850 (plus ~2 s of refill), not ~1,000. A request needing 2,990 shows it.
    left = remaining(call(governor, dialect, tenant, stream, 2990 - MAX_INPUT // 2))
    assert BURST - USAGE <= left <= BURST - USAGE + 40, left
    assert [q["status"] for q in sim.requests_for("sk-" + tenant)] == [200], "refused calls never went upstream"


def test_with_no_usage_reported_the_reservation_is_kept(governor, sim):
    tenant = new_tenant()
    slow_upstream(sim, tenant, latency_ms=10)
    # A stream without stream_options.include_usage reports no usage.
    assert call(governor, "openai", tenant, True, 2000, include_usage=False) is None
    left = remaining(call(governor, "openai", tenant, False, 2000))
    assert BURST - 2000 - MAX_INPUT <= left <= BURST - 2000 + 20, left


def test_an_error_from_the_provider_gives_the_reservation_back(governor, sim):
    tenant = new_tenant()
    sim.scenario({"mode": "error", "status": 400, "keys": ["sk-" + tenant]})
    err = call(governor, "openai", tenant, False, 2000)
    assert err is not None and err.status_code == 400
    sim.scenario({"mode": "ok", "keys": ["sk-" + tenant]})
    # Had the 400 kept its ~2,020 tokens, this one (~2,990) could not fit.
    assert call(governor, "openai", tenant, False, BURST - MAX_INPUT) is None
    assert [q["status"] for q in sim.requests_for("sk-" + tenant)] == [400, 200]


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
def test_a_request_larger_than_the_bucket_is_refused_once_and_not_retried(governor, sim, dialect):
    tenant = new_tenant()
    err = call(governor, dialect, tenant, False, BURST + 500, max_retries=2)
    assert err is not None and err.status_code == 429
    assert err.response.headers["x-should-retry"] == "false"
    assert "can never be admitted" in err.response.text, err.response.text
    assert sim.requests_for("sk-" + tenant) == []
    # The SDK made one attempt: the gateway counted no client retry.
    assert governor.pool_stat(dialect, "client_retries") == 0


def test_a_reservation_that_does_not_fit_is_held_until_the_refill_covers_it(envoy_factory, sim):
    """With hold on (the default), a call whose reservation does not fit waits at the gateway
    for the refill it lacks, then goes: no local 429, one upstream request each."""
    fast = dict(CONFIG["limits"][0], tokens_per_minute=60_000)  # 1,000 tokens a second
    envoy = envoy_factory(dict(CONFIG, limits=[fast], hold={}))
    tenant = new_tenant()
    slow_upstream(sim, tenant, latency_ms=2000)
    first = {}
    t = threading.Thread(target=lambda: first.setdefault("err", call(envoy, "openai", tenant, False, 2000)))
    t.start()
    time.sleep(0.3)
    # ~2,020 of 3,000 are reserved by the call upstream: this one lacks ~1,040, ~1 s of refill.
    client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="sk-" + tenant, max_retries=0, timeout=30,
                           default_headers={"x-tenant-id": tenant})
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-4o-mini", max_tokens=2000, messages=[{"role": "user", "content": PROMPT}])
    held_ms = int(raw.headers["x-llm-governor-held-ms"])
    assert 600 <= held_ms <= 1300, held_ms
    t.join(10)
    assert first["err"] is None
    assert [q["status"] for q in sim.requests_for("sk-" + tenant)] == [200, 200]
    assert envoy.pool_stat("openai", "local_reject_limit") == 0


@wasm_only(NO_STOP_ITERATION_OPTION)
def test_without_stop_iteration_a_reserving_limit_costs_one_second_a_minute_not_every_request(envoy_factory, sim):
    """Without allow_on_headers_stop_iteration Envoy delivers no body to a paused filter: the
    first request waits BODY_WAIT_MS (1 s) for it, then the worker stops reading bodies for a
    minute (its token limits charge after the response), logs it once and counts it."""
    envoy = envoy_factory(CONFIG, allow_on_headers_stop_iteration=False, concurrency=1)
    tenant = new_tenant()
    took = []
    for _ in range(4):
        started = time.monotonic()
        assert call(envoy, "openai", tenant, False, 100) is None
        took.append(time.monotonic() - started)
    assert 0.9 <= took[0] <= 3.0, took
    assert max(took[1:]) < 0.5, took
    assert envoy.pool_stat("openai", "body_unavailable") == 1
    assert len(sim.requests_for("sk-" + tenant)) == 4


def test_per_model_keys_from_the_body_and_the_azure_path(envoy_factory, sim):
    """key: model gives each model its own bucket: the body's model (OpenAI SDK), Azure's
    deployment from the path."""
    cfg = dict(CONFIG, limits=[{"name": "per-model", "key": "model", "requests_per_minute": 1}])
    envoy = envoy_factory(cfg)
    client = openai.OpenAI(base_url=envoy.url + "/v1", api_key="sk-" + new_tenant(), max_retries=0)
    ask = {"max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    client.chat.completions.create(model="gpt-4o", **ask)
    client.chat.completions.create(model="gpt-4o-mini", **ask)
    with pytest.raises(openai.RateLimitError) as refused:
        client.chat.completions.create(model="gpt-4o", **ask)
    assert refused.value.response.headers["ratelimit-policy"] == '"per-model";q=1;w=60'
    azure = openai.AzureOpenAI(azure_endpoint=envoy.url, api_key="sk-" + new_tenant(), api_version="2024-10-21",
                               max_retries=0)
    # The deployment names the model (the body's "model" is whatever the client put there).
    azure.chat.completions.create(model="prod-4o", **ask)
    with pytest.raises(openai.RateLimitError):
        azure.chat.completions.create(model="prod-4o", **ask)


def test_by_default_openai_requests_count_as_openai_does(envoy_factory, sim):
    """settle: auto (the default): OpenAI's TPM counts a request at admission (its characters /
    4 when more than the estimate, plus max_tokens) and never adjusts it, so the budget keeps
    what it reserved; an Anthropic request is settled with its usage."""
    limit = dict(CONFIG["limits"][0])
    del limit["settle"]
    envoy = envoy_factory(dict(CONFIG, limits=[limit]))
    for dialect, expect_left in (("openai", BURST - 1000), ("anthropic", BURST - USAGE)):
        tenant = new_tenant()
        slow_upstream(sim, tenant, latency_ms=10)
        assert call(envoy, dialect, tenant, True, 1000) is None
        left = remaining(call(envoy, dialect, tenant, False, BURST - MAX_INPUT))
        # OpenAI: the body's characters / 4 (the SDK's JSON is ~150 bytes) came off as well.
        low = expect_left - (80 if dialect == "openai" else 0)
        assert low <= left <= expect_left + 20, (dialect, left)


class _EchoUpstream(RawUpstream):
    """Records each request's body as received (content-length or chunked) and answers an
    OpenAI completion with usage."""

    ANSWER = (b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",'
              b'"content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":10,"completion_tokens":5,'
              b'"total_tokens":15}}')

    def __init__(self):
        super().__init__()
        self.bodies = []

    def serve(self, conn):
        f = conn.makefile("rb")
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = f.readline()
            if not line:
                return
            head += line
        headers = {k.strip().lower(): v.strip() for k, v in
                   (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:] if b":" in ln)}
        if b"content-length" in headers:
            body = f.read(int(headers[b"content-length"]))
        else:
            body = b""
            while True:
                size = int(f.readline().strip(), 16)
                chunk = f.read(size + 2)[:size]
                if size == 0:
                    break
                body += chunk
        self.bodies.append(body)
        # `connection: close`, or Envoy may reuse the connection this closes and answer the
        # next request with a 503 of its own (seen once: the upstream reset race).
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(self.ANSWER)).encode() + b"\r\n\r\n" + self.ANSWER)
        conn.close()


def test_bodies_pass_byte_for_byte_whatever_they_are(envoy_factory):
    """Large (past the 256 KiB read), chunked, gzip-encoded, not JSON, deeply nested: each
    reaches the provider exactly as sent, and none is refused because of the estimator."""
    cfg = dict(CONFIG, limits=[{"name": "tpm", "key": "pool", "tokens_per_minute": 10_000_000}])
    big = ('{"model":"gpt-4o","max_tokens":100,"messages":[{"role":"user","content":"'
           + "word " * 80_000 + '"}]}').encode()
    bodies = {
        "large": (big, {}),
        "gzip": (gzip.compress(big), {"content-encoding": "gzip"}),
        "not json": (b"\x00\x01 this is not json {{{", {}),
        "nested": (b"[" * 5000 + b"]" * 5000, {}),
        "truncated": (big[:1000], {}),
        "bad max_tokens": (b'{"max_tokens":"200","messages":[{"role":"user","content":"hi"}],"n":-1}', {}),
    }
    with _EchoUpstream() as up:
        envoy = envoy_factory(None, bootstrap=envoy_bootstrap(up.port, [governor_filter(cfg)]))
        url = envoy.url + "/v1/chat/completions"
        for name, (body, headers) in bodies.items():
            r = requests.post(url, data=body, headers={"content-type": "application/json", **headers}, timeout=10)
            assert r.status_code == 200, (name, r.status_code, r.text[:200])
            assert up.bodies[-1] == body, name
        # Chunked: a generator body has no content-length.
        r = requests.post(url, data=(big[i:i + 10_000] for i in range(0, len(big), 10_000)), timeout=10)
        assert r.status_code == 200, r.text[:200]
        assert up.bodies[-1] == big
    assert envoy.critical_wasm_lines() == []
