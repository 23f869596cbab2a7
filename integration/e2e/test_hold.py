"""End-to-end: the gateway owns the spacing. A request that meets a cooldown, an empty
bucket or a full `max_in_flight` cap is held in Envoy while the wait fits the client's deadline,
released at the provider's pace, and answered locally only when it cannot wait.

Every assertion reads what the provider simulator logged (what reached it, in which order, how
many at once) or what the client got; timing is judged from the client's own clock.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import anthropic
import openai
import pytest

from harness import CHAT, NATIVE, cool, envoy_bootstrap, governor_filter, new_key, post, wait_for

POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
]
CONFIG = {"pools": POOLS}
# How long a wait for the held or in-flight count to settle may take.
SETTLE_S = 5.0


@pytest.fixture
def governor(envoy_factory):
    return envoy_factory(CONFIG)


# --------------------------------------------------------------------------------------------
# Deadlines


def test_a_60s_sdk_client_is_held_through_a_cooldown_and_succeeds_with_one_upstream_request(governor, sim):
    key = new_key()
    cool(sim, governor, key, 3)
    client = openai.OpenAI(base_url=governor.url + "/v1", api_key=key, timeout=60, max_retries=0)
    # The gateway times a hold on Envoy's wall clock, so the client's wait is measured on the same
    # clock: a fresh CI machine slewed its wall clock 12 ms against the monotonic one in 3 s.
    started, started_mono = time.time(), time.monotonic()
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    elapsed = time.time() - started
    # How far the wall clock ran ahead of the monotonic one meanwhile (a clock being slewed).
    ahead_ms = max(0.0, (elapsed - (time.monotonic() - started_mono)) * 1000)
    assert raw.http_request.headers["x-stainless-read-timeout"] == "60"
    assert raw.parse().choices[0].message.content
    held_ms = int(raw.headers["x-llm-governor-held-ms"])
    assert elapsed >= held_ms / 1000 - 0.002  # both ends of held_ms are whole milliseconds
    upstream = sim.requests_for(key)
    assert [q["status"] for q in upstream] == [429, 200], "exactly one upstream request for the held call"
    # It reached the provider once the provider's 3 s had passed, within a tick or so; the held
    # time is that, less however long the client took to send it after the 429.
    gap_ms = upstream[1]["t_ms"] - upstream[0]["t_ms"]
    # The two clocks tick apart by a few ms (the gateway's is the wall clock, the simulator's
    # monotonic). The wasm module polls every 20 ms, which lands it past the deadline; the native
    # module's timer wakes on a 20 ms grid of the wall clock, which may fall on the deadline
    # itself, so the slew between the clocks (seen up to 26 ms in 3 s on a 2-vCPU VM) shows whole.
    # A wall clock measured running ahead during the call (seen 15 ms in CI) ends the gateway's
    # 3 s that much sooner on the simulator's clock.
    assert (2_960 if NATIVE else 2_990) - ahead_ms <= gap_ms <= 3_300, (gap_ms, ahead_ms)
    assert 0 < held_ms <= gap_ms, (held_ms, gap_ms)
    assert governor.pool_stat("openai", "held") == 1 and governor.pool_stat("openai", "hold_released") == 1
    assert wait_for(lambda: governor.pool_stat("openai", "held_requests") == 0, SETTLE_S)


def test_a_3s_client_meeting_a_5s_cooldown_is_answered_at_once(governor, sim):
    key = new_key()
    cool(sim, governor, key, 5)
    client = openai.OpenAI(base_url=governor.url + "/v1", api_key=key, timeout=3, max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(**CHAT)
    assert time.monotonic() - started < 1.0
    headers = err.value.response.headers
    assert headers["x-llm-governor-source"] == "cooldown"
    assert "x-llm-governor-held-ms" not in headers
    assert 0 < int(headers["retry-after-ms"]) <= 5_000 * 1.2
    assert [q["status"] for q in sim.requests_for(key)] == [429]
    assert governor.pool_stat("openai", "held") == 0


def test_the_anthropic_sdk_is_held_too(governor, sim):
    key = new_key("sk-ant-hold")
    sim.scenario({"mode": "rate_limited", "retry_after_s": 2, "count": 1, "keys": [key]})
    client = anthropic.Anthropic(base_url=governor.url, api_key=key, timeout=30, max_retries=0)
    with pytest.raises(anthropic.RateLimitError):
        client.messages.create(model="claude-sonnet-4-6", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
    raw = client.messages.with_raw_response.create(
        model="claude-sonnet-4-6", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.parse().content[0].text
    assert 1_500 <= int(raw.headers["x-llm-governor-held-ms"]) <= 2_500
    assert [q["status"] for q in sim.requests_for(key)] == [429, 200]


def test_quota_exhaustion_is_never_held(governor, sim):
    key = new_key()
    sim.scenario({"mode": "quota", "count": 1, "keys": [key]})
    assert post(governor, key).status_code == 429
    sim.scenario({"mode": "ok"})
    r = post(governor, key)
    assert r.status_code == 429 and r.elapsed.total_seconds() < 0.5, (r.status_code, r.elapsed)
    assert r.headers["x-should-retry"] == "false"
    assert r.headers["x-llm-governor-class"] == "quota_exhausted"
    assert "x-llm-governor-held-ms" not in r.headers
    assert len(sim.requests_for(key)) == 1
    assert governor.pool_stat("openai", "held") == 0


def test_a_wait_longer_than_max_ms_is_answered_at_once(governor, sim):
    key = new_key()
    cool(sim, governor, key, 15)  # hold.max_ms is 10 s by default
    r = post(governor, key)
    assert r.status_code == 429 and r.elapsed.total_seconds() < 0.5
    assert r.headers["x-llm-governor-source"] == "cooldown"


# --------------------------------------------------------------------------------------------
# Release at the provider's pace, in arrival order


def test_held_requests_reach_the_provider_in_arrival_order_one_probe_first(envoy_factory, sim):
    # The gateway's account is the `authorization` header; the simulator keys its log on the
    # first of x-api-key/authorization, so a per-request x-api-key names each request there.
    envoy = envoy_factory({"pools": POOLS, "account_headers": ["authorization"]}, concurrency=1)
    key = new_key()
    cool(sim, envoy, key, 2)
    # Each answer reports one request left: the pace then lets one go per answer, so the order
    # of release is the order the provider sees (within one round, released requests travel
    # on separate upstream connections and may overtake each other on the way).
    sim.scenario({"mode": "ok", "ratelimit": {"remaining_requests": 1}})
    results: dict = {}

    def send(i: int) -> None:
        results[i] = post(envoy, key, headers={"x-api-key": f"{key}-seq{i}"})

    threads = []
    for i in range(6):
        t = threading.Thread(target=send, args=(i,))
        t.start()
        threads.append(t)
        time.sleep(0.05)  # arrival order = i
    for t in threads:
        t.join(20)
    assert all(results[i].status_code == 200 for i in range(6)), {i: r.status_code for i, r in results.items()}
    upstream = [q for q in sim.requests()["requests"] if q["key"].startswith(f"{key}-seq")]
    assert [q["key"] for q in upstream] == [f"{key}-seq{i}" for i in range(6)]
    # One at a time, as the provider's remaining said: nothing else was in flight at arrival.
    assert [q["in_flight"] for q in upstream] == [0] * 6
    assert all(int(results[i].headers["x-llm-governor-held-ms"]) > 1_000 for i in range(6))


def test_a_new_cooldown_keeps_the_rest_held_and_costs_one_provider_429_per_round(envoy_factory, sim):
    envoy = envoy_factory(CONFIG, concurrency=2)
    key = new_key()
    # The provider keeps saying "not now" for 2.5 s, in 1 s steps.
    sim.scenario({"mode": "rate_limited", "retry_after_s": 1, "until_ms": 2_500, "keys": [key]})
    first = post(envoy, key)
    assert first.status_code == 429
    results = []

    def send() -> None:
        results.append(post(envoy, key))

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    statuses = [q["status"] for q in sim.requests_for(key)]
    # After the first wave's 429, each 1 s round costs one probe until the provider recovers
    # at 2.5 s: rounds end at ~1 s and ~2 s (two 429s, returned to those two probes' clients,
    # nothing is replayed), and the probe at ~3 s succeeds and opens the pace for the rest.
    probes_refused = statuses.count(429) - 1
    assert 1 <= probes_refused <= 3, statuses
    assert sorted(r.status_code for r in results) == [200] * (8 - probes_refused) + [429] * probes_refused
    assert statuses.count(200) == 8 - probes_refused
    assert all(int(r.headers["x-llm-governor-held-ms"]) > 500 for r in results if r.status_code == 200)


# --------------------------------------------------------------------------------------------
# Bounds: max_held, hold off, leavers


def test_past_max_held_requests_are_answered_at_once(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS, "hold": {"max_held": 2}}, concurrency=1)
    key = new_key()
    cool(sim, envoy, key, 2)
    results = []

    def send() -> None:
        results.append(post(envoy, key))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: envoy.pool_stat("openai", "held_requests") == 2, SETTLE_S)
    r = post(envoy, key)
    assert r.status_code == 429 and r.elapsed.total_seconds() < 0.5 and r.headers["x-llm-governor-source"] == "cooldown"
    for t in threads:
        t.join(10)
    assert sorted(r.status_code for r in results) == [200, 200]


def test_hold_off_answers_locally_as_before(envoy_factory, sim):
    envoy = envoy_factory({"pools": POOLS, "hold": {"max_ms": 0}})
    key = new_key()
    cool(sim, envoy, key, 2)
    r = post(envoy, key)
    assert r.status_code == 429 and r.elapsed.total_seconds() < 0.5 and r.headers["x-llm-governor-source"] == "cooldown"
    assert envoy.pool_stat("openai", "held") == 0


def test_clients_that_leave_while_held_leave_nothing(governor, sim):
    key = new_key()
    cool(sim, governor, key, 3)
    body = json.dumps(CHAT).encode()
    socks = []
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", governor.port))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)
    assert wait_for(lambda: governor.pool_stat("openai", "held_requests") == 5, SETTLE_S)
    for s in socks:
        s.close()
    assert wait_for(lambda: governor.pool_stat("openai", "held_requests") == 0, SETTLE_S)
    assert wait_for(lambda: int(governor.stat("http.llm_gateway.downstream_rq_active", 0) or 0) == 0, SETTLE_S)
    time.sleep(3.2)  # past the cooldown: nothing is sent upstream for them
    assert [q["status"] for q in sim.requests_for(key)] == [429]
    # The account is not stuck: its next request is the probe and goes at once.
    r = post(governor, key)
    assert r.status_code == 200 and r.elapsed.total_seconds() < 1.0, r.headers


# --------------------------------------------------------------------------------------------
# max_in_flight


def cap_config(cap: int, **hold) -> dict:
    config = {"pools": POOLS, "limits": [{"name": "cap", "key": "account", "max_in_flight": cap}]}
    if hold:
        config["hold"] = hold
    return config


@pytest.mark.parametrize("concurrency", [2, 4])
def test_max_in_flight_is_exact_across_workers_and_callers_wait_instead_of_429(envoy_factory, sim, concurrency):
    """The overnight-storm shape: the provider rejects beyond 10 in flight, 300 ms per call;
    30 SDK clients x 2 calls through a gateway capped at 8."""
    envoy = envoy_factory(cap_config(8), concurrency=concurrency)
    key = new_key()
    sim.scenario({"mode": "ok", "latency_ms": 300, "max_concurrency": 10})
    client_errors: list = []
    done: list = []

    def worker() -> None:
        client = openai.OpenAI(base_url=envoy.url + "/v1", api_key=key, timeout=60, max_retries=0)
        for _ in range(2):
            try:
                client.chat.completions.create(**CHAT)
                done.append(1)
            except Exception as err:  # noqa: BLE001 - reported below
                client_errors.append(repr(err))

    threads = [threading.Thread(target=worker) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    report = sim.requests()
    upstream = sim.requests_for(key)
    assert not client_errors, client_errors[:3]
    assert len(done) == 60
    contention = envoy.pool_stat("openai", "store_contention")
    assert report["max_in_flight_by_key"][key] <= 8, (report["max_in_flight_by_key"], f"store_contention {contention}")
    assert report["max_in_flight_by_key"][key] >= 6, "the cap was never approached: no contention tested"
    assert [q["status"] for q in upstream] == [200] * 60
    assert wait_for(lambda: envoy.pool_stat("openai", "in_flight") == 0, SETTLE_S)
    assert envoy.pool_stat("openai", "held") > 0


def test_in_flight_slots_come_back_however_a_stream_ends(simulator, envoy_factory, sim):
    # Route timeout 1 s against a 2 s provider: Envoy answers 504 itself.
    bootstrap = envoy_bootstrap(simulator.port, [governor_filter(cap_config(2, max_ms=0))], route_timeout="1s")
    envoy = envoy_factory(None, bootstrap=bootstrap)
    key = new_key()
    sim.scenario({"mode": "ok", "latency_ms": 2_000})
    # Timeout: Envoy's own 504.
    assert post(envoy, key).status_code == 504
    # Client reset while upstream.
    s = socket.create_connection(("127.0.0.1", envoy.port))
    body = json.dumps(CHAT).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {key}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    time.sleep(0.3)
    s.close()
    # Complete, and an upstream error.
    sim.scenario({"mode": "ok"})
    assert post(envoy, key).status_code == 200
    sim.scenario({"mode": "error", "status": 500, "count": 1, "keys": [key]})
    assert post(envoy, key).status_code == 500
    sim.scenario({"mode": "ok", "latency_ms": 700})
    assert wait_for(lambda: envoy.pool_stat("openai", "in_flight") == 0, SETTLE_S)
    # Both slots are free: two at once go, the third is answered locally (hold is off here).
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(envoy, key))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    r = post(envoy, key)
    for t in threads:
        t.join(10)
    assert sorted(q.status_code for q in results) == [200, 200]
    assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "limit", r.headers
    assert wait_for(lambda: envoy.pool_stat("openai", "in_flight") == 0, SETTLE_S)


def test_sdk_retries_are_counted_from_x_stainless_retry_count(governor, sim):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after_s": 1, "count": 1, "keys": [key]})
    client = openai.OpenAI(base_url=governor.url + "/v1", api_key=key, timeout=30, max_retries=2)
    assert client.chat.completions.create(**CHAT).choices[0].message.content
    assert [q["status"] for q in sim.requests_for(key)] == [429, 200]
    assert governor.pool_stat("openai", "client_retries") == 1
    assert governor.pool_stat("openai", "succeeded_after_retry") == 1


# --------------------------------------------------------------------------------------------
# Who goes first


@pytest.mark.parametrize("fair_key", [False, True], ids=["arrival-order", "fair-key"])
def test_held_tenants_take_turns_with_a_fair_key(envoy_factory, sim, fair_key):
    """Six batch requests, then two chat requests, held through one cooldown of one account on
    one worker. The pace lets one go an answer: with `hold.fair_key: header:x-tenant-id` the
    chat tenant's turn comes every other release (batch, chat, batch, chat, ...), in arrival
    order the chat requests leave last. The order is read where the provider logged it."""
    # The gateway's account is the `authorization` header; a per-request x-api-key names each
    # request in the simulator's log (as in the arrival-order test above).
    config = {"pools": POOLS, "account_headers": ["authorization"]}
    if fair_key:
        config["hold"] = {"fair_key": "header:x-tenant-id"}
    envoy = envoy_factory(config, concurrency=1)
    key = new_key()
    cool(sim, envoy, key, 2)
    # Each answer reports one request left: one release per answer, so the provider sees them
    # in the order they were released. (Told 59 left, the pace opened every release at once
    # and the clients' completion times ordered requests that were on their way together.)
    sim.scenario({"mode": "ok", "ratelimit": {"remaining_requests": 1}})
    done: list = []

    def call(tenant: str, i: int) -> None:
        headers = {"x-tenant-id": tenant, "x-api-key": f"{key}-{tenant}-{i}"}
        r = post(envoy, key, headers=headers, timeout=20)
        done.append((tenant, i, r.status_code, r.headers.get("x-llm-governor-held-ms")))

    tenants = ["batch"] * 6 + ["chat"] * 2
    threads = []
    for i, tenant in enumerate(tenants):
        threads.append(threading.Thread(target=call, args=(tenant, i)))
        threads[-1].start()
        time.sleep(0.05)  # each is held before the next arrives: arrival order is known
    for t in threads:
        t.join(30)
    assert [d[2] for d in done] == [200] * 8, done
    assert all(d[3] is not None for d in done), f"all were held: {done}"
    upstream = [q for q in sim.requests()["requests"] if q["key"].startswith(f"{key}-")]
    order = [q["key"].split("-")[-2] for q in upstream]
    want = (["batch", "chat", "batch", "chat"] + ["batch"] * 4) if fair_key else tenants
    assert order == want, [q["key"] for q in upstream]
    assert [q["status"] for q in upstream] == [200] * 8
