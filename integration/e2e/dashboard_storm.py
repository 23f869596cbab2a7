"""A short storm that moves every panel of deploy/grafana/llm-governor.json, and the dashboard's
queries as Prometheus runs them. Used by test_dashboard.py and by scripts/render-dashboard.py
(the README's picture), so the picture shows exactly what the test checks.

The gateway: Envoy with the module in front of the simulator, a fallback pool routed back to
the same simulator under the injected credential (harness.failover_bootstrap), a tenant bucket,
a max_in_flight cap of 2, short holds, and the tenant's requests in a hold class of their own. The storm, ~17 s, one phase after another, several
client threads in each:
1. success with 400 ms latency and rate-limit headers: an Anthropic account's cap fills (a
   pool without fallback, so its requests are held, not steered), the budget gauges are set;
   a tenant over its bucket is held or answered `limit`;
2. 429s with retry-after 2 s for one Anthropic and one OpenAI account: cooldowns, holds,
   local answers for clients that cannot wait, the OpenAI account steered to its fallback;
3. a quota answer for another Anthropic account (a pool without fallback): quota_exhausted,
   then local quota answers;
4. 529s for the Anthropic account (its clients under a tenant of their own): overloaded; a
   tenant that asks for more than its bucket and cannot be held: local `limit` answers.
Some requests say they are SDK retries (`x-stainless-retry-count: 1`).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from contextlib import contextmanager

import requests

from harness import REPO_ROOT, Envoy, failover_bootstrap

DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "llm-governor.json"
SCRAPE_S = 1.0
# Grafana's $__rate_interval: max(4 x scrape interval, step). The storm's step is 1 s.
RATE_INTERVAL = "4s"
MAX_IN_FLIGHT = 2

CONFIG = {
    "pools": [
        {"name": "openai", "match": {"path_prefix": "/v1/chat"}, "dialect": "openai", "fallback": ["openai-backup"]},
        {"name": "openai-backup", "dialect": "openai", "account": "backup",
         "match": {"header": {"name": "x-llm-governor-pool", "value": "openai-backup"}}},
        {"name": "anthropic", "match": {"path_prefix": "/v1/messages"}, "dialect": "anthropic"},
    ],
    "limits": [
        {"name": "tenant-rpm", "key": "header:x-tenant-id", "requests_per_minute": 600, "burst": 10},
        {"name": "cap", "key": "account", "max_in_flight": MAX_IN_FLIGHT},
    ],
    # The acme tenant's requests are a hold class of their own (the rest: `default`), so the
    # class panels have two classes to show.
    "hold": {"max_ms": 2500, "fair_key": "header:x-tenant-id", "classes": [
        {"name": "tenant", "match": {"header": {"name": "x-tenant-id", "value": "acme"}}, "weight": 2},
    ]},
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list:
    """Every panel that shows data (rows excluded), including those inside collapsed rows."""
    out = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def prometheus_expr(expr: str, variables: dict) -> str:
    """A panel's expression as Grafana sends it to Prometheus: variables substituted."""
    out = expr.replace("$__rate_interval", variables.get("__rate_interval", RATE_INTERVAL))
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        out = out.replace("${" + name + "}", value).replace("$" + name, value)
    leftover = re.findall(r"\$\{?\w+", out)
    assert not leftover, f"unsubstituted variables {leftover} in {expr}"
    return out


def targets(dash: dict, variables: dict) -> list:
    """(panel title, refId, legend, Prometheus expression) of every query of every panel."""
    return [
        (p["title"], t["refId"], t.get("legendFormat", ""), prometheus_expr(t["expr"], variables))
        for p in panels(dash)
        for t in p.get("targets", [])
    ]


DEFAULT_VARIABLES = {"pool": ".*", "max_in_flight": str(MAX_IN_FLIGHT)}


@contextmanager
def gateway(sim):
    boot = failover_bootstrap(sim.port, sim.port, CONFIG, backup_pools=("openai-backup",))
    boot["stats_flush_interval"] = "1s"  # histograms reach /stats/prometheus each second
    envoy = Envoy(None, upstream_port=sim.port, bootstrap=boot, concurrency=2)
    envoy.start()
    try:
        yield envoy
    finally:
        envoy.stop(check=False)
        critical = envoy.critical_wasm_lines()
        envoy.cleanup()
        if critical:
            raise AssertionError("Envoy logged critical wasm lines:\n" + "\n".join(critical))


def _client(envoy, path: str, key: str, until: float, stop: threading.Event, headers=None, pause_s: float = 0.05,
            counts: dict = None) -> None:
    session = requests.Session()
    body = ({"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
            if path.startswith("/v1/messages") else
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]})
    h = {"authorization": f"Bearer {key}", "x-api-key": key, "anthropic-version": "2023-06-01", **(headers or {})}
    while time.monotonic() < until and not stop.is_set():
        try:
            r = session.post(envoy.url + path, json=body, headers=h, timeout=10)
            if counts is not None:
                counts[r.status_code] = counts.get(r.status_code, 0) + 1
        except requests.RequestException:
            if counts is not None:
                counts["error"] = counts.get("error", 0) + 1
        time.sleep(pause_s)


def _phase(envoy, seconds: float, clients: list, counts: dict) -> None:
    until = time.monotonic() + seconds
    stop = threading.Event()
    threads = [threading.Thread(target=_client, args=(envoy, *c, until, stop), kwargs={"counts": counts}, daemon=True)
               if len(c) == 2 else
               threading.Thread(target=_client, args=(envoy, c[0], c[1], until, stop, c[2]), kwargs={"counts": counts}, daemon=True)
               for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 15)
    stop.set()


def run_storm(envoy, sim) -> dict:
    """Runs the four phases; returns the status codes the clients saw."""
    tag = uuid.uuid4().hex[:8]
    oai, anth, quota, tenant, capped, flooder = (
        f"sk-{name}-{tag}" for name in ("oai", "anth", "quota", "tenant", "capped", "flooder"))
    retry = {"x-stainless-retry-count": "1"}
    counts: dict = {}
    sim.reset()
    sim.scenario({"latency_ms": 400, "ratelimit": {
        "limit_requests": 500, "remaining_requests": 120, "reset_requests_ms": 30000,
        "limit_tokens": 100000, "remaining_tokens": 40000, "reset_tokens_ms": 6000}})
    _phase(envoy, 5, [("/v1/messages", capped)] * 5
           + [("/v1/chat/completions", tenant, {"x-tenant-id": "acme"})] * 3
           + [("/v1/messages", anth, retry)], counts)
    sim.scenario({"mode": "rate_limited", "retry_after_s": 2, "keys": [oai, anth]})
    _phase(envoy, 5, [("/v1/chat/completions", oai)] * 2
           + [("/v1/messages", anth)] * 2
           + [("/v1/messages", anth, {"x-stainless-read-timeout": "1"})]
           + [("/v1/chat/completions", oai, retry)], counts)
    sim.scenario({"mode": "quota", "keys": [quota]})
    _phase(envoy, 3, [("/v1/messages", quota)] * 2 + [("/v1/messages", anth)], counts)
    sim.scenario({"mode": "overloaded", "keys": [anth]})
    # Two clients under a tenant of their own, so the 529s never hang on who wins the refills
    # of the tenant bucket's key `-`; two more without x-tenant-id share `-` with the OpenAI
    # client. The local `limit` answers come from three clients of a tenant `flood` that
    # cannot be held (a 1 s timeout is under hold.margin_ms): on an account the simulator
    # answers at once they ask for more than the bucket's 10 per second after its burst of 10
    # however slow the machine (at 100 ms a round trip, 30 a second), which the clients that
    # share `-` alone did not always do (CI, stop 27: the `limit` query stayed at 0).
    flood = {"x-stainless-read-timeout": "1", "x-tenant-id": "flood"}
    _phase(envoy, 4, [("/v1/messages", anth, {"x-stainless-read-timeout": "1", "x-tenant-id": "ops"})] * 2
           + [("/v1/messages", anth, {"x-stainless-read-timeout": "1"})] * 2
           + [("/v1/chat/completions", oai)]
           + [("/v1/messages", flooder, flood)] * 3, counts)
    sim.scenario({})
    return counts
