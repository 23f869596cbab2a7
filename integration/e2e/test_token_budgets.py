"""Token budgets charged after the response (`reserve: false`) end to end: usage read from real
SDK responses (plain and streamed) through Envoy, enforced on the tenant's next request on any
worker."""

from __future__ import annotations

import json
import socket
import struct
import time
import uuid

import anthropic
import openai
import pytest

from harness import RawUpstream, envoy_bootstrap, governor_filter
from sdks import complete, tenant_client

TPM = {
    "pools": [
        {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
        {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    ],
    # 600 tokens a minute = 10 a second; at most 100 banked.
    # Charged after the response (reserve: false); test_reservations.py covers the default.
    "limits": [{"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": 600, "burst": 100,
                "reserve": False}],
    # The local answer of an exhausted budget is what these tests read; holding would wait it out.
    "hold": {"max_ms": 0},
}


# A token takes 100 ms to refill (600 a minute); being one token off moves every wait by 100 ms,
# so the bounds below tell 120 charged tokens from 119 or 121. SLACK_MS covers Envoy reading
# whole milliseconds and the moment it charges, just after the stream ended.
MS_PER_TOKEN = 100
SLACK_MS = 30


def told_wait_bounds(debt: int, ended: tuple, asked: tuple) -> tuple:
    """The retry-after-ms of a request refused for a tenant `debt` tokens in debt, where the
    charge happened within `ended` (monotonic s) and the refused request within `asked`: the
    time to refill debt + 1 tokens, less what refilled between the two."""
    full = (debt + 1) * MS_PER_TOKEN
    return full - (asked[1] - ended[0]) * 1000 - SLACK_MS, full - (asked[0] - ended[1]) * 1000 + SLACK_MS


@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_usage_is_charged_and_the_next_request_waits(envoy_factory, sim, dialect, stream):
    envoy = envoy_factory(TPM, concurrency=2)
    # 120 tokens per call: more than the 100 banked, so one call puts the tenant 20 in debt.
    sim.scenario({"mode": "ok", "usage": {"input_tokens": 80, "output_tokens": 40}})
    tenant = "tpm-" + uuid.uuid4().hex[:8]
    client = tenant_client(envoy, dialect, tenant)
    started = time.monotonic()
    complete(client, dialect, stream)
    ended = (started, time.monotonic())

    error = openai.RateLimitError if dialect == "openai" else anthropic.RateLimitError
    asked_at = time.monotonic()
    with pytest.raises(error) as refused:
        complete(client, dialect, stream)
    asked = (asked_at, time.monotonic())
    headers = refused.value.response.headers
    assert headers["x-llm-governor-source"] == "limit"
    assert headers["ratelimit-policy"] == '"tenant-tpm";q=600;w=60'
    # All 120 tokens (prompt and completion) were charged: 21 tokens to refill, at 10 a
    # second, less the time since the charge.
    low, high = told_wait_bounds(20, ended, asked)
    told = int(headers["retry-after-ms"])
    assert low <= told <= high, f"told {told} ms; 120 charged tokens mean {low:.0f}..{high:.0f}"
    # The refused call never reached the provider; another tenant is unaffected.
    assert len(sim.requests_for("sk-" + tenant)) == 1
    other = "tpm-" + uuid.uuid4().hex[:8]
    complete(tenant_client(envoy, dialect, other), dialect, stream)


# --------------------------------------------------------------------------------------------
# Usage is charged however the stream ends

# Anthropic reports the input tokens first (message_start: input 150, output 1 so far), so a
# stream cut short after it has already used 151 tokens: 51 in debt.
CUT_USAGE = {"input_tokens": 150, "output_tokens": 40}
CUT_DEBT = 151 - 100
STREAM_BODY = {"model": "claude-sonnet-4-6", "max_tokens": 64, "stream": True,
               "messages": [{"role": "user", "content": "hi"}]}


def open_stream(port: int, tenant: str) -> socket.socket:
    """A streaming Anthropic request over a raw socket, read up to its message_start event."""
    body = json.dumps(STREAM_BODY).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(
        b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"x-api-key: sk-{tenant}\r\nanthropic-version: 2023-06-01\r\nx-tenant-id: {tenant}\r\n".encode()
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    data = b""
    while b"message_start" not in data:
        chunk = s.recv(65536)
        assert chunk, f"the stream ended before message_start: {data!r}"
        data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return s


def read_until_closed(s: socket.socket) -> None:
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    finally:
        s.close()


def refused_wait(envoy, tenant: str) -> tuple:
    """(retry-after-ms, (sent, received)) of the tenant's next request, which must be refused."""
    client = tenant_client(envoy, "anthropic", tenant)
    asked_at = time.monotonic()
    with pytest.raises(anthropic.RateLimitError) as refused:
        complete(client, "anthropic", False)
    asked = (asked_at, time.monotonic())
    headers = refused.value.response.headers
    assert headers["x-llm-governor-source"] == "limit", dict(headers)
    return int(headers["retry-after-ms"]), asked


def assert_charged(envoy, sim, tenant: str, ended: tuple) -> None:
    time.sleep(0.1)  # let Envoy finish the stream it saw end
    told, asked = refused_wait(envoy, tenant)
    low, high = told_wait_bounds(CUT_DEBT, ended, asked)
    assert low <= told <= high, f"told {told} ms; 151 charged tokens mean {low:.0f}..{high:.0f}"
    assert len(sim.requests_for("sk-" + tenant)) <= 1


def test_usage_is_charged_when_the_client_resets_the_stream(envoy_factory, sim):
    envoy = envoy_factory(TPM, concurrency=2)
    sim.scenario({"mode": "ok", "usage": CUT_USAGE, "stream_delay_ms": 300})
    tenant = "tpm-" + uuid.uuid4().hex[:8]
    s = open_stream(envoy.port, tenant)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    closed = time.monotonic()
    s.close()  # a reset, mid-stream
    assert_charged(envoy, sim, tenant, (closed, closed))


def test_usage_is_charged_when_the_route_times_out_mid_stream(simulator, envoy_factory, sim):
    # Route timeout 1 s against a stream of ten events 300 ms apart: Envoy resets it.
    bootstrap = envoy_bootstrap(simulator.port, [governor_filter(TPM)], route_timeout="1s")
    envoy = envoy_factory(None, bootstrap=bootstrap)
    sim.scenario({"mode": "ok", "usage": CUT_USAGE, "stream_delay_ms": 300})
    tenant = "tpm-" + uuid.uuid4().hex[:8]
    sent = time.monotonic()
    s = open_stream(envoy.port, tenant)
    streaming = time.monotonic()
    read_until_closed(s)
    # Envoy gives up on the stream (and charges it) 1 s after the request; the client sees the
    # connection close up to Envoy's delayed_close_timeout (1 s) later, so time it from there.
    assert_charged(envoy, sim, tenant, (sent + 1.0, streaming + 1.0))


class _CutStreamUpstream(RawUpstream):
    """A raw upstream that starts an Anthropic stream (headers and message_start) and then
    resets the connection."""

    MESSAGE_START = (
        b"event: message_start\ndata: "
        + json.dumps({"type": "message_start", "message": {
            "id": "msg_01cut", "type": "message", "role": "assistant", "model": "claude-sonnet-4-6",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 150, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 1}}}).encode()
        + b"\n\n"
    )

    def __init__(self):
        super().__init__()
        self.reset_at = []

    def serve(self, conn):
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                conn.close()
                return
            data += chunk
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                     + f"{len(self.MESSAGE_START):x}\r\n".encode() + self.MESSAGE_START + b"\r\n")
        time.sleep(0.3)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.reset_at.append(time.monotonic())
        conn.close()


def test_usage_is_charged_when_the_upstream_resets_mid_stream(envoy_factory):
    with _CutStreamUpstream() as upstream:
        envoy = envoy_factory(None, bootstrap=envoy_bootstrap(upstream.port, [governor_filter(TPM)]))
        tenant = "tpm-" + uuid.uuid4().hex[:8]
        s = open_stream(envoy.port, tenant)
        read_until_closed(s)
        (reset_at,) = upstream.reset_at
        time.sleep(0.1)
        told, asked = refused_wait(envoy, tenant)
        # Envoy charges the moment it sees the reset (the client may see its connection close
        # up to delayed_close_timeout later, which says nothing about the charge).
        low, high = told_wait_bounds(CUT_DEBT, (reset_at, reset_at), asked)
        assert low <= told <= high, f"told {told} ms; 151 charged tokens mean {low:.0f}..{high:.0f}"
