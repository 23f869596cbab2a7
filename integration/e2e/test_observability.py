"""End-to-end checks of the telemetry against a real Envoy and the provider simulator.

What an on-call engineer reads: the per-pool gauges in `/stats` and `/stats/prometheus` after
provider responses with known rate-limit headers (OpenAI and Anthropic dialects), the counters and
the `retry_after_ms` histogram, the `exhausted_*` counters that say which dimension ran out,
preemptive pacing (a 200 that reports 0 remaining paces the next call locally, both dialects),
the access-log fields, and that the alert rules and the docs name the series Envoy really exports.

Gauges are per pool and last-writer-wins, so most checks run on one Envoy with
`--concurrency 1`; one test runs two workers. Every case uses fresh API keys, so the filter's
per-(pool, account) cooldowns cannot couple cases.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

from conftest import _register, _release, module_envoy
from harness import (NATIVE, NATIVE_PROMETHEUS_PREFIX, REPO_ROOT, WASM_MODULE, WASM_PROMETHEUS_PREFIX, Envoy,
                     cool, native_family, new_key, post, prometheus_series, wait_for, wasm_only)

POOLS = [
    {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai"},
    {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
]
# A pool of its own for the histogram check, so no other test's delays land in its buckets.
HISTOGRAM_POOL = {"name": "histo", "match": {"header": {"name": "x-obs-pool", "value": "histo"}}, "dialect": "openai"}
# Defaults otherwise: jitter 0.2, cooldowns and preemptive pacing on. Holding is off: these tests
# read what local answers and their stats say (test_hold.py covers holding).
CONFIG = {"pools": [HISTOGRAM_POOL, *POOLS], "hold": {"max_ms": 0}}
JITTER = 0.2

SHIPPED_CONFIG = REPO_ROOT / "envoy" / "envoy.yaml"
MINIMAL_CONFIG = REPO_ROOT / "envoy" / "minimal.yaml"
ALERTS = REPO_ROOT / "envoy" / "prometheus" / "alerts.yaml"
DOCS = REPO_ROOT / "docs" / "observability.md"

GOVERNOR_FIELDS = ("llm_governor_class", "llm_governor_source", "llm_governor_delay_ms", "llm_governor_held_ms", "llm_governor_pool",
                   "llm_governor_hold_class")


def shipped_governor_fields() -> dict:
    """The llm_governor_* access-log fields exactly as envoy/envoy.yaml declares them."""
    found = dict(re.findall(r'^\s+(llm_governor_\w+): "([^"]+)"\s*$', SHIPPED_CONFIG.read_text(), re.M))
    assert set(found) == set(GOVERNOR_FIELDS), f"envoy/envoy.yaml access log fields: {found}"
    return found


# The shipped fields plus a per-request id to find each request's line.
ACCESS_LOG_FORMAT = {"obs_id": "%REQ(X-OBS-ID)%", "status": "%RESPONSE_CODE%", **shipped_governor_fields()}

governor = pytest.fixture(scope="module", name="governor")(
    module_envoy(
        CONFIG,
        concurrency=1,
        access_log_format=ACCESS_LOG_FORMAT,
        stats_flush_interval="1s",
    )
)


# --------------------------------------------------------------------------------------------
# Helpers


def stats(envoy: Envoy) -> dict:
    """Every llm_governor counter and gauge by its wasm /stats name (the native module's labelled
    stats under the wasm name of each: `Envoy.governor_stats`)."""
    return {k: v for k, v in envoy.governor_stats().items() if not isinstance(v, dict)}


def stat_name(pool: str, metric: str) -> str:
    return f"wasmcustom.llm_governor.pool.{pool}.{metric}"


def stat(snapshot: dict, pool: str, metric: str) -> int:
    name = stat_name(pool, metric)
    assert name in snapshot, f"{name} missing from /stats; have {sorted(snapshot)[:8]}..."
    return snapshot[name]


def delta(before: dict, after: dict, pool: str, metric: str) -> int:
    return stat(after, pool, metric) - stat(before, pool, metric)


def prometheus_samples(envoy: Envoy) -> dict:
    """`name{labels}` -> value text, for every sample line of /stats/prometheus."""
    out = {}
    for line in envoy.prometheus().splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = value
    return out


def assert_local_cooldown(r: requests.Response, max_delay_ms: int) -> int:
    assert r.status_code == 429, (r.status_code, dict(r.headers), r.text)
    assert r.headers.get("x-llm-governor-source") == "cooldown", dict(r.headers)
    assert r.headers.get("x-llm-governor-class") == "rate_limited", dict(r.headers)
    delay = int(r.headers["retry-after-ms"])
    assert 0 < delay <= max_delay_ms, (delay, max_delay_ms)
    return delay


# Known header values reported by the simulator (scenario `ratelimit`): distinct per pool, so a
# value written into the wrong pool's gauge shows.
OPENAI_REPORTED = {
    "limit_requests": 500,
    "remaining_requests": 17,
    "reset_requests_ms": 1500,
    "limit_tokens": 30000,
    "remaining_tokens": 29000,
    "reset_tokens_ms": 6000,
}
ANTHROPIC_REPORTED = {
    "limit_requests": 50,
    "remaining_requests": 42,
    "reset_requests_ms": 3000,
    "limit_tokens": 90000,
    "remaining_tokens": 88000,
    "reset_tokens_ms": 8000,
    "limit_input_tokens": 70000,
    "remaining_input_tokens": 69000,
    "limit_output_tokens": 16000,
    "remaining_output_tokens": 15000,
}
OPENAI_GAUGES = {
    "remaining_requests": 17,
    "limit_requests": 500,
    "remaining_tokens": 29000,
    "limit_tokens": 30000,
    # Go durations are relative: exact.
    "reset_requests_ms": 1500,
    "reset_tokens_ms": 6000,
}
ANTHROPIC_GAUGES = {
    "remaining_requests": 42,
    "limit_requests": 50,
    "remaining_tokens": 88000,
    "limit_tokens": 90000,
    "remaining_input_tokens": 69000,
    "remaining_output_tokens": 15000,
}
# Anthropic resets are RFC 3339 instants rounded up to the second, read back relative to now:
# the gauge lies in (reported - latency, reported + 1000].
ANTHROPIC_RESETS = {"reset_requests_ms": 3000, "reset_tokens_ms": 8000}


def report_openai(sim, envoy) -> None:
    sim.scenario({"ratelimit": OPENAI_REPORTED})
    r = post(envoy, new_key(), "openai")
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-requests"] == "17", dict(r.headers)


def report_anthropic(sim, envoy) -> None:
    sim.scenario({"ratelimit": ANTHROPIC_REPORTED})
    r = post(envoy, new_key("sk-ant-obs"), "anthropic")
    assert r.status_code == 200 and r.headers["anthropic-ratelimit-requests-remaining"] == "42", dict(r.headers)


# --------------------------------------------------------------------------------------------
# Gauges


def test_openai_dialect_gauges_are_the_reported_values(sim, governor):
    report_openai(sim, governor)
    s = stats(governor)
    got = {m: stat(s, "openai", m) for m in OPENAI_GAUGES}
    assert got == OPENAI_GAUGES


def test_anthropic_dialect_gauges_are_the_reported_values(sim, governor):
    report_anthropic(sim, governor)
    s = stats(governor)
    got = {m: stat(s, "anthropic", m) for m in ANTHROPIC_GAUGES}
    assert got == ANTHROPIC_GAUGES
    for metric, reported in ANTHROPIC_RESETS.items():
        value = stat(s, "anthropic", metric)
        assert reported - 1000 <= value <= reported + 1000, (metric, value)


def test_prometheus_shows_gauges_with_the_pool_label(sim, governor):
    """wasm: the `llm_pool` tag the shipped stats_tags regex extracts; native: the `pool` label."""
    report_openai(sim, governor)
    report_anthropic(sim, governor)
    text = governor.prometheus()
    lines = set(text.splitlines())
    reported = [
        ("anthropic", "remaining_requests", 42), ("anthropic", "limit_requests", 50),
        ("anthropic", "remaining_tokens", 88000), ("anthropic", "limit_tokens", 90000),
        ("anthropic", "remaining_input_tokens", 69000), ("anthropic", "remaining_output_tokens", 15000),
        ("openai", "remaining_requests", 17), ("openai", "limit_requests", 500),
        ("openai", "remaining_tokens", 29000), ("openai", "limit_tokens", 30000),
        ("openai", "reset_requests_ms", 1500), ("openai", "reset_tokens_ms", 6000),
    ]
    expected = [f"{prometheus_series(pool, metric)} {value}" for pool, metric, value in reported]
    kinds = [("remaining_requests", "gauge"), ("upstream_rate_limited", "counter")]
    if not NATIVE:  # native: a labelled histogram appears with its first sample
        kinds.append(("retry_after_ms", "histogram"))
    for metric, kind in kinds:
        family = prometheus_series("x", metric).split("{", 1)[0]
        expected.append(f"# TYPE {family} {kind}")
    missing = [line for line in expected if line not in lines]
    assert not missing, "missing from /stats/prometheus:\n" + "\n".join(missing)
    series = re.escape(prometheus_series("anthropic", "reset_requests_ms"))
    reset = re.search(rf"^{series} (\d+)$", text, re.M)
    assert reset and 2000 <= int(reset.group(1)) <= 4000, reset
    if not NATIVE:
        # The contract: Envoy drops the wasmcustom namespace and the envoy_ prefix for custom stats.
        governor_lines = [line for line in text.splitlines() if "llm_governor_pool" in line]
        assert governor_lines
        assert not [line for line in governor_lines if "wasmcustom" in line or "envoy_llm_governor" in line]


# --------------------------------------------------------------------------------------------
# Counters and the histogram


def histogram_samples(envoy: Envoy, pool: str) -> dict:
    samples = prometheus_samples(envoy)
    out = {}
    bucket = re.escape(prometheus_series(pool, "retry_after_ms", "_bucket", ',le="LE"')).replace("LE", '([^"]+)')
    for series, value in samples.items():
        m = re.fullmatch(bucket, series)
        if m:
            out[m.group(1)] = int(value)
    out["count"] = int(samples.get(prometheus_series(pool, "retry_after_ms", "_count"), "0"))
    return out


def test_upstream_429_counts_and_lands_in_the_retry_after_histogram(sim, governor):
    before_hist = histogram_samples(governor, "histo")
    before = stats(governor)
    key = new_key()
    sim.scenario({"mode": "rate_limited", "keys": [key], "retry_after": "seconds", "retry_after_s": 2})
    r = post(governor, key, "openai", headers={"x-obs-pool": "histo"})
    assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "upstream", dict(r.headers)
    told = int(r.headers["retry-after-ms"])
    assert 2000 <= told <= 2000 * (1 + JITTER) + 1, told
    after = stats(governor)
    assert delta(before, after, "histo", "upstream_rate_limited") == 1
    assert delta(before, after, "histo", "exhausted_requests") == 1
    assert delta(before, after, "openai", "upstream_rate_limited") == 0

    # Histograms reach /stats/prometheus at the next stats flush (1 s here).
    def flushed():
        h = histogram_samples(governor, "histo")
        return h if h["count"] > before_hist["count"] else None

    hist = wait_for(flushed, timeout_s=10)
    assert hist, f"retry_after_ms count did not move after a flush: {histogram_samples(governor, 'histo')}"
    assert hist["count"] - before_hist["count"] == 1, hist
    assert hist["2500"] - before_hist.get("2500", 0) == 1, hist
    assert hist["1000"] - before_hist.get("1000", 0) == 0, hist
    bucket = prometheus_series("histo", "retry_after_ms", "_bucket", ',le="2500"')
    assert f'{bucket} {hist["2500"]}' in governor.prometheus()


def test_counters_for_each_class_and_local_answer(sim, governor):
    before = stats(governor)
    limited, quota, overloaded = new_key(), new_key(), new_key("sk-ant-obs")

    sim.scenario({"mode": "rate_limited", "keys": [limited], "retry_after_s": 5})
    assert post(governor, limited, "openai").headers.get("x-llm-governor-source") == "upstream"
    again = post(governor, limited, "openai")
    assert again.headers.get("x-llm-governor-source") == "cooldown", dict(again.headers)

    sim.scenario({"mode": "quota", "keys": [quota]})
    first = post(governor, quota, "openai")
    assert first.headers.get("x-llm-governor-class") == "quota_exhausted", dict(first.headers)
    second = post(governor, quota, "openai")
    assert (second.status_code, second.headers.get("x-llm-governor-source")) == (429, "cooldown")
    assert second.headers.get("x-should-retry") == "false"

    sim.scenario({"mode": "overloaded", "keys": [overloaded], "retry_after_s": 5})
    r = post(governor, overloaded, "anthropic")
    assert (r.status_code, r.headers.get("x-llm-governor-class")) == (529, "overloaded"), dict(r.headers)

    after = stats(governor)
    changed = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
    counters = {k: v for k, v in changed.items() if not re.search(r"\.(remaining|limit|reset)_", k)}
    assert counters == {
        stat_name("openai", "upstream_rate_limited"): 1,
        stat_name("openai", "exhausted_requests"): 1,
        stat_name("openai", "local_reject_cooldown"): 1,
        stat_name("openai", "upstream_quota_exhausted"): 1,
        stat_name("openai", "local_reject_quota"): 1,
        stat_name("anthropic", "upstream_overloaded"): 1,
    }
    samples = prometheus_samples(governor)
    for name in counters:
        pool, metric = name.split(".")[3:5]
        series = prometheus_series(pool, metric)
        assert samples.get(series) == str(after[name]), (series, samples.get(series), after[name])


@pytest.mark.parametrize(
    "dialect, dimension, counter",
    [
        ("openai", "requests", "exhausted_requests"),
        ("openai", "tokens", "exhausted_tokens"),
        ("anthropic", "requests", "exhausted_requests"),
        ("anthropic", "tokens", "exhausted_tokens"),
        ("anthropic", "input_tokens", "exhausted_input_tokens"),
        ("anthropic", "output_tokens", "exhausted_output_tokens"),
    ],
)
def test_exhausted_counter_names_the_dimension_that_ran_out(sim, governor, dialect, dimension, counter):
    key = new_key()
    sim.scenario({"mode": "rate_limited", "keys": [key], "dimension": dimension, "retry_after_s": 1})
    before = stats(governor)
    r = post(governor, key, dialect)
    assert r.status_code == 429 and r.headers.get("x-llm-governor-class") == "rate_limited", dict(r.headers)
    after = stats(governor)
    exhausted = {
        m: delta(before, after, dialect, m)
        for m in ("exhausted_requests", "exhausted_tokens", "exhausted_input_tokens", "exhausted_output_tokens")
    }
    assert exhausted == {m: int(m == counter) for m in exhausted}
    remaining_gauge = {"requests": "remaining_requests", "tokens": "remaining_tokens"}.get(dimension)
    if remaining_gauge:
        assert stat(after, dialect, remaining_gauge) == 0


# --------------------------------------------------------------------------------------------
# Preemptive pacing


def timed_call(envoy: Envoy, dialect: str, key: str):
    """(response, wall-clock ms just before sending, wall-clock ms once answered)."""
    sent = time.time() * 1000
    r = post(envoy, key, dialect)
    return r, sent, time.time() * 1000


CLOCK_SLACK_MS = 5  # Envoy reads whole wall-clock ms


def test_zero_remaining_paces_the_next_call_locally_in_both_dialects(sim, governor):
    """A 200 reporting 0 remaining with a reset 3 s away cools that (pool, account) until the
    reset: the next call is answered locally with what is left of it plus jitter (a fraction
    of the 3 s), nothing reaches the provider, then it flows."""
    keys = {"openai": new_key(), "anthropic": new_key("sk-ant-obs"), "openai-tokens": new_key()}
    before = stats(governor)

    # When each cooldown ends, as a span of wall-clock ms, and the period its jitter is a
    # fraction of (at most).
    deadlines = {}
    sim.scenario({"ratelimit": {"remaining_requests": 0, "reset_requests_ms": 3000}})
    for dialect in ("openai", "anthropic"):
        r, sent, received = timed_call(governor, dialect, keys[dialect])
        assert r.status_code == 200 and "x-llm-governor-source" not in r.headers, dict(r.headers)
        if dialect == "openai":
            # A Go duration, relative to the response: 3 s after Envoy saw it.
            deadlines[dialect] = (sent + 3000, received + 3000, 3000)
        else:
            # An RFC 3339 instant, which the simulator rounds up to the second: exactly known.
            answered_at = sim.requests_for(keys[dialect])[-1]["unix_ms"]
            instant = math.ceil((answered_at + 3000) / 1000) * 1000
            deadlines[dialect] = (instant, instant, instant - sent)
    sim.scenario({"ratelimit": {"remaining_tokens": 0, "reset_tokens_ms": 3000}})
    r, sent, received = timed_call(governor, "openai", keys["openai-tokens"])
    assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "0", dict(r.headers)
    deadlines["openai-tokens"] = (sent + 3000, received + 3000, 3000)
    sim.scenario({"mode": "ok"})  # from now on the provider would say yes

    free_at = {}
    for name, key in keys.items():
        r, sent, received = timed_call(governor, name.split("-")[0], key)
        low_deadline, high_deadline, period = deadlines[name]
        delay = assert_local_cooldown(r, max_delay_ms=int(period * (1 + JITTER)) + 50)
        left_low = low_deadline - received - CLOCK_SLACK_MS
        left_high = high_deadline - sent + CLOCK_SLACK_MS
        assert left_low <= delay <= left_high + JITTER * period, (
            f"{name}: told {delay} ms; {left_low:.0f}..{left_high:.0f} ms of the cooldown were left, "
            f"plus at most {JITTER * period:.0f} ms of jitter"
        )
        free_at[name] = time.monotonic() + delay / 1000
        assert len(sim.requests_for(key)) == 1, f"{name}: the paced call reached the provider"

    after = stats(governor)
    assert delta(before, after, "openai", "preemptive_cooldown") == 2
    assert delta(before, after, "anthropic", "preemptive_cooldown") == 1
    assert delta(before, after, "openai", "local_reject_cooldown") == 2
    assert delta(before, after, "anthropic", "local_reject_cooldown") == 1
    assert delta(before, after, "openai", "upstream_rate_limited") == 0, "pacing must come before any 429"

    # Jitter only lengthens what clients are told, so at the told delay the reset has passed.
    time.sleep(max(0.0, max(free_at.values()) - time.monotonic()) + 0.2)
    for name, key in keys.items():
        r = post(governor, key, name.split("-")[0])
        assert r.status_code == 200 and "x-llm-governor-source" not in r.headers, (name, dict(r.headers))
        assert len(sim.requests_for(key)) == 2, name


# --------------------------------------------------------------------------------------------
# Access logs


def access_log_entries(envoy: Envoy, ids: list, timeout_s: float = 10) -> dict:
    def collect():
        found = {}
        for line in envoy.access_log_lines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("obs_id") in ids:
                found[entry["obs_id"]] = entry
        return found if len(found) == len(ids) else None

    found = wait_for(collect, timeout_s)
    assert found, f"access log lacks some of {ids}:\n" + "\n".join(envoy.access_log_lines()[-10:])
    return found


def test_access_log_records_class_source_and_delay(sim, governor):
    plain, limited = new_key(), new_key()
    ids = {name: uuid.uuid4().hex for name in ("plain", "upstream", "cooldown")}
    sim.scenario({"mode": "rate_limited", "keys": [limited], "retry_after_s": 3})
    r_plain = post(governor, plain, "openai", headers={"x-obs-id": ids["plain"]})
    r_up = post(governor, limited, "openai", headers={"x-obs-id": ids["upstream"]})
    r_cool = post(governor, limited, "openai", headers={"x-obs-id": ids["cooldown"]})
    assert r_plain.status_code == 200
    assert r_up.headers.get("x-llm-governor-source") == "upstream", dict(r_up.headers)
    assert r_cool.headers.get("x-llm-governor-source") == "cooldown", dict(r_cool.headers)

    entries = access_log_entries(governor, list(ids.values()))
    governor_fields = lambda e: {f: e.get(f) for f in GOVERNOR_FIELDS}  # noqa: E731
    assert governor_fields(entries[ids["upstream"]]) == {
        "llm_governor_class": "rate_limited",
        "llm_governor_source": "upstream",
        "llm_governor_delay_ms": r_up.headers["retry-after-ms"],
        # Neither held nor steered.
        "llm_governor_held_ms": None,
        "llm_governor_pool": None,
        # No hold.classes.
        "llm_governor_hold_class": None,
    }, entries[ids["upstream"]]
    assert governor_fields(entries[ids["cooldown"]]) == {
        "llm_governor_class": "rate_limited",
        "llm_governor_source": "cooldown",
        "llm_governor_delay_ms": r_cool.headers["retry-after-ms"],
        # Neither held nor steered.
        "llm_governor_held_ms": None,
        "llm_governor_pool": None,
        # No hold.classes.
        "llm_governor_hold_class": None,
    }, entries[ids["cooldown"]]
    # A response the governor left alone has no governor fields (JSON null; "-" in text logs).
    assert all(v in (None, "", "-") for v in governor_fields(entries[ids["plain"]]).values()), entries[ids["plain"]]


CLASS_CONFIG = {
    "pools": POOLS,
    "hold": {"fair_key": "header:x-tenant-id", "classes": [
        {"name": "interactive", "match": {"header": {"name": "x-tenant-id", "value": "chat"}}, "weight": 4,
         "max_ms": 5_000},
        {"name": "batch", "max_ms": 30_000},
    ]},
}


def class_series(pool: str, cls: str, stat: str) -> str:
    """The Prometheus series of a hold class's stat: the wasm build's through the shipped `class`
    stats tag, the native build's family `class_<stat>` with the label `class`."""
    prefix = NATIVE_PROMETHEUS_PREFIX if NATIVE else WASM_PROMETHEUS_PREFIX
    return f'{prefix}class_{stat}{{llm_pool="{pool}",class="{cls}"}}'


def test_hold_classes_are_counted_logged_and_told(sim, envoy_factory):
    envoy = envoy_factory(CLASS_CONFIG, concurrency=1, access_log_format=ACCESS_LOG_FORMAT, stats_flush_interval="1s")
    key = new_key()
    ids = {name: uuid.uuid4().hex for name in ("chat", "batch", "chat-answered")}

    def call(name: str, tenant: str) -> requests.Response:
        return post(envoy, key, "openai", headers={"x-tenant-id": tenant, "x-obs-id": ids[name]})

    # A 2 s cooldown: a chat and a batch request are held through it and released.
    cool(sim, envoy, key, 2)
    replies: dict = {}
    threads = [threading.Thread(target=lambda n=n, t=t: replies.__setitem__(n, call(n, t)))
               for n, t in (("chat", "chat"), ("batch", "batch"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for name, cls in (("chat", "interactive"), ("batch", "batch")):
        r = replies[name]
        assert r.status_code == 200, (name, dict(r.headers))
        assert r.headers.get("x-llm-governor-hold-class") == cls, dict(r.headers)
        assert int(r.headers["x-llm-governor-held-ms"]) > 0
    # An 8 s cooldown: longer than the interactive class holds (5 s), answered at once.
    cool(sim, envoy, key, 8)
    r = call("chat-answered", "chat")
    assert r.status_code == 429 and r.headers.get("x-llm-governor-source") == "cooldown", dict(r.headers)
    assert r.headers.get("x-llm-governor-hold-class") == "interactive", dict(r.headers)
    assert "x-llm-governor-held-ms" not in r.headers

    entries = access_log_entries(envoy, list(ids.values()))
    assert [entries[ids[n]].get("llm_governor_hold_class") for n in ("chat", "batch", "chat-answered")] == [
        "interactive", "batch", "interactive"], entries
    # The class stats, by /stats name and as Prometheus series with the class label.
    snapshot = stats(envoy)
    want = {("interactive", "held"): 1, ("interactive", "hold_released"): 1, ("interactive", "held_requests"): 0,
            ("batch", "held"): 1, ("batch", "hold_released"): 1, ("default", "held"): 0}
    for (cls, metric), n in want.items():
        assert snapshot[stat_name("openai", f"class.{cls}.{metric}")] == n, (cls, metric, snapshot)
    samples = prometheus_samples(envoy)
    for (cls, metric), n in want.items():
        assert samples.get(class_series("openai", cls, metric)) == str(n), (cls, metric, sorted(samples)[:20])
    # Histograms reach /stats/prometheus at the next stats flush.
    hold_ms = class_series("openai", "interactive", "hold_ms_count")
    assert wait_for(lambda: prometheus_samples(envoy).get(hold_ms) == "1", 5), hold_ms


def shipped_config_text(sim_port: int, access_log: Path) -> str:
    """envoy/envoy.yaml on free ports, in front of the test simulator, logging to a file."""
    text = SHIPPED_CONFIG.read_text()
    replacements = [
        ("port_value: 9901", "port_value: 0"),
        ("port_value: 10000", "port_value: 0"),
        ("port_value: 8081", f"port_value: {sim_port}"),
        ("filename: target/wasm32-wasip1/release/llm_governor.wasm", f"filename: {WASM_MODULE}"),
        ("path: /dev/stdout", f"path: {access_log}"),
    ]
    for old, new in replacements:
        assert text.count(old) == 1, f"envoy/envoy.yaml no longer has exactly one `{old}`"
        text = text.replace(old, new)
    return text


@wasm_only("envoy/envoy.yaml loads the wasm module (envoy/native.yaml is the dynamic module's, in test_shipped_configs)")
def test_shipped_config_logs_the_governor_fields(sim):
    # Not via envoy_factory: the YAML must name the access-log file in this Envoy's workdir.
    envoy = Envoy(CONFIG, upstream_port=sim.port, concurrency=1, bootstrap="")
    envoy.bootstrap = shipped_config_text(sim.port, envoy.access_log_path)
    _register(envoy)  # its log goes into the report if this test fails
    try:
        with envoy:
            check_shipped_config(sim, envoy)
    finally:
        _release(envoy)


def check_shipped_config(sim, envoy: Envoy) -> None:
    """An Anthropic 429 through envoy/envoy.yaml: its access-log line and its Prometheus line."""
    key = new_key("sk-ant-obs")
    sim.scenario({"mode": "rate_limited", "keys": [key], "retry_after_s": 2})
    r = post(envoy, key, "anthropic")
    assert r.headers.get("x-llm-governor-source") == "upstream", dict(r.headers)

    def line():
        for text in envoy.access_log_lines():
            entry = json.loads(text)
            if entry.get("status") == 429:
                return entry
        return None

    entry = wait_for(line, timeout_s=10)
    assert entry, envoy.access_log_lines()
    assert entry["path"] == "/v1/messages", entry
    assert {f: entry.get(f) for f in GOVERNOR_FIELDS} == {
        "llm_governor_class": "rate_limited",
        "llm_governor_source": "upstream",
        "llm_governor_delay_ms": r.headers["retry-after-ms"],
        # Neither held nor steered.
        "llm_governor_held_ms": None,
        "llm_governor_pool": None,
        # No hold.classes.
        "llm_governor_hold_class": None,
    }, entry
    # The shipped stats_tags give the contract's Prometheus names.
    assert 'llm_governor_pool_upstream_rate_limited{llm_pool="anthropic"} 1' in envoy.prometheus().splitlines()


def test_minimal_config_logs_the_same_governor_fields():
    text = MINIMAL_CONFIG.read_text()
    for field, operator in shipped_governor_fields().items():
        assert f'{field}: "{operator}"' in text, f"envoy/minimal.yaml does not log {field}"
    assert "envoy.access_loggers.file" in text


# --------------------------------------------------------------------------------------------
# Two workers


TWO_WORKER_CONFIG = {
    "pools": POOLS,
    "limits": [{"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 1, "burst": 2}],
}


def test_two_workers_share_pacing_and_gauges_converge(sim, envoy_factory):
    envoy = envoy_factory(TWO_WORKER_CONFIG, concurrency=2)
    tenant = lambda: {"x-tenant-id": uuid.uuid4().hex}  # noqa: E731  (own bucket per request)

    # Every response reports the same values; whichever worker wrote last, the gauge shows them.
    sim.scenario({"ratelimit": ANTHROPIC_REPORTED})
    for _ in range(6):
        assert post(envoy, new_key("sk-ant-obs"), "anthropic", headers=tenant()).status_code == 200
    s = stats(envoy)
    assert {m: stat(s, "anthropic", m) for m in ANTHROPIC_GAUGES} == ANTHROPIC_GAUGES
    assert f'{prometheus_series("anthropic", "remaining_requests")} 42' in envoy.prometheus().splitlines()

    # A cooldown written by one worker paces calls on every worker (new connection each).
    key = new_key()
    sim.scenario({"ratelimit": {"remaining_requests": 0, "reset_requests_ms": 30000}})
    assert post(envoy, key, "openai", headers=tenant()).status_code == 200
    for _ in range(6):
        assert_local_cooldown(post(envoy, key, "openai", headers=tenant()), max_delay_ms=int(30000 * (1 + JITTER)) + 50)
    assert len(sim.requests_for(key)) == 1
    s = stats(envoy)
    # Counters add across workers.
    assert stat(s, "openai", "local_reject_cooldown") == 6
    assert stat(s, "openai", "preemptive_cooldown") == 1

    # Local budgets: the third request of one tenant within the minute is refused locally.
    sim.scenario({"mode": "ok"})
    same = {"x-tenant-id": "t-" + uuid.uuid4().hex}
    codes = [post(envoy, new_key(), "openai", headers=same) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert codes[2].headers.get("x-llm-governor-source") == "limit", dict(codes[2].headers)
    assert stat(stats(envoy), "openai", "local_reject_limit") == 1


# --------------------------------------------------------------------------------------------
# The alert rules and the docs name what Envoy really exports


def exported_names(envoy: Envoy) -> set:
    names = set()
    for line in envoy.prometheus().splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_alert_rules_use_series_envoy_exports(sim, governor, envoy_factory):
    # The rules read both builds' series (`<wasm> or <native>`): those of the artifact under
    # test must be ones its Envoy exports, with, for native, the second label's value each
    # selects (class="rate_limited"); the other build's are test_alerts.py's business.
    # Envoy creates per-response-class cluster stats on first use (and the native module its
    # labelled stats on its first stream). The class stats come from a gateway with
    # hold.classes that held one request (a native histogram appears with its first sample).
    assert post(governor, new_key(), "openai").status_code == 200
    classes = envoy_factory(CLASS_CONFIG, concurrency=1, stats_flush_interval="1s")
    key = new_key()
    cool(sim, classes, key, 1)
    assert post(classes, key, "openai", headers={"x-tenant-id": "chat"}).headers.get("x-llm-governor-held-ms")
    assert wait_for(lambda: any("class_hold_ms_bucket" in n for n in exported_names(classes)), 5)
    names = exported_names(governor) | exported_names(classes)
    text = ALERTS.read_text()
    label_names = {"envoy_cluster_name", "envoy_response_code_class", "envoy_response_code"}
    own, other = ((NATIVE_PROMETHEUS_PREFIX, WASM_PROMETHEUS_PREFIX) if NATIVE
                  else (WASM_PROMETHEUS_PREFIX, NATIVE_PROMETHEUS_PREFIX))
    used = set(re.findall(r"\b((?:llm_governor|envoy)_[a-z0-9_]+)\b", text)) - label_names
    used = {n for n in used if not n.startswith(other)}
    assert any(n.startswith(own) for n in used), used
    unknown = sorted(n for n in used if n not in names)
    assert not unknown, f"alerts.yaml names series Envoy does not export: {unknown}"
    assert "llm_pool" in text
    prom = governor.prometheus()
    for label in re.findall(r"\b(envoy_[a-z_]+)=", text):
        assert f"{label}=" in prom, f"alerts.yaml uses label {label}, which Envoy does not export"
    if NATIVE:
        selected = re.findall(rf"\b({NATIVE_PROMETHEUS_PREFIX}[a-z_]+)\{{([a-z]+=\"[a-z_]+\")\}}", text)
        assert selected, "alerts.yaml selects no native family by its second label"
        for name, matcher in selected:
            assert re.search(rf'^{name}\{{llm_pool="openai",{re.escape(matcher)}\}} ', prom, re.M), (
                f"alerts.yaml selects {name}{{{matcher}}}, which Envoy does not export")


def documented_stats() -> dict:
    """Every per-pool stat the tables of docs/observability.md name, by kind (from the
    Prometheus TYPE the table's section implies: histograms are in their own table)."""
    doc = DOCS.read_text()
    names = re.findall(r"^\| `llm_governor\.pool\.<P>\.([a-z0-9_]+)` \|", doc, re.M)
    histogram_section = doc.split("## Histogram", 1)[1].split("\n## ", 1)[0]
    histograms = set(re.findall(r"`llm_governor\.pool\.<P>\.([a-z0-9_]+)`", histogram_section))
    return {n: ("histogram" if n in histograms else "value") for n in names}


def test_every_documented_stat_exists_at_zero_from_configuration(envoy_factory):
    # No request at all: the stats exist, at 0, from the moment the plugin is configured, for
    # every configured pool and for `default`, so rate() and increase() work from the first
    # event. Nothing is exported that the docs do not describe.
    envoy = envoy_factory({"pools": POOLS}, concurrency=2)
    if NATIVE:
        # Native: Envoy makes a labelled stat on its first write, which only a stream can do;
        # the module writes every counter and gauge at 0 on its first stream (histograms get
        # no sample, so they appear with the first one). One request to an unmatched path.
        requests.get(envoy.url + "/health", timeout=5)
    documented = documented_stats()
    assert len(documented) >= 30, documented
    snapshot = envoy.governor_stats()
    prometheus = set(envoy.prometheus().splitlines())
    for pool in ("openai", "anthropic", "default"):
        exported = {name.split(".", 4)[4] for name in snapshot if name.startswith(f"wasmcustom.llm_governor.pool.{pool}.")}
        expected = {m for m, kind in documented.items() if not (NATIVE and kind == "histogram")}
        assert exported == expected, (
            f"pool {pool}: exported but undocumented {sorted(exported - set(documented))}, "
            f"documented but missing {sorted(expected - exported)}"
        )
        for metric, kind in documented.items():
            if kind == "histogram":
                if NATIVE:
                    continue  # no series before the first sample (see above)
                assert f'{prometheus_series(pool, metric, "_count")} 0' in prometheus, (pool, metric)
            else:
                assert snapshot[stat_name(pool, metric)] == 0, (pool, metric, snapshot[stat_name(pool, metric)])
                assert f'{prometheus_series(pool, metric)} 0' in prometheus, (pool, metric)


def test_docs_describe_every_stat(governor):
    if NATIVE:
        # Native: the labelled stats exist from the module's first stream on.
        post(governor, new_key(), "openai")
    doc = DOCS.read_text()
    metrics = sorted({name.split(".")[-1] for name in stats(governor) if ".pool.openai." in name} | {"retry_after_ms"})
    assert len(metrics) >= 23, metrics
    undocumented = [
        m for m in metrics if f"llm_governor.pool.<P>.{m}" not in doc or f"llm_governor_pool_{m}" not in doc
    ]
    assert not undocumented, f"docs/observability.md lacks the /stats or Prometheus name of: {undocumented}"
    # The native build's names: the table of families with a second label names each family,
    # its label and every value; the rest follow the rule the section states.
    names = doc.split("### In the native build", 1)[1].split("\n## ", 1)[0]
    assert f"`{NATIVE_PROMETHEUS_PREFIX}<stat>{{llm_pool=\"P\"}}`" in names, "no rule for the unlabelled families"
    for m in metrics:
        family, label = native_family(m)
        if label:
            row = re.search(rf"^\| `{NATIVE_PROMETHEUS_PREFIX}{family}` \| `{label[0]}` \|(.*)$", names, re.M)
            assert row and f"`{label[1]}`" in row.group(1), f"docs/observability.md lacks the native name of {m}"
    for anchor in re.findall(r"docs/observability\.md#([a-z0-9-]+)", ALERTS.read_text()):
        assert f'id="{anchor}"' in doc, f"alerts.yaml points at #{anchor}, which docs/observability.md lacks"
