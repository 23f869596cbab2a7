"""Fleet limits end to end: three Envoys (distinct ports and base ids) loading the same module
share budgets through two Limitador-compatible services (integration/limitador-rls, built on
the `limitador` crate) on one real Redis. The provider simulator counts every request it sees:
a fleet budget is exact when the provider sees the budget, not three times it.

With LLM_GOVERNOR_LIMITADOR_SERVER=/path/to/limitador-server the services are two instances of
Kuadrant's own server instead (fleet_rig.REAL_SERVER). It has no Reserve / Commit, so token
budgets run with `"reservations": false` (charged at admission with ShouldRateLimit's
hits_addend), and no fault injection: the tests that need the fixture's faults are skipped, and
a paused process (SIGSTOP) stands in for a slow one."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import requests

from fleet_rig import (LIMITADOR_SERVER, REAL_SERVER, RLS_BINARY, RLS_CLUSTER, TURN_SERVICE_ARGS, Redis,
                       fleet_envoy, limits_file, rls_service, validate_limits)
from harness import REPO_ROOT, Envoy, envoy_bootstrap, governor_filter, new_key, post, wait_for

pytestmark = [
    pytest.mark.skipif(not REAL_SERVER and not RLS_BINARY.exists(),
                       reason="make test builds integration/limitador-rls first"),
]


def fixture_only(what: str):
    """For a test that needs what only the fixture has."""
    return pytest.mark.skipif(REAL_SERVER, reason=f"limitador-server ({LIMITADOR_SERVER}) has no {what}")


def real_server_only(why: str):
    return pytest.mark.skipif(not REAL_SERVER, reason=f"set LLM_GOVERNOR_LIMITADOR_SERVER: {why}")


RPM = 12
TPM = 3000
# Kuadrant's limitador-server has no Reserve / Commit (kuadrant.service.ratelimit.v1 there is
# CheckRateLimit and Report): token budgets go without reservations against it.
RESERVATIONS = not REAL_SERVER
CONFIG = {
    "pools": [{"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"}],
    # Two shared cores run three Envoys, two services and Redis: the timeout allows for that.
    "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "reservations": RESERVATIONS},
    "limits": [
        {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": RPM, "scope": "fleet"},
        {"name": "tenant-tpm", "key": "header:x-tenant-id", "tokens_per_minute": TPM, "scope": "fleet"},
    ],
    # Refusals are answered at once here: the hold of a fleet refusal is tested on its own.
    "hold": {"max_ms": 0},
}


def body(max_tokens: int = 16) -> dict:
    return {"model": "gpt-4o-mini", "max_tokens": max_tokens, "messages": [{"role": "user", "content": "hi"}]}


def tenant_post(envoy, tenant: str, key: str, max_tokens: int = 16, **headers):
    """One request of `tenant` (x-tenant-id), the fleet limits' key."""
    return post(envoy, key, body=body(max_tokens), headers={"x-tenant-id": tenant, **headers}, timeout=10.0)


def new_tenant() -> str:
    return new_key("t")


class Fleet:
    """Redis, two services on it, and three Envoys: 0 and 2 ask service A, 1 asks service B. A
    `with` block starts them and always stops and removes them, Envoys first."""

    def __init__(self, sim, config: dict, rls_args: tuple = ()):
        self.sim = sim
        self.config = config
        self.rls_args = list(rls_args)
        self._started = contextlib.ExitStack()

    def __enter__(self) -> "Fleet":
        with contextlib.ExitStack() as stack:
            self.redis = stack.enter_context(Redis())
            self.services = [stack.enter_context(rls_service(self.redis, limits_file(self.config), self.rls_args))
                             for _ in range(2)]
            self.envoys = [stack.enter_context(fleet_envoy(self.config, self.sim.port, self.services[i % 2].port))
                           for i in range(3)]
            self._started = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._started.__exit__(*exc)

    def stat(self, name: str) -> int:
        return sum(e.pool_stat("openai", name) for e in self.envoys if e.running)


@pytest.fixture(scope="module")
def fleet(simulator):
    with Fleet(simulator, CONFIG) as f:
        yield f


def spread(fleet, tenant, key, n, max_tokens=16):
    """n requests at once, spread over the three Envoys (a thread each)."""
    replies, lock = [], threading.Lock()

    def run(envoy, count):
        for _ in range(count):
            r = tenant_post(envoy, tenant, key, max_tokens)
            with lock:
                replies.append(r)

    per = [n // 3 + (1 if i < n % 3 else 0) for i in range(3)]
    threads = [threading.Thread(target=run, args=(e, c)) for e, c in zip(fleet.envoys, per)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return replies


def held_calls(callers: list, key: str, calls_each: int = 1, timeout_s: int = 30) -> list:
    """One thread per Envoy of `callers`, each making `calls_each` calls one after the other,
    telling the gateway its deadline as the SDKs do: the statuses, in the order they ended."""
    statuses, lock = [], threading.Lock()

    def call(envoy):
        for _ in range(calls_each):
            r = post(envoy, key, body=body(), headers={"x-stainless-timeout": str(timeout_s)}, timeout=timeout_s)
            with lock:
                statuses.append(r.status_code)

    threads = [threading.Thread(target=call, args=(e,)) for e in callers]
    [t.start() for t in threads]
    [t.join(timeout_s * calls_each + 10) for t in threads]
    return statuses


def logged_once(envoy, *parts: str) -> str:
    """The line of Envoy's log that holds every one of `parts`, said once per wasm VM (one per
    worker, and Envoy's main thread has one: its timer checks the fleet's marker too; the
    native module says it once): Envoy writes its log file in the background, so it is waited
    for, then any more. Every copy is the same line."""
    envoy.log_lines(*parts)
    time.sleep(0.5)
    lines = envoy.log_lines(*parts, wait_s=0)
    said = {line.split("] ", 3)[-1] for line in lines}
    assert 1 <= len(lines) <= envoy.concurrency + 1 and len(said) == 1, envoy.log_tail()
    return lines[0]


def test_the_shipped_limits_file_is_the_contract_shape():
    text = limits_file(CONFIG)
    assert "descriptors[0]['limit'] == 'tenant-rpm'" in text
    assert "variables: [\"descriptors[0]['key']\"]" in text
    assert text.count("namespace: llm_governor") == 2


@real_server_only("the fixture loads every limits file these tests write")
def test_the_shipped_limits_file_loads_in_limitador_server():
    """Kuadrant's server takes envoy/limitador/limits.yaml as it is (`--validate`), with the
    contract's CEL conditions and variables."""
    import yaml

    parsed = yaml.safe_load(validate_limits((REPO_ROOT / "envoy" / "limitador" / "limits.yaml").read_text()))
    by_condition = {tuple(l["conditions"]): l for l in parsed}
    for name, seconds in (("tenant-rpm", 60), ("tenant-tpm", 60), ("tenant-tpd", 86400)):
        limit = by_condition[(f"descriptors[0]['limit'] == '{name}'",)]
        assert limit["namespace"] == "llm_governor" and limit["seconds"] == seconds
        assert limit["variables"] == ["descriptors[0]['key']"]


def test_a_service_without_reservations_is_an_error_the_fallback_decides_and_named(simulator, sim):
    """limitador-server released before its reservations has no Reserve (the fixture answers as
    it does with `--answer no-reservations`): a token budget left at `"reservations": true` gets
    UNIMPLEMENTED, counted in fleet_errors and decided by on_error, never a request lost or let
    through unchecked; request budgets (ShouldRateLimit) are not affected; Envoy's log says once
    what to run or set (issue 31, item 6)."""
    config = {**CONFIG, "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "on_error": "local",
                                  "reservations": True}}
    extra = None if REAL_SERVER else ["--answer", "no-reservations"]
    with Redis() as redis, rls_service(redis, limits_file(config), extra) as service, \
            fleet_envoy(config, sim.port, service.port) as envoy:
        key = new_key()
        statuses = [tenant_post(envoy, new_tenant(), key).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        assert envoy.pool_stat("openai", "fleet_errors") == 3 and envoy.pool_stat("openai", "fleet_fallback") == 3
        assert envoy.pool_stat("openai", "fleet_calls_ok") >= 3  # the request budget's ShouldRateLimit
        said = logged_once(envoy, "answered Reserve with UNIMPLEMENTED")
        assert "limitador-server" in said and "fleet.reservations: false" in said, said


def test_a_request_budget_is_exact_across_three_envoys(fleet, sim):
    tenant, key = new_tenant(), new_key()
    replies = spread(fleet, tenant, key, 3 * RPM)
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 429]
    # The provider sees the fleet's budget, not three times it (nor a third of it). Limitador's
    # Redis storage reads the counter, then increments it (its docs say so): checks that
    # overlap can each pass before either counts, so the budget can be passed by one request
    # per other concurrent check: here three clients, one per Envoy, so at most 2.
    seen = len(sim.requests_for(key))
    assert RPM <= seen <= RPM + 2, [r.status_code for r in replies]
    assert len(ok) == seen and len(refused) == 3 * RPM - seen
    for r in refused:
        assert r.headers["x-llm-governor-source"] == "limit"
        assert r.headers["x-llm-governor-class"] == "rate_limited"
        # The wait the service reports (the window's reset), never 0.
        assert 0 < int(r.headers["retry-after-ms"]) <= 72_000
        assert 'RateLimit-Policy' in r.headers or "ratelimit-policy" in {k.lower() for k in r.headers}
    # Every Envoy asked the fleet; the refusals are counted as fleet decisions.
    assert fleet.stat("fleet_calls_over_limit") >= 3 * RPM - seen
    assert fleet.stat("fleet_errors") == 0


def test_per_day_and_per_dimension_budgets_are_the_fleets_too(simulator, sim):
    """Issue 32: a `requests_per_day` fleet limit is a day's window in the service (`seconds:
    86400` in the limits file, `w=86400` in the answer), and an `input_tokens_per_minute` one
    reserves the request's input (the descriptor shape is the same)."""
    config = {**CONFIG, "limits": [
        {"name": "tenant-rpd", "key": "header:x-tenant-id", "requests_per_day": 3, "scope": "fleet"},
        {"name": "tenant-itpm", "key": "header:x-tenant-id", "input_tokens_per_minute": 5000, "scope": "fleet"},
    ]}
    text = limits_file(config)
    assert "name: tenant-rpd\n  max_value: 3\n  seconds: 86400\n" in text
    assert "name: tenant-itpm\n  max_value: 5000\n  seconds: 60\n" in text
    with Redis() as redis, rls_service(redis, text) as service, \
            fleet_envoy(config, sim.port, service.port) as envoy:
        tenant, key = new_tenant(), new_key()
        statuses = [tenant_post(envoy, tenant, key, max_tokens=4000).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429]
        r = tenant_post(envoy, tenant, key)
        assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "limit"
        assert r.headers["ratelimit-policy"] == '"tenant-rpd";q=3;w=86400', dict(r.headers)
        assert len(sim.requests_for(key)) == 3
        assert envoy.pool_stat("openai", "fleet_errors") == 0


def test_a_tenants_quota_holds_whichever_replica_serves_it(fleet, sim):
    tenant, key = new_tenant(), new_key()
    # All of the budget through one replica, then the others find it spent.
    for _ in range(RPM):
        assert tenant_post(fleet.envoys[0], tenant, key).status_code == 200
    for envoy in fleet.envoys:
        r = tenant_post(envoy, tenant, key)
        assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "limit"
    # Another tenant's budget is its own.
    other = new_tenant()
    assert tenant_post(fleet.envoys[1], other, key).status_code == 200
    assert len(sim.requests_for(key)) == RPM + 1


def test_a_token_budget_with_concurrent_reservations_is_exact(fleet, sim):
    """Each request reserves its estimate plus max_tokens (about 1,010 tokens) before it goes;
    the provider answers slowly, so every reservation is outstanding at once: 2 fit in 3,000.
    Against limitador-server (no reservations) each is charged its reservation at admission
    instead, by ShouldRateLimit's check-then-increment: one more per other concurrent check
    can pass, as for request budgets."""
    sim.scenario({"latency_ms": 1500})
    tenant, key = new_tenant(), new_key()
    replies = spread(fleet, tenant, key, 9, max_tokens=1000)
    ok = [r for r in replies if r.status_code == 200]
    seen = len(sim.requests_for(key))
    assert seen == len(ok), [r.status_code for r in replies]
    assert TPM // 1010 <= seen <= TPM // 1010 + (0 if RESERVATIONS else 2), [r.status_code for r in replies]
    assert all(r.headers["x-llm-governor-source"] == "limit" for r in replies if r.status_code == 429)


@fixture_only("Reserve / Commit")
def test_what_the_service_says_of_each_commit_is_counted(fleet, sim):
    """A stream's end owes the service a Commit, sent after the stream is gone: by the wasm
    module from its root context, by the native one from the main thread, whose stats go
    through the configuration. Each of these requests makes two calls of its own (the request
    budget's ShouldRateLimit and the token budget's Reserve) and owes one Commit: all answered
    OK, all counted (the commits on the `default` pool, as calls no request's pool owns)."""
    envoy = fleet.envoys[2]

    def ok() -> int:
        return sum(envoy.pool_stat(p, "fleet_calls_ok") for p in ("openai", "default"))

    def settled() -> int:
        last = ok()
        for _ in range(50):  # earlier tests' commits may still be landing
            time.sleep(0.2)
            now = ok()
            if now == last:
                return now
            last = now
        return last

    tenant, key = new_tenant(), new_key()
    before = settled()
    for _ in range(3):
        assert tenant_post(envoy, tenant, key).status_code == 200
    deadline = time.monotonic() + 5
    while ok() < before + 9 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert settled() == before + 9
    assert len(sim.requests_for(key)) == 3


def test_a_fleet_refusal_with_a_short_wait_is_held_not_answered(simulator, sim):
    """A refusal whose wait fits the client's deadline is held (the service's wait), and the
    request goes once the fleet's window has room: here a 1-request-per-2-seconds budget."""
    config = {
        "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500},
        "limits": [{"name": "slow", "key": "pool", "requests_per_minute": 1, "scope": "fleet"}],
    }
    limits = limits_file(config).replace("seconds: 60", "seconds: 2")
    with Redis() as redis, rls_service(redis, limits) as service, \
            fleet_envoy(config, sim.port, service.port) as envoy:
        key = new_key()
        first = tenant_post(envoy, "t", key, **{"x-stainless-timeout": "10"})
        started = time.monotonic()
        second = tenant_post(envoy, "t", key, **{"x-stainless-timeout": "10"})
        waited = time.monotonic() - started
        assert first.status_code == 200 and second.status_code == 200
        assert "x-llm-governor-held-ms" in second.headers
        assert 0.5 < waited < 4.0
        assert len(sim.requests_for(key)) == 2


@fixture_only("Reserve / Commit")
def test_shared_cooldowns_send_one_probe_a_round_for_the_fleet(simulator, sim):
    """Issue 31, `fleet.cooldowns`: three Envoys meet the provider's outage (429, `retry-after:
    1`, for 3.5 s); each learns the cooldown from its own first 429 (their first requests reach
    the provider together: it answers after 300 ms). Their held requests then probe from one
    Envoy at a time, the holder of the (pool, account)'s turn, so a provider round costs the
    fleet one request, not one per Envoy."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True},
              "hold": {"max_ms": 20000}}
    assert "name: llm_governor_turn\n  max_value: 1\n" in limits_file(config)
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS) as fleet:
        sim.scenario({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 3500, "keys": [key],
                      "limit": {"requests": 1000, "window_ms": 2000}, "latency_ms": 300})
        assert held_calls(fleet.envoys, key) == [429, 429, 429]
        replies = held_calls([e for e in fleet.envoys for _ in range(4)], key)
        seen = [(round(q["t_ms"]), q["status"]) for q in sim.requests_for(key)]
        probes = [s for _, s in seen[3:] if s == 429]
        # The held calls: 12, all answered; the provider's rounds of the outage after the first
        # wave (about one a second until its reset tells the rest): one probe each for the
        # fleet, where each Envoy probing for itself costs three a round.
        assert len(replies) == 12, replies
        assert 1 <= len(probes) <= 2, seen
        assert replies.count(429) == len(probes), (replies, seen)
        assert [s for _, s in seen].count(200) == replies.count(200), seen
        assert fleet.stat("fleet_errors") == 0


@fixture_only("Reserve / Commit")
def test_an_envoy_learns_another_envoys_cooldown_before_its_own_first_429(simulator, sim):
    """Issue 31, item 1: the Envoy that meets the provider's 429 marks the (pool, account) for
    the fleet (`llm_governor_cooling`) and takes its turn. An Envoy that sent to the account a
    moment ago finds the marker from its timer, one that never did checks it on its first
    request's way: both hold their calls through the outage instead of each meeting a 429 of
    its own, and the fleet's one probe a round is the first Envoy's. While nothing cools a
    request pays no call: only each worker's timer checks the fleet's marker (counted under pool
    `default`)."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True},
              "hold": {"max_ms": 20000}}
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS) as fleet:
        a, warm, cold = fleet.envoys
        sim.scenario({"mode": "ok", "keys": [key]})
        warmups = 5
        for _ in range(warmups):
            assert post(warm, key, body=body()).status_code == 200
        calls = {s: warm.pool_stat("openai", s) for s in ("fleet_calls_ok", "fleet_calls_over_limit", "fleet_errors")}
        assert calls == dict.fromkeys(calls, 0), f"a call on a request's way while nothing cools: {calls}"
        assert warm.pool_stat("default", "fleet_calls_ok") >= 1, "the timer checks the fleet's marker"
        sim.scenario({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 2500, "keys": [key],
                      "limit": {"requests": 1000, "window_ms": 2000}})
        assert post(a, key, body=body()).status_code == 429
        time.sleep(0.3)  # the marker is a call from A's timer; B's check of it one from B's
        replies = held_calls([warm, cold, warm, cold], key)
        seen = [(q["t_ms"], q["status"]) for q in sim.requests_for(key)]
        # Upstream: the warm Envoy's success before the outage, A's 429, then the outage's
        # rounds (retry-after: 1; down for 2.5 s): one probe a round for the fleet, the first
        # when A's cooldown ends, never a request of the other two Envoys before it.
        (_, before), (t_a, first) = seen[warmups - 1], seen[warmups]
        assert (before, first) == (200, 429), seen
        seen = seen[warmups + 1:]
        probes = [t for t, s in seen if s == 429]
        assert all(t >= t_a + 900 for t, _ in seen), f"sent inside A's cooldown: {seen}"
        assert 1 <= len(probes) <= 2, seen
        assert all(b - a >= 900 for a, b in zip(probes, probes[1:])), f"two probes in a round: {seen}"
        # Each probe's caller got its 429 (with the wait); every other call completed.
        assert sorted(replies) == [200] * (4 - len(probes)) + [429] * len(probes), (replies, seen)
        assert [s for _, s in seen].count(200) == 4 - len(probes), seen
        for envoy in (warm, cold):
            assert envoy.pool_stat("openai", "held") >= 1
            assert envoy.pool_stat("openai", "fleet_calls_over_limit") >= 1
        assert fleet.stat("fleet_errors") == 0


@fixture_only("Reserve / Commit")
def test_an_idle_envoy_checks_the_fleets_marker_once_a_beat_whatever_its_workers(simulator, sim):
    """Issue 31, item 1's cost: an Envoy of two workers with `fleet.cooldowns`, idle, checks the
    fleet's cooling marker about every 100 ms: its workers share one check through shared data
    (10 a second, where a check per worker would be 20, and 30 with the wasm main thread's VM),
    counted under pool `default`; no account's marker is checked while nothing cools."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True}}
    with Redis() as redis, rls_service(redis, limits_file(config), TURN_SERVICE_ARGS) as service, \
            fleet_envoy(config, simulator.port, service.port, concurrency=2) as envoy:
        for _ in range(3):
            assert post(envoy, new_key(), body=body()).status_code == 200
        before, started = envoy.pool_stat("default", "fleet_calls_ok"), time.monotonic()
        time.sleep(3.0)
        checks = envoy.pool_stat("default", "fleet_calls_ok") - before
        per_s = checks / (time.monotonic() - started)
        assert 5 <= per_s <= 13, f"{checks} checks: {per_s:.1f} a second"
        calls = [envoy.pool_stat("openai", s) for s in ("fleet_calls_ok", "fleet_calls_over_limit", "fleet_errors")]
        assert calls == [0, 0, 0], calls


@fixture_only("fault injection (the fixture's --answer no-check)")
def test_a_service_without_check_leaves_each_envoy_its_own_first_429_and_says_so(simulator, sim):
    """Issue 31, faults: a service without Kuadrant's CheckRateLimit (Envoy's RLS alone; the
    fixture's `--answer no-check`) cannot tell an Envoy that another one cools the account: each
    Envoy learns the outage from its own first 429, as without the marker, the failed checks are
    counted in fleet_errors and Envoy's log says once why. Never a hang, and the turn still
    sends one probe a round for the fleet."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True},
              "hold": {"max_ms": 20000}}
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS + ["--answer", "no-check"]) as fleet:
        a, b = fleet.envoys[:2]
        sim.scenario({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 1500, "keys": [key],
                      "limit": {"requests": 1000, "window_ms": 2000}})
        assert post(a, key, body=body()).status_code == 429
        time.sleep(0.3)
        started = time.monotonic()
        r = post(b, key, body=body(), headers={"x-stainless-timeout": "30"}, timeout=30.0)
        assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "upstream", dict(r.headers)
        assert time.monotonic() - started < 2.0, "the failed check held the request"
        assert b.pool_stat("default", "fleet_errors") >= 1, "the timer's checks of the fleet's marker"
        said = logged_once(b, "answered CheckRateLimit with UNIMPLEMENTED")
        assert "its own first 429" in said, said
        # Both Envoys cool now; after the outage their held calls complete, one probe a round.
        replies = held_calls([a, b], key)
        assert replies.count(200) >= 1 and set(replies) <= {200, 429}, replies


def test_a_turn_is_handed_off_when_its_holder_has_nothing_left_to_send(simulator, sim):
    """The holder of a (pool, account)'s turn gives it back once it has sent what it held and
    the provider has room, even with no stream of its own left to tick it (the native module
    then ticks it on the main thread): another Envoy's call goes at once, not when the turn's
    hold expires (TURN_MS, 10 s)."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True},
              "hold": {"max_ms": 20000}}
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS) as fleet:
        a, b = fleet.envoys[0], fleet.envoys[1]
        # Down for 0.8 s, then 3 requests per 3 s window, the outage's rejections counted.
        # Both first requests reach the provider before its 429 (answered after 300 ms), so
        # both Envoys learn the cooldown from their own.
        sim.scenario({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 800, "keys": [key],
                      "limit": {"requests": 3, "window_ms": 3000}, "latency_ms": 300})
        started = time.monotonic()
        assert held_calls([a, b], key) == [429, 429]
        held = {"x-stainless-timeout": "30"}
        # A sends through the cooldown's pace (it takes the turn); its answer says the window
        # is full, so A keeps the turn until the window resets, with no stream of its own left.
        assert post(a, key, body=body(), headers=held, timeout=30.0).status_code == 200
        r = post(b, key, body=body(), headers=held, timeout=30.0)
        waited = time.monotonic() - started
        assert r.status_code == 200, r.text
        # B goes once the window resets (~3 s) and A has handed the turn off, not when A's
        # hold of it expires (10 s after A took it, ~11 s).
        assert waited < 5.0, f"B's call ended {waited:.1f} s in: A kept a turn it no longer used"


@fixture_only("Reserve / Commit")
def test_a_turn_whose_holder_was_killed_comes_back_when_its_hold_expires(simulator, sim):
    """Issue 31, faults: the Envoy holding a (pool, account)'s turn is killed in an outage.
    Another Envoy's held request waits for the turn (the dead holder's hold, cut to 4 s by the
    service's --max-reservation-ttl), then goes: never before the hold expires, never a hang."""
    config = {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "cooldowns": True},
              "hold": {"max_ms": 20000}}
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS + ["--max-reservation-ttl-ms", "4000"]) as fleet:
        a, b = fleet.envoys[0], fleet.envoys[1]
        sim.scenario({"mode": "rate_limited", "retry_after_s": 1.0, "down_until_ms": 1500, "keys": [key],
                      "limit": {"requests": 1000, "window_ms": 2000}, "latency_ms": 300})
        assert held_calls([a, b], key) == [429, 429]
        # A's held request is its cooldown's probe: A takes the turn, and the provider (down until
        # 1.5 s) answers 429 again, so A keeps it. Then A is killed.
        held = {"x-stainless-timeout": "30"}
        threading.Thread(target=_swallow, daemon=True,
                         args=(lambda: post(a, key, body=body(), headers=held, timeout=30.0),)).start()
        wait_for(lambda: len(sim.requests_for(key)) == 3, timeout_s=10.0)
        a.proc.kill()
        killed = time.monotonic()
        r = post(b, key, body=body(), headers=held, timeout=30.0)
        waited = time.monotonic() - killed
        print(f"\nturn holder killed: the other Envoy's held call went {waited:.2f} s after the kill")
        assert r.status_code == 200, r.text
        # B's request went once A's hold expired (taken ~1 s in, held 4 s), not at once (its own
        # cooldown had ended) and not at the end of the 10 s A asked for.
        assert 3.0 <= waited <= 7.0, waited
        after = sim.requests_for(key)[3:]
        assert [q["status"] for q in after] == [200], after
        assert b.pool_stat("openai", "held") >= 1


FLEET_CAP = 4


def cap_config(lease_ms: int = 30000, scope: str = "fleet") -> dict:
    """One cap written once for the fleet: at most FLEET_CAP requests of an account upstream
    across the three Envoys; held requests wait for a slot."""
    return {"pools": CONFIG["pools"], "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500},
            "limits": [{"name": "fleet-cap", "key": "account", "max_in_flight": FLEET_CAP, "scope": scope,
                        "slot_lease_ms": lease_ms}],
            "hold": {"max_ms": 30000}}


@fixture_only("Reserve / Commit")
def test_a_fleet_cap_is_exact_across_three_envoys_and_callers_wait_for_a_slot(simulator, sim):
    """Issue 31, `max_in_flight` with `scope: "fleet"`: the provider's concurrency limit is the
    cap; 18 callers split 60/30/10 over three Envoys, two calls each. Every call completes,
    the provider never sees more than the cap in flight, so never answers a concurrency 429."""
    config = cap_config()
    assert f"name: fleet-cap\n  max_value: {FLEET_CAP}\n  seconds: 86400\n" in limits_file(config)
    assert f"name: fleet-cap-guard\n  max_value: {FLEET_CAP}\n" in limits_file(config)
    assert "descriptors[0]['guard'] == 'fleet-cap'" in limits_file(config)
    key = new_key()
    with Fleet(simulator, config) as fleet:
        sim.scenario({"mode": "ok", "latency_ms": 300, "max_concurrency": FLEET_CAP})
        split = [11, 5, 2]
        statuses = held_calls([e for e, n in zip(fleet.envoys, split) for _ in range(n)], key, calls_each=2,
                              timeout_s=60)
        report = sim.requests()
        upstream = [q["status"] for q in sim.requests_for(key)]
        assert statuses == [200] * 36, statuses
        assert upstream == [200] * 36, upstream
        assert report["max_in_flight_by_key"][key] <= FLEET_CAP, report["max_in_flight_by_key"]
        assert report["max_in_flight_by_key"][key] >= FLEET_CAP - 1, "the cap was never approached"
        assert fleet.stat("held") > 0, "nobody waited for a slot: no contention tested"
        assert fleet.stat("fleet_errors") == 0


@fixture_only("Reserve / Commit")
def test_a_call_longer_than_its_lease_keeps_its_fleet_slot(simulator, sim):
    """Issue 31, item 4: a fleet cap of 1 with a 1.5 s lease, and a call the provider answers
    after 4 s: its slot's holds (the cap's and its guard's) are taken again every 1 s while it
    lasts, one at a time, so another Envoy's call, asking every ~50 ms, waits for the first to
    end, not for its first lease to run out nor for a moment the cap is given back and taken
    again, and the provider never has two in flight (it refuses a second one)."""
    config = {**cap_config(), "limits": [{"name": "fleet-cap", "key": "account", "max_in_flight": 1,
                                          "scope": "fleet", "slot_lease_ms": 1500}]}
    key = new_key()
    with Fleet(simulator, config, TURN_SERVICE_ARGS) as fleet:  # a hold of 1 of 1
        a, b = fleet.envoys[:2]
        sim.scenario({"mode": "ok", "latency_ms": 4000, "max_concurrency": 1, "keys": [key]})
        first = threading.Thread(target=_swallow, daemon=True,
                                 args=(lambda: post(a, key, body=body(), timeout=30.0),))
        first.start()
        wait_for(lambda: len(sim.requests_for(key)) == 1, timeout_s=10.0)
        r = post(b, key, body=body(), headers={"x-stainless-timeout": "30"}, timeout=30.0)
        first.join(10)
        seen = sim.requests_for(key)
        assert r.status_code == 200, r.text
        assert [q["status"] for q in seen] == [200, 200], seen
        gap_s = (seen[1]["t_ms"] - seen[0]["t_ms"]) / 1000
        print(f"\nthe second call reached the provider {gap_s:.2f} s after the first (lease 1.5 s, call 4 s)")
        assert gap_s >= 3.8, f"the slot was free after {gap_s:.2f} s: its lease ran out under a live call"
        assert sim.requests()["max_in_flight_by_key"][key] == 1
        assert a.pool_stat("openai", "fleet_errors") == 0
        assert not a.log_lines("no guard", wait_s=0), "the guard is held"


@fixture_only("Reserve / Commit")
def test_a_service_without_the_caps_guard_keeps_the_slot_on_the_cap_alone_and_says_so(simulator, sim):
    """A limits file written before the guard (the cap alone): the guard's Reserve matches no
    limit and holds nothing; the call still keeps its slot on the cap through its renewals,
    nothing counted as an error, and Envoy's log names what to add, once."""
    config = {**cap_config(), "limits": [{"name": "fleet-cap", "key": "account", "max_in_flight": 1,
                                          "scope": "fleet", "slot_lease_ms": 1500}]}
    cap_alone = "".join(block for block in limits_file(config).split("- namespace")
                        if block and "'guard'" not in block)
    assert "'guard'" not in cap_alone and "fleet-cap" in cap_alone
    with Redis() as redis, rls_service(redis, "- namespace" + cap_alone, TURN_SERVICE_ARGS) as service, \
            fleet_envoy(config, sim.port, service.port) as envoy:
        key = new_key()
        sim.scenario({"mode": "ok", "latency_ms": 2500, "keys": [key]})
        r = post(envoy, key, body=body(), timeout=30.0)
        assert r.status_code == 200, r.text
        said = logged_once(envoy, "no guard", "fleet-cap")
        assert "descriptors[0]['guard'] == 'fleet-cap'" in said, said
        assert envoy.pool_stat("openai", "fleet_errors") == 0


@fixture_only("Reserve / Commit")
def test_a_slot_the_service_clamps_away_is_decided_by_on_error_and_named(simulator, sim):
    """A fleet cap of 1 on a service left at the server's default --max-reservation-fraction
    (0.5): the hold of 1 is clamped to nothing, and the service grants it with no reservation.
    No slot is held, so each grant is a failed call that `on_error` decides (`local`: this
    Envoy's own cap of 1), counted, never a request let through uncounted or lost; Envoy's log
    names the flag once (issue 31, faults)."""
    config = {**cap_config(), "limits": [{"name": "fleet-cap", "key": "account", "max_in_flight": 1,
                                          "scope": "fleet", "slot_lease_ms": 30000}]}
    with Redis() as redis, rls_service(redis, limits_file(config)) as service, \
            fleet_envoy(config, sim.port, service.port) as envoy:
        key = new_key()
        statuses = [post(envoy, key, body=body()).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        assert envoy.pool_stat("openai", "fleet_fallback") == 3
        said = logged_once(envoy, "without holding it", "fleet-cap")
        assert "--max-reservation-fraction of at least 1/1" in said, said


@fixture_only("Reserve / Commit")
def test_a_killed_envoys_slots_come_back_within_the_lease(simulator, sim):
    """An Envoy killed while its streams hold every slot: the service's holds expire after
    `slot_lease_ms`, and another Envoy's held request goes then, not when the dead streams
    would have ended."""
    lease_ms = 3000
    key = new_key()
    with Fleet(simulator, cap_config(lease_ms)) as fleet:
        sim.scenario({"mode": "ok", "latency_ms": 20000})
        for _ in range(FLEET_CAP):
            threading.Thread(target=_swallow, daemon=True,
                             args=(lambda: post(fleet.envoys[1], key, body=body(), timeout=30.0),)).start()
        deadline = time.monotonic() + 10
        while len(sim.requests_for(key)) < FLEET_CAP and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sim.requests_for(key)) == FLEET_CAP, "the slots were never all taken"
        fleet.envoys[1].proc.kill()
        killed = time.monotonic()
        sim.scenario({"mode": "ok", "latency_ms": 50})
        r = post(fleet.envoys[0], key, body=body(), headers={"x-stainless-timeout": "30"}, timeout=30.0)
        waited = time.monotonic() - killed
        assert r.status_code == 200, r.text
        # Held until the dead Envoy's holds expired (taken up to ~1 s before the kill), then sent.
        assert lease_ms / 1000 - 1.5 <= waited <= lease_ms / 1000 + 2.0, waited
        assert fleet.envoys[0].pool_stat("openai", "held") >= 1


@fixture_only("Reserve / Commit")
def test_redis_lost_while_slots_are_held_decides_by_on_error_and_loses_no_slot(simulator, sim):
    """Issue 31, faults: Redis goes while four streams hold every slot of a fleet cap of 4. Their
    ends cannot be committed (counted as fleet errors); requests meanwhile are decided by
    `on_error` (`local`: this Envoy's own cap of 4); Redis back (empty), the cap is the fleet's
    again: exactly 4 in flight at the provider, nothing counted twice, nothing lost."""
    key = new_key()
    with Fleet(simulator, cap_config()) as f:
        sim.scenario({"mode": "ok", "latency_ms": 1500, "max_concurrency": FLEET_CAP})
        for _ in range(FLEET_CAP):
            threading.Thread(target=_swallow, daemon=True,
                             args=(lambda: post(f.envoys[0], key, body=body(), timeout=30.0),)).start()
        wait_for(lambda: len(sim.requests_for(key)) == FLEET_CAP, timeout_s=10.0)
        f.redis.stop()
        # The four streams end (1.5 s) while Redis is gone: their commits fail.
        wait_for(lambda: sim.requests()["in_flight"] == 0, timeout_s=5.0)
        time.sleep(0.5)
        errors = f.stat("fleet_errors")
        assert errors >= FLEET_CAP, "the slots' commits did not fail while Redis was gone"
        during = [post(f.envoys[0], key, body=body(), timeout=30.0).status_code for _ in range(2)]
        assert during == [200, 200] and f.stat("fleet_fallback") >= 2
        f.redis.start()
        deadline = time.monotonic() + 15
        ok_before = f.stat("fleet_calls_ok")
        while f.stat("fleet_calls_ok") == ok_before and time.monotonic() < deadline:
            post(f.envoys[1], key, body=body(), timeout=30.0)
        assert f.stat("fleet_calls_ok") > ok_before, "fleet decisions did not resume"
        sim.scenario({"mode": "ok", "latency_ms": 1000, "max_concurrency": FLEET_CAP})
        seen_before, held_before = len(sim.requests_for(key)), f.stat("held")
        statuses = held_calls([e for e in f.envoys for _ in range(2)], key)
        after = [q["status"] for q in sim.requests_for(key)[seen_before:]]
        # Six callers on a cap of 4 against a provider that refuses a fifth at once: two waited
        # for a slot, none met the provider's 429 (no ghost slot of before, none counted twice).
        assert statuses == [200] * 6, statuses
        assert after == [200] * 6, after
        assert f.stat("held") >= held_before + 2


def test_redis_killed_and_restarted_mid_run_falls_back_then_recovers(simulator, sim):
    """Redis gone: the service answers UNAVAILABLE, the fallback (this Envoy's own bucket of the
    same rate) decides and is counted; Redis back: fleet decisions resume, no restart."""
    with Fleet(sim, CONFIG) as f:
        tenant, key = new_tenant(), new_key()
        assert tenant_post(f.envoys[0], tenant, key).status_code == 200
        ok_before = f.stat("fleet_calls_ok")
        f.redis.stop()
        started = time.monotonic()
        during = [tenant_post(e, tenant, key) for e in f.envoys for _ in range(2)]
        elapsed = time.monotonic() - started
        assert all(r.status_code == 200 for r in during), [r.status_code for r in during]
        assert elapsed < 6 * 1.5, "requests waited past the fleet timeout"
        assert f.stat("fleet_errors") >= 6 and f.stat("fleet_fallback") >= 6
        f.redis.start()
        # limitador-server's Redis client (redis-rs 0.27 ConnectionManager, defaults) retries a
        # lost connection after 1 s, then after a minute or more: it answers again up to about
        # two minutes after Redis is back (measured: 95 to 100 s). The fixture pings every 200 ms.
        back = time.monotonic()
        deadline = back + (180 if REAL_SERVER else 15)
        while time.monotonic() < deadline:
            tenant_post(f.envoys[1], tenant, key)
            if f.stat("fleet_calls_ok") > ok_before + 2:
                break
            time.sleep(0.3)
        assert f.stat("fleet_calls_ok") > ok_before + 2, "fleet decisions did not resume"
        print(f"fleet decisions resumed {time.monotonic() - back:.1f} s after Redis came back")


def test_a_service_slower_than_the_timeout_never_holds_a_request_past_it(simulator, sim):
    config = {**CONFIG, "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 100, "reservations": RESERVATIONS}}
    # The fixture answers 1 s late; limitador-server, which cannot, is paused (never answers).
    with Fleet(sim, config, rls_args=() if REAL_SERVER else ("--delay-ms", "1000")) as f:
        if REAL_SERVER:
            for s in f.services:
                s.pause()
        tenant, key = new_tenant(), new_key()
        times = []
        for envoy in f.envoys:
            started = time.monotonic()
            r = tenant_post(envoy, tenant, key)
            times.append(time.monotonic() - started)
            assert r.status_code == 200
        # The fallback decided each within the timeout (plus the provider's own time).
        assert max(times) < 0.9, times
        assert f.stat("fleet_errors") >= 3 and f.stat("fleet_fallback") >= 3
        # The local fallback is the limit's own rate, per Envoy: 12 more through one Envoy
        # are refused at the 13th.
        statuses = [tenant_post(f.envoys[0], tenant, key).status_code for _ in range(RPM)]
        assert statuses.count(429) >= 1, statuses


@fixture_only("fault injection (the fixture's --answer garbage)")
def test_a_service_answering_garbage_is_an_error_handled_by_the_fallback(simulator, sim):
    config = {**CONFIG, "fleet": {"cluster": RLS_CLUSTER, "timeout_ms": 500, "on_error": "deny",
                                  "reservations": RESERVATIONS}}
    with Fleet(sim, config, rls_args=("--answer", "garbage")) as f:
        key = new_key()
        r = tenant_post(f.envoys[0], "t", key)
        assert r.status_code == 429 and r.headers["x-llm-governor-source"] == "limit"
        assert len(sim.requests_for(key)) == 0
        assert f.stat("fleet_errors") >= 1 and f.stat("fleet_fallback") >= 1
        assert all(e.running for e in f.envoys)


def test_one_envoy_killed_mid_request_leaves_the_fleet_serving_its_budget(simulator, sim):
    with Fleet(sim, CONFIG) as f:
        sim.scenario({"latency_ms": 2000})
        tenant, key = new_tenant(), new_key()
        t = threading.Thread(target=lambda: _swallow(lambda: tenant_post(f.envoys[1], tenant, key)))
        t.start()
        time.sleep(0.8)  # admitted by the fleet, upstream now
        f.envoys[1].proc.kill()
        t.join(10)
        sim.scenario({})
        statuses = [tenant_post(e, tenant, key).status_code for e in (f.envoys[0], f.envoys[2]) for _ in range(RPM)]
        # The killed Envoy's request was counted: the survivors serve the rest of the budget.
        assert statuses.count(200) == RPM - 1, statuses
        assert len(sim.requests_for(key)) == RPM


def _swallow(f):
    try:
        f()
    except requests.RequestException:
        pass


def test_an_unknown_fleet_cluster_is_refused_at_load(simulator):
    config = {**CONFIG, "fleet": {"cluster": "no_such_cluster"}}
    bootstrap = envoy_bootstrap(simulator.port, [governor_filter(config)])
    failure = Envoy(config, simulator.port, bootstrap=bootstrap).start_expecting_failure()
    assert not failure.ready
    assert "llm_governor: invalid configuration: fleet.cluster:" in failure.log, failure.log[-2000:]


def test_the_shipped_limitador_limits_match_the_shipped_fleet_config():
    """envoy/limitador/limits.yaml holds the numbers of envoy/fleet.yaml's fleet limits, in the
    descriptor shape the filter sends."""
    import json

    import yaml

    envoy = yaml.safe_load((REPO_ROOT / "envoy" / "fleet.yaml").read_text())
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    config = json.loads(wasm["typed_config"]["config"]["configuration"]["value"])
    clusters = {c["name"] for c in envoy["static_resources"]["clusters"]}
    assert config["fleet"]["cluster"] in clusters
    shipped = yaml.safe_load((REPO_ROOT / "envoy" / "limitador" / "limits.yaml").read_text())
    assert shipped == yaml.safe_load(limits_file(config))
