"""End-to-end: how the filter is configured. An empty configuration runs on the defaults; an
invalid one is refused at load with a message that names the field; and with the wasm filter's
allow_on_headers_stop_iteration left false, where Envoy never delivers a held body, no response
hangs: the filter classifies by status and headers, says so once, and stops holding bodies on
that worker for a minute.
"""

from __future__ import annotations

import re
import time

import pytest

from answers import NO_COOLDOWN, assert_delay_within, delay_ms
from conftest import module_envoy
from harness import NO_STOP_ITERATION_OPTION, Envoy, new_key, post, wasm_only


def test_empty_configuration_uses_defaults(envoy_factory, sim):
    envoy = envoy_factory({})
    key = new_key()
    sim.scenario({"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 2, "keys": [key]})
    r = post(envoy, key, "openai")
    assert r.status_code == 429
    assert r.headers.get("x-llm-governor-class") == "rate_limited"
    assert r.headers.get("x-llm-governor-source") == "upstream"
    # The default jitter (0.2) on top of the provider's 2 s, never below it.
    assert_delay_within(delay_ms(r), 2000)
    assert envoy.pool_stat("default", "upstream_rate_limited") == 1


@pytest.mark.parametrize(
    "config,field",
    [
        ({"retry_after": {"jitter": 5}}, "retry_after.jitter"),
        ({"bogus": 1}, "bogus"),
        ({"limits": [{"name": "x", "key": "header:x-t", "requests_per_minute": 0}]}, "limits[0].requests_per_minute"),
        ({"pools": [{"name": "Not A Valid Name", "match": {"path_prefix": "/"}, "dialect": "openai"}]}, "pools[0].name"),
        ({"retry_after": {"max_ms": "soon"}}, "retry_after.max_ms"),
        ("{not json", None),
    ],
    ids=["jitter-out-of-range", "unknown-field", "zero-rpm", "pool-name", "wrong-type", "not-json"],
)
def test_invalid_configuration_is_refused(simulator, config, field):
    failure = Envoy(config, upstream_port=simulator.port).start_expecting_failure()

    assert not failure.ready
    lines = [line for line in failure.log.splitlines() if "llm_governor: invalid configuration:" in line]
    assert lines, "no 'llm_governor: invalid configuration:' line in the log:\n" + failure.log[-3000:]
    message = lines[0].split("llm_governor: invalid configuration:", 1)[1].strip()
    assert re.match(r"\S.*: \S", message), f"not '<field>: <reason>': {message!r}"
    if field is not None:
        assert message.startswith(field + ":") or field in message.split(": ")[0], (
            f"expected the field {field!r} named first: {message!r}"
        )


# --------------------------------------------------------------------------------------------
# allow_on_headers_stop_iteration: false must not hang a response


@pytest.fixture(scope="module")
def governor_without_stop_iteration(simulator):
    yield from module_envoy(NO_COOLDOWN, allow_on_headers_stop_iteration=False)(simulator)


@wasm_only(NO_STOP_ITERATION_OPTION)
@pytest.mark.parametrize(
    "dialect,scenario,status,provider_ms",
    [
        ("openai", {"mode": "rate_limited", "retry_after": "seconds", "retry_after_s": 3}, 429, 3000),
        ("openai", {"mode": "quota"}, 429, None),
        ("anthropic", {"mode": "overloaded"}, 529, 1000),
        ("anthropic", {"mode": "quota"}, 429, None),
    ],
    ids=["openai-rate-limit", "openai-quota", "anthropic-529", "anthropic-spend-cap"],
)
def test_without_stop_iteration_never_hangs(governor_without_stop_iteration, sim, dialect, scenario, status, provider_ms):
    envoy = governor_without_stop_iteration
    key = new_key()
    sim.scenario({**scenario, "keys": [key]})
    direct = post(sim, key, dialect)

    started = time.monotonic()
    r = post(envoy, key, dialect, timeout=10)
    elapsed = time.monotonic() - started

    assert elapsed < 3.0, f"response took {elapsed:.1f}s"
    assert r.status_code == status
    assert r.content == direct.content
    # Classified by status and headers alone: the body that says "quota" never reached the
    # filter, so a quota 429 is a rate limit (the safe default: wait, do not give up).
    klass = "overloaded" if status == 529 else "rate_limited"
    assert r.headers.get("x-llm-governor-class") == klass
    assert r.headers.get("x-should-retry") == "true"
    assert r.headers.get("x-llm-governor-source") == "upstream"
    if provider_ms is None:
        # No time in the headers either: the first hint-less rate limit's backoff.
        assert 1 <= delay_ms(r) <= 1000
    else:
        assert_delay_within(delay_ms(r), provider_ms)


@wasm_only(NO_STOP_ITERATION_OPTION)
def test_without_stop_iteration_the_log_says_so(governor_without_stop_iteration, sim):
    envoy = governor_without_stop_iteration
    key = new_key()
    sim.scenario({"mode": "quota", "keys": [key]})
    post(envoy, key, "openai")
    post(envoy, key, "openai")

    lines = envoy.log_lines("allow_on_headers_stop_iteration")
    time.sleep(0.5)  # any second line is said by now too
    lines = envoy.log_lines("allow_on_headers_stop_iteration", wait_s=0)
    assert lines, "the fallback to status-and-headers classification is not logged"
    # Once, not once per response (each worker VM may say it once).
    assert len(lines) <= envoy.concurrency + 1, "\n".join(lines)


@wasm_only(NO_STOP_ITERATION_OPTION)
def test_without_stop_iteration_the_worker_stops_holding_for_a_minute_and_counts_it(envoy_factory, sim):
    """README: after 1 s without a body the filter classifies by status and headers alone,
    logs once, counts body_unavailable, and stops holding responses on that worker for a
    minute (then it tries again). One worker, so every response meets the same one."""
    envoy = envoy_factory(NO_COOLDOWN, allow_on_headers_stop_iteration=False, concurrency=1)
    sim.scenario({"mode": "quota"})

    def quota_429():
        started = time.monotonic()
        r = post(envoy, new_key(), "openai", timeout=10)
        assert r.status_code == 429 and r.headers.get("x-llm-governor-class") == "rate_limited", dict(r.headers)
        return time.monotonic() - started

    # The first one is held for its body, which never comes: answered after the 1 s wait.
    first = quota_429()
    gave_up_at = time.monotonic()
    assert 0.9 <= first < 3.0, f"the first 429 took {first:.2f} s (the body wait is 1 s)"
    assert envoy.pool_stat("openai", "body_unavailable") == 1
    # For the next minute nothing is held: answered at once, nothing more counted.
    for _ in range(3):
        assert quota_429() < 0.5
    assert envoy.pool_stat("openai", "body_unavailable") == 1
    time.sleep(max(0.0, gave_up_at + 55 - time.monotonic()))
    assert quota_429() < 0.5, "held again before the minute was over"
    assert envoy.pool_stat("openai", "body_unavailable") == 1
    # After the minute it tries again: held for the body, which still does not come.
    time.sleep(max(0.0, gave_up_at + 61 - time.monotonic()))
    again = quota_429()
    assert 0.9 <= again < 3.0, f"not held again after the minute: {again:.2f} s"
    assert envoy.pool_stat("openai", "body_unavailable") == 2
    warnings = envoy.log_lines("held body never arrived")
    assert len(warnings) == 1, warnings
