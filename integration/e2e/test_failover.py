"""End-to-end: cooldown-aware failover. Two simulators are two providers behind two
Envoy clusters; the filter steers a cooling, out-of-quota or capped account's requests, before
they are sent, to the fallback pool, and Envoy routes them there on `x-llm-governor-pool` with
the fallback's injected credential. Every assertion reads what each provider logged.
"""

from __future__ import annotations

import time

import anthropic
import openai
import pytest

from conftest import simulator_fixtures
from harness import CHAT, Envoy, envoy_bootstrap, failover_bootstrap, governor_filter, new_key, post

BACKUP_KEY = "sk-backup-injected"
POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai", "fallback": ["openai-backup"]},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic", "fallback": ["anthropic-backup"]},
    {"name": "openai-backup", "dialect": "openai", "account": "backup",
     "match": {"header": {"name": "x-llm-governor-pool", "value": "openai-backup"}}},
    {"name": "anthropic-backup", "dialect": "anthropic", "account": "backup",
     "match": {"header": {"name": "x-llm-governor-pool", "value": "anthropic-backup"}}},
]
CONFIG = {"pools": POOLS}


# The fallback's provider, and the same one reset for each test.
backup_sim, backup = simulator_fixtures("backup_sim", "module", reset_name="backup")


@pytest.fixture
def gateway(envoy_factory, simulator, backup_sim):
    boot = failover_bootstrap(simulator.port, backup_sim.port, CONFIG,
                              backup_pools=("openai-backup", "anthropic-backup"), backup_key=BACKUP_KEY)
    return envoy_factory(None, bootstrap=boot)


def oai(envoy, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=envoy.url + "/v1", api_key=key, timeout=30, **kw)


def test_the_retry_after_a_primary_429_is_steered_to_the_fallback_with_its_credential(gateway, sim, backup):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 20, "keys": [key]})
    raw = oai(gateway, key, max_retries=2).chat.completions.with_raw_response.create(**CHAT)
    assert raw.parse().choices[0].message.content
    assert raw.headers["x-llm-governor-pool"] == "openai-backup"
    # One request to the primary (its 429 told the client to come back at once), one to the
    # fallback, which saw the injected credential and never the client's.
    assert [q["status"] for q in sim.requests_for(key)] == [429]
    seen = backup.requests()["requests"]
    assert [(q["key"], q["status"]) for q in seen] == [(BACKUP_KEY, 200)]
    assert gateway.pool_stat("openai", "failover") == 1
    # Later calls of the cooling account go straight to the fallback: no client retry at all.
    for _ in range(3):
        r = oai(gateway, key, max_retries=0).chat.completions.with_raw_response.create(**CHAT)
        assert r.headers["x-llm-governor-pool"] == "openai-backup"
    assert len(sim.requests_for(key)) == 1
    # Another account of the same pool is not steered.
    other = new_key()
    r = oai(gateway, other, max_retries=0).chat.completions.with_raw_response.create(**CHAT)
    assert "x-llm-governor-pool" not in r.headers
    assert [q["status"] for q in sim.requests_for(other)] == [200]


def test_streaming_through_a_cooled_primary_is_steered_with_no_client_retry(gateway, sim, backup):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 20, "count": 1, "keys": [key]})
    with pytest.raises(openai.RateLimitError):
        oai(gateway, key, max_retries=0).chat.completions.create(**CHAT)
    sim.scenario({"mode": "ok"})
    stream = oai(gateway, key, max_retries=0).chat.completions.create(**CHAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == "Hello from llm-sim"
    assert len(sim.requests_for(key)) == 1, "the stream went to the fallback, not the cooling primary"
    assert [q["status"] for q in backup.requests()["requests"]] == [200]


def test_a_spend_cap_on_the_primary_steers_every_later_call_for_quota_ms(gateway, sim, backup):
    key = new_key("sk-ant-fo")
    sim.scenario({"mode": "quota", "keys": [key]})
    client = anthropic.Anthropic(base_url=gateway.url, api_key=key, timeout=30, max_retries=2)
    for _ in range(4):
        raw = client.messages.with_raw_response.create(
            model="claude-sonnet-4-6", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
        assert raw.parse().content[0].text
        assert raw.headers["x-llm-governor-pool"] == "anthropic-backup"
    # The capped primary saw exactly one request; the fallback served all four calls.
    assert [q["status"] for q in sim.requests_for(key)] == [429]
    assert [q["status"] for q in backup.requests()["requests"]] == [200] * 4
    assert gateway.pool_stat("anthropic", "upstream_quota_exhausted") == 1


def test_when_both_are_cooling_the_request_is_held_until_the_fallback_frees(gateway, sim, backup):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 30, "keys": [key]})
    backup.scenario({"mode": "rate_limited", "retry_after_s": 2, "count": 1, "keys": [BACKUP_KEY]})
    client = oai(gateway, key, max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)  # the primary's 429: the fallback has room
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(**CHAT)  # steered, and the fallback's own 429
    started = time.monotonic()
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    assert raw.headers["x-llm-governor-pool"] == "openai-backup"
    held = int(raw.headers["x-llm-governor-held-ms"])
    assert 1_500 <= held <= 2_600 and time.monotonic() - started >= 1.5, held
    assert [q["status"] for q in backup.requests()["requests"]] == [429, 200]
    assert len(sim.requests_for(key)) == 1


def test_a_client_cannot_pick_the_fallback_pool_or_its_credential(gateway, sim, backup):
    key = new_key()
    r = post(gateway, key, headers={"x-llm-governor-pool": "openai-backup"})
    assert r.status_code == 200, r.text
    assert "x-llm-governor-pool" not in r.headers
    assert [q["status"] for q in sim.requests_for(key)] == [200], "routed to the primary as the policy chose"
    assert backup.requests()["requests"] == [], "the fallback (and its credential) was never used"
    assert gateway.pool_stat("openai-backup", "upstream_rate_limited") == 0


def test_a_fallback_whose_cluster_is_missing_gets_envoys_503(envoy_factory, simulator, sim):
    # A route to a cluster Envoy does not know (a static config refuses that at load unless
    # validate_clusters is off; a dynamic one may lose the cluster): Envoy answers 503 itself.
    boot = envoy_bootstrap(simulator.port, [governor_filter(CONFIG)])
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["route_config"]["validate_clusters"] = False
    hcm["route_config"]["virtual_hosts"][0]["routes"].insert(0, {
        "match": {"prefix": "/", "headers": [{"name": "x-llm-governor-pool", "string_match": {"exact": "openai-backup"}}]},
        "route": {"cluster": "no_such_cluster"},
    })
    envoy = envoy_factory(None, bootstrap=boot)
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 20, "count": 1, "keys": [key]})
    assert post(envoy, key).status_code == 429
    r = post(envoy, key)
    assert r.status_code == 503
    assert "x-llm-governor-class" not in r.headers, "Envoy's own 503 is not governed"


def test_an_invalid_fallback_is_refused_at_load_naming_the_field(simulator):
    bad = {"pools": [{"name": "a", "fallback": ["b"]}, {"name": "b", "fallback": ["a"]}]}
    failure = Envoy(bad, upstream_port=simulator.port).start_expecting_failure()
    assert "llm_governor: invalid configuration: pools[0].fallback: cycle" in failure.log, failure.log[-2000:]
