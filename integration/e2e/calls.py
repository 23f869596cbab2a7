"""The client side of a test: fresh API keys, a minimal real request in each provider's dialect,
one request on a connection of its own (`post`), an account cooled by the provider (`cool`),
and bursts over keep-alive connections (`post_concurrently`)."""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import requests

from processes import HarnessError

CHAT_PATH = "/v1/chat/completions"
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def new_key(prefix: str = "sk-e2e") -> str:
    """An API key no other test uses, so the filter's per-(pool, account) memory and the
    simulator's per-key scenarios cannot couple tests."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def request_in(dialect: str, key: str, stream: bool = False) -> tuple:
    """(path, headers, json body) of a minimal real request in the dialect, credential `key`."""
    if dialect == "openai":
        body = dict(CHAT)
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return CHAT_PATH, {"authorization": f"Bearer {key}"}, body
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


def post(
    target: Any,
    key: str,
    dialect: str = "openai",
    headers: Optional[dict] = None,
    body: Any = None,
    path: Optional[str] = None,
    stream: bool = False,
    timeout: float = 30.0,
) -> requests.Response:
    """One request to `target` (an Envoy or the Simulator: its `url`) on a connection of its
    own, closed after it (so it lands on the newest listener): `request_in(dialect, key)`, with
    `headers` added and `body` / `path` replacing the dialect's.

    Unless streamed, the body is read and `elapsed` is the whole exchange, from before the
    connection was opened until the last byte of the body."""
    dialect_path, dialect_headers, dialect_body = request_in(dialect, key, stream)
    started = time.monotonic()
    r = requests.post(
        target.url + (path or dialect_path),
        json=dialect_body if body is None else body,
        headers={**dialect_headers, "connection": "close", **(headers or {})},
        timeout=timeout,
        stream=stream,
    )
    if not stream:
        r.content  # noqa: B018 - read the body before the clock stops
        r.elapsed = timedelta(seconds=time.monotonic() - started)
    return r


def cool(sim: Any, envoy: Any, key: str, seconds: float) -> None:
    """One upstream 429 with `retry-after: seconds` for `key` through envoy, so the account cools
    that long; the simulator answers 200 again afterwards."""
    sim.scenario({"mode": "rate_limited", "retry_after_s": seconds, "count": 1, "keys": [key]})
    r = post(envoy, key)
    assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "upstream", dict(r.headers)
    sim.scenario({"mode": "ok"})


class Reply(NamedTuple):
    status: int
    headers: dict  # lower-case names
    body: bytes
    sent: float  # time.monotonic() just before the request was written
    received: float  # time.monotonic() once the whole response was read
    connection: int  # index of the client connection that carried it

    def json(self) -> Any:
        return json.loads(self.body)


def post_concurrently(
    url: str, per_connection: list, timeout_s: float = 30.0
) -> list:
    """Sends requests over several keep-alive connections at once, one thread per connection.

    per_connection[i] is the list of (path, headers, json body) that connection i sends, in
    order. Every connection is opened before any request is sent, so the connections are spread
    over Envoy's workers (the kernel balances accepted connections) before the burst starts.
    Returns every Reply, in completion order per connection.
    """
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    connections = [http.client.HTTPConnection(host, int(port), timeout=timeout_s) for _ in per_connection]
    for conn in connections:
        conn.connect()
    start = threading.Barrier(len(connections))
    results: list = [[] for _ in connections]
    errors: list = []

    def run(i: int) -> None:
        conn = connections[i]
        try:
            start.wait(timeout_s)
            for path, headers, body in per_connection[i]:
                payload = json.dumps(body).encode()
                sent = time.monotonic()
                conn.request("POST", path, body=payload, headers={"content-type": "application/json", **headers})
                response = conn.getresponse()
                data = response.read()
                received = time.monotonic()
                results[i].append(
                    Reply(
                        response.status,
                        {k.lower(): v for k, v in response.getheaders()},
                        data,
                        sent,
                        received,
                        i,
                    )
                )
        except Exception as err:  # reported to the caller below
            errors.append(f"connection {i}: {err!r}")
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(connections))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    if errors:
        raise HarnessError("client errors: " + "; ".join(errors))
    return [reply for replies in results for reply in replies]
