"""End-to-end: what an outside attack found (issue 10), each proven against a real Envoy."""

from __future__ import annotations

import http.client
import json

from harness import envoy_bootstrap, free_port, wasm_filter

POOLS = [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}]
CHAT = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}


def post(envoy, key: str):
    conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(CHAT),
                     headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        r = conn.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def test_envoys_own_503_is_not_taken_for_the_providers_overload(envoy_factory):
    # Nothing listens on the upstream port: Envoy answers 503 itself (connection failure).
    dead = free_port()
    envoy = envoy_factory(None, bootstrap=envoy_bootstrap(dead, [wasm_filter({"pools": POOLS})]))
    for _ in range(3):
        status, headers = post(envoy, "sk-dead")
        assert status == 503, (status, headers)
        # Ungoverned: no class, no cooldown, so the next request tries the upstream again
        # instead of being answered locally.
        assert "x-llm-governor-class" not in headers, headers
        assert "x-llm-governor-source" not in headers, headers
    assert int(envoy.stat("llm_governor.pool.openai.upstream_overloaded") or 0) == 0
    assert int(envoy.stat("llm_governor.pool.openai.local_reject_cooldown") or 0) == 0
    assert int(envoy.stat("cluster.provider.upstream_cx_connect_fail") or 0) >= 3
