"""deploy/grafana/llm-governor.json: the conventions it keeps, and every query run by a real
Prometheus (Debian's `prometheus`, on loopback) that scraped a real Envoy with the module
through a short storm (integration/e2e/dashboard_storm.py), for the artifact under test
(LLM_GOVERNOR_ARTIFACT=wasm or native: one dashboard serves both builds).

- Every panel's query parses (Prometheus's API answers `success`, where a broken expression
  gets `bad_data`: the control shows it) and returns data over the storm; the panels the storm
  exercises show a value above zero at some point.
- Every metric a query names is one the Envoy actually exported (no typo, no stale name), and
  so is every value of a native family's second label a query selects (class="rate_limited").
- Every wasm series a query selects has the native build's beside it
  (`<wasm series> or <native series>`, harness.missing_native_twins), and the `pool` variable
  lists the pools of either build.
- Grafana conventions: schemaVersion 39-41, one `datasource` variable, every panel's datasource
  is it, counters only as rate()/increase() over `$__rate_interval`, a title, description and
  unit on every panel.

LLM_GOVERNOR_DASHBOARD_DATA=path writes the range data of every query to path (JSON), which
scripts/render-dashboard.py turns into docs/img/dashboard.png.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

import dashboard_storm as storm
from harness import (NATIVE, NATIVE_PROMETHEUS_PREFIX, WASM_PROMETHEUS_PREFIX, missing_native_twins, native_family,
                     native_metric)
from servers import LocalPrometheus, require

COUNTERS = {
    "upstream_rate_limited", "upstream_quota_exhausted", "upstream_overloaded", "local_reject_cooldown",
    "local_reject_limit", "local_reject_quota", "overflow_keys", "exhausted_requests", "exhausted_tokens",
    "exhausted_input_tokens", "exhausted_output_tokens", "preemptive_cooldown", "store_contention",
    "body_unavailable", "held", "hold_released", "hold_expired", "failover", "client_retries",
    "succeeded_after_retry", "fleet_calls_ok", "fleet_calls_over_limit", "fleet_errors", "fleet_fallback",
}
# The native build's counter families (`upstream` for upstream_rate_limited, ...).
NATIVE_COUNTERS = {native_family(c)[0] for c in COUNTERS}
# Any series of either build a query names, and those of the artifact under test.
METRIC = re.compile(rf"\b((?:{WASM_PROMETHEUS_PREFIX}|{NATIVE_PROMETHEUS_PREFIX})[a-z_]+)")
OWN_PREFIX = NATIVE_PROMETHEUS_PREFIX if NATIVE else WASM_PROMETHEUS_PREFIX
# Panels of histograms the native module never writes in the storm: Envoy makes a labelled
# histogram on its first sample, and the storm's gateway has no fleet limits (so fleet_call_ms
# has no series to return) and no token limits (nor the prediction errors). The wasm module's
# exist from the start.
NATIVE_NO_SAMPLE = {"Fleet call latency": "fleet_call_ms", "Token prediction error": "prediction_error_pct"}
# The panels the storm must move: every query of each shows a value above zero at some point
# (the rest may stay at 0 in it: bodies not delivered, the token dimensions the simulator's
# 429s do not name).
MUST_MOVE = {
    "Provider 429/503/529 per second", "Answered locally per second", "Failovers per second",
    "Provider 429s by class and pool", "Cooldowns started and requests answered while cooling",
    "Wait clients are told (retry-after-ms)", "Held requests", "Hold wait", "Hold outcomes",
    "Local answers by reason", "In flight vs cap", "Requests: remaining vs limit", "Tokens: remaining vs limit",
    "Budget left", "Window resets in", "Failovers", "Client retries",
    "Held requests by class", "Releases by class", "Hold wait by class vs its limit",
}


def test_dashboard_follows_the_conventions():
    dash = storm.dashboard()
    assert 39 <= dash["schemaVersion"] <= 41
    variables = dash["templating"]["list"]
    datasources = [v for v in variables if v["type"] == "datasource"]
    assert len(datasources) == 1 and datasources[0]["name"] == "datasource" and datasources[0]["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${datasource}"}
    for v in variables:
        if "datasource" in v:
            assert v["datasource"] == ds, v["name"]
    titles = [p["title"] for p in storm.panels(dash)]
    assert len(titles) == len(set(titles)), "duplicate panel titles"
    assert {p["title"] for p in storm.panels(dash)} >= MUST_MOVE
    ids = [p["id"] for p in dash["panels"]] + [p["id"] for p in storm.panels(dash)]
    assert len(set(ids)) == len(set(p["id"] for p in dash["panels"]) | set(p["id"] for p in storm.panels(dash)))
    for panel in storm.panels(dash):
        name = panel["title"]
        assert panel.get("description", "").strip(), f"{name}: no description"
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{name}: no unit"
        assert panel["datasource"] == ds, f"{name}: datasource is not ${{datasource}}"
        assert panel["targets"], f"{name}: no query"
        for target in panel["targets"]:
            assert target["datasource"] == ds, f"{name}/{target['refId']}"
            expr = target["expr"]
            ranges = re.findall(r"\[([^\]]+)\]", expr)
            assert all(r == "$__rate_interval" for r in ranges), f"{name}: ranges {ranges} (use $__rate_interval)"
            for m in METRIC.finditer(expr):
                metric = m.group(1)
                if metric.removeprefix(WASM_PROMETHEUS_PREFIX) in COUNTERS or (
                        metric.removeprefix(NATIVE_PROMETHEUS_PREFIX) in NATIVE_COUNTERS):
                    assert re.search(rf"(rate|increase)\({metric}\{{[^}}]*\}}\[\$__rate_interval\]\)", expr), (
                        f"{name}: counter {metric} outside rate(...[$__rate_interval])")
                assert expr[m.end():].startswith('{llm_pool=~"$pool"'), f"{name}: {metric} ignores $pool"
            missing = missing_native_twins(expr)
            assert not missing, f"{name}/{target['refId']}: wasm series without the native build's beside it: {missing}"
    pool = next(v for v in variables if v["name"] == "pool")
    assert pool["definition"] == pool["query"]["query"], "the pool variable's definition is not its query"
    selector = pool_variable_selector(dash)
    assert set(METRIC.findall(selector)) == {
        WASM_PROMETHEUS_PREFIX + "held_requests", native_metric(WASM_PROMETHEUS_PREFIX + "held_requests")[0]}, selector
    # The fleet's panels (issue 21) in a row of their own, last: the storm has no fleet, so they
    # are checked to parse and return their series (at 0), not to move.
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    assert rows[-1]["title"] == "Fleet" and len(rows[-1]["panels"]) == 3


def pool_variable_selector(dash: dict) -> str:
    """The series selector of the `pool` variable's `label_values(<selector>, llm_pool)`."""
    pool = next(v for v in dash["templating"]["list"] if v["name"] == "pool")
    m = re.fullmatch(r"label_values\((.+), llm_pool\)", pool["query"]["query"])
    assert m, pool["query"]
    return m.group(1)


@pytest.fixture(scope="module")
def scraped(simulator):
    """The storm through a real Envoy, scraped by a real Prometheus: (prometheus, start, end,
    names Envoy exported, status codes the clients saw)."""
    binary = require("prometheus")
    with storm.gateway(simulator) as envoy:
        with LocalPrometheus(binary, [f"127.0.0.1:{envoy.admin_port}"], scrape_s=storm.SCRAPE_S) as prom:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                up = prom.query("up")
                if up.get("data", {}).get("result") and up["data"]["result"][0]["value"][1] == "1":
                    break
                time.sleep(0.2)
            else:
                pytest.fail(f"Prometheus never scraped Envoy: {up}")
            start = time.time()
            counts = storm.run_storm(envoy, simulator)
            time.sleep(3 * storm.SCRAPE_S)  # the last flush and scrape
            end = time.time()
            text = envoy.prometheus()
            exported = set(re.findall(r"^([a-z_]+)(?:\{|\s)", text, re.M))
            # (name, label="value") of every series of the native families' second labels.
            exported |= set(re.findall(r'^([a-z_]+)\{[^}]*?\b((?:class|reason|dimension|outcome)="[a-z_]+")', text, re.M))
            yield prom, start, end, exported, counts


def test_the_storm_reached_the_provider_and_the_gateway(scraped):
    _, _, _, _, counts = scraped
    assert counts.get(200, 0) > 20, counts
    assert counts.get(429, 0) > 5, counts


def test_every_query_names_metrics_envoy_exports(scraped):
    # The series of the artifact under test; for native, with the second label's value each
    # selects (a typo in class="..." would select nothing).
    _, _, _, exported, _ = scraped
    names = set()
    for title, _, _, expr in storm.targets(storm.dashboard(), storm.DEFAULT_VARIABLES):
        for m in re.finditer(rf"\b({OWN_PREFIX}[a-z_]+)(\{{[^}}]*\}})?", expr):
            name = m.group(1)
            if NATIVE and NATIVE_NO_SAMPLE.get(title) and NATIVE_NO_SAMPLE[title] in name:
                continue
            names.add(name)
            names |= {(name, v) for v in re.findall(r'\b((?:class|reason|dimension|outcome)="[a-z_]+")', m.group(2) or "")}
    assert names, f"no {OWN_PREFIX}* metric in the dashboard"
    missing = sorted(map(str, (n for n in names if n not in exported)))
    assert not missing, f"queried but not exported by Envoy: {missing}"


def test_the_pool_variable_lists_every_pool(scraped):
    # What Grafana's label_values(<selector>, llm_pool) asks Prometheus, on the build under test.
    prom = scraped[0]
    selector = pool_variable_selector(storm.dashboard())
    answer = prom.label_values("llm_pool", selector)
    assert answer.get("status") == "success", answer
    pools = {p["name"] for p in storm.CONFIG["pools"]} | {"default"}
    assert set(answer["data"]) == pools, (selector, answer["data"])


def test_every_panel_query_parses_and_returns_data(scraped):
    prom, start, end, _, _ = scraped
    flat = []
    data: dict = {}
    for title, ref, legend, expr in storm.targets(storm.dashboard(), storm.DEFAULT_VARIABLES):
        answer = prom.query_range(expr, start, end, step=1)
        assert answer.get("status") == "success", f"{title}/{ref}: {answer.get('error')} in {expr}"
        result = answer["data"]["result"]
        if NATIVE and title in NATIVE_NO_SAMPLE:
            assert not result or all(v == "NaN" for series in result for _, v in series["values"]), result
            continue
        assert result, f"{title}/{ref}: no data over the storm: {expr}"
        peak = max((float(v) for series in result for _, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")),
                   default=0.0)
        if title in MUST_MOVE and peak <= 0:
            flat.append(f"{title}/{ref} ({legend})")
        data.setdefault(title, []).append({"ref": ref, "legend": legend, "expr": expr, "result": result})
    assert not flat, f"queries of panels the storm should move stayed at 0: {flat}"
    out = os.environ.get("LLM_GOVERNOR_DASHBOARD_DATA")
    if out:
        with open(out, "w") as f:
            json.dump({"start": start, "end": end, "panels": data}, f)


def test_a_broken_query_is_refused_by_prometheus(scraped):
    # The control: the parse check above can fail.
    prom = scraped[0]
    answer = prom.query('sum by (llm_pool) (rate(llm_governor_pool_held{llm_pool=~".*"}[4s])')
    assert answer.get("status") == "error" and answer.get("errorType") == "bad_data", answer
