"""`make storm`: 429 storms through several gateway configurations, side by side.

    .venv/bin/python bench/storm/storm.py [--scenarios issue3,issue5,overnight,replay] [--configs abcdefg]
                                          [--repeat N] [--no-plot] [--artifact wasm,native]
    .venv/bin/python bench/storm/storm.py --scenarios issue3-failover,spendcap-failover
    .venv/bin/python bench/storm/storm.py --scenarios tpm,tpm-full --configs ead [--duration 150]

Configurations: (a) no gateway, (b) Envoy retrying 429 x3, (c) Envoy with
rate_limited_retry_back_off, (d) LiteLLM's proxy with num_retries: 3, (e) Envoy + llm-governor
(one pool for /v1/chat, defaults: hold on), (f) (e) with retry_after.escalate, (g) (e) with
hold off (`hold.max_ms: 0`). The overnight scenario runs its own set: (e-cap) llm-governor with
`max_in_flight: 8` per account, (e), (g), (a), (d-cap) LiteLLM with the deployment's
`max_parallel_requests: 8`, (d). The failover scenarios (issue 9: issue3-failover,
spendcap-failover) add a second provider (a second simulator) and run (e) (one provider, no
fallback), (e-fo) llm-governor with a fallback pool on a second Envoy cluster, (d-fo) LiteLLM
with the two providers as two deployments of one model; each of their storms gets freshly
started gateways. The token storms (issue 12: tpm, tpm-full; a provider limit of 20,000 tokens
per minute, 30 SDK clients calling in a loop for `--duration` s) run (e-tpm) llm-governor with
`tokens_per_minute: 20000` reserving before the call (settled with the usage), (e-tpm-resv) the
same with `settle: "reservation"`, (e-tpm-after) charging after the response (`reserve: false`),
(a) and (d). The fleet storms (issue 21: fleet, fleet-cooldown) run three Envoys behind a
60/30/10 balancer (x-once, x-split, x-fleet, x-fleet-m, x-fleet-free) and (x-litellm) three
LiteLLM proxies sharing the deployment's rpm/tpm on one Redis behind the same balancer.
The noisy-neighbour storms (issue 33: noisy-neighbour, noisy-neighbour-slow; one account whose
provider admits 10 requests per 2 s, a batch tenant of 40 SDK clients calling back to back, a
chat tenant of 4) run (e) arrival order, (e-fair) `hold.fair_key: header:x-tenant-id`,
(e-classes) the fair key and classes (chat interactive, weight 4; batch 120 s holds) and
(d-prio) LiteLLM's priority scheduler (chat priority 0, batch 1), per tenant: completed, p50 /
p95 wait, local 429s, and the provider's admissions per second. The outage (issue 31:
outage) runs 1, 3 and 6 Envoys (r1, r3, r3-skew, r6; -fleet: cooldowns shared) and
(r3-litellm); the fleet cap (fleet-cap: a provider taking 6 requests at a time) runs
(r3-skew-cap-once) max_in_flight 6 on each of three Envoys, (r3-skew-cap-split) 2 on each and
(r3-skew-cap-fleet) 6 for the fleet.
`--configs` selects by letter (`e` selects e, e-cap, e-fo and the e-tpm ones).
Scenarios: bench/storm/storm_core/scenarios.py; definitions of every figure:
storm_core/analysis.py and docs/benchmarks-history.md. Writes bench/out/storm/results.json and
one timeline PNG per scenario, and prints the tables; with --repeat N each cell is min–max
(median) over N runs, every gateway restarted for each run.

Artifacts (issue 23): every llm-governor configuration (e*, f, g, x-*) runs once per artifact of
`--artifact` (default: $LLM_GOVERNOR_ARTIFACT, else wasm): `--artifact wasm,native` puts the
proxy-wasm module's row and the dynamic module's (target/release/libllm_governor.so) side by
side, labelled `(e, wasm)` and `(e, native)`; results.json records each run's `artifact`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from storm_core import REPO_ROOT, analysis, gateways  # noqa: E402
from storm_core.run import run_storm  # noqa: E402
from storm_core.scenarios import SCENARIOS  # noqa: E402

from harness import ARTIFACTS, NATIVE_MODULE, WASM_MODULE, Simulator  # noqa: E402

PUBLISHED = {  # the published replay's table (shared/seeds/002): requests, completed, rate, peak
    "immediate": (480, 0, 0.0, 480),
    "exponential": (480, 0, 0.0, 120),
    "jittered": (480, 94, 0.783, 120),
}

# (header, figure, format); optional columns appear when some row has the figure.
COLUMNS = [
    ("completed", "completed", "{:.0f}/{calls}"),
    ("upstream req / call", "per_call", "{:.2f}"),
    ("provider 429s", "provider_429s", "{:.0f}"),
    ("provider 429s after first wave", "late_429s", "{:.0f}"),
    ("max late 429s in a cooldown round", "max_late_429s_per_round", "{:.0f}"),
    ("client-visible 429s", "client_429s", "{:.0f}"),
    ("of them local (filter)", "client_local_429s", "{:.0f}"),
    ("p50 to completion", "p50_ms", "{:,.0f} ms"),
    ("p99 to completion", "p99_ms", "{:,.0f} ms"),
]
# Failover storms (issue 9): both providers together, then each provider's own figures.
FAILOVER_COLUMNS = [
    ("completed", "completed", "{:.0f}/{calls}"),
    ("served by backup", "backup_ok", "{:.0f}"),
    ("upstream req / call (both)", "per_call", "{:.2f}"),
    ("requests primary", "primary_requests", "{:.0f}"),
    ("requests backup", "backup_requests", "{:.0f}"),
    ("429s primary", "primary_429s", "{:.0f}"),
    ("429s backup", "backup_429s", "{:.0f}"),
    ("primary 429s after its first wave", "primary_late_429s", "{:.0f}"),
    ("backup 429s after its first wave", "backup_late_429s", "{:.0f}"),
    ("client-visible 429s", "client_429s", "{:.0f}"),
    ("of them local (filter)", "client_local_429s", "{:.0f}"),
    ("p50 to completion", "p50_ms", "{:,.0f} ms"),
    ("p99 to completion", "p99_ms", "{:,.0f} ms"),
]
# Token storms (issue 12): a loop of calls against a provider token budget.
TPM_COLUMNS = [
    ("calls", "calls", "{:.0f}"),
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed_calls", "{:.0f}"),
    ("provider requests", "upstream_requests", "{:.0f}"),
    ("provider token 429s", "token_429s", "{:.0f}"),
    ("of them at t ≥ 60 s", "token_429s_after_60s", "{:.0f}"),
    ("client-visible 429s", "client_429s", "{:.0f}"),
    ("of them local", "client_local_429s", "{:.0f}"),
    ("held", "held", "{:.0f}"),
    ("overshoot (tokens)", "overshoot_tokens", "{:,.0f}"),
    ("overshoot (requests)", "overshoot_requests", "{:.1f}"),
    ("p50 to completion", "p50_ms", "{:,.0f} ms"),
]
# The agents storm (issue 32): a provider that counts as Anthropic documents.
AGENT_COLUMNS = [
    ("calls", "calls", "{:.0f}"),
    ("completed", "completed", "{:.0f}"),
    ("served in 40 s", "served_in_run", "{:.0f}"),
    ("provider admits on its own", "provider_admits", "{:.0f}"),
    ("served / admits", "of_provider_admits", "{:.0%}"),
    ("provider 429s", "provider_429s", "{:.0f}"),
    ("of them input", "input_429s", "{:.0f}"),
    ("of them output", "output_429s", "{:.0f}"),
    ("client-visible 429s", "client_429s", "{:.0f}"),
    ("of them local", "client_local_429s", "{:.0f}"),
    ("p50", "p50_ms", "{:,.0f} ms"),
    ("p99", "p99_ms", "{:,.0f} ms"),
    ("input prediction median error", "input_error_p50_pct", "{:.1f} %"),
]
# The fleet-cap storm (issue 31): one concurrency cap over three Envoys.
CAP_COLUMNS = [
    ("completed", "completed", "{:.0f}/{calls}"),
    ("upstream req / call", "per_call", "{:.2f}"),
    ("provider max in flight", "provider_max_in_flight", "{:.0f}"),
    ("provider concurrency 429s", "concurrency_429s", "{:.0f}"),
    ("client-visible 429s", "client_429s", "{:.0f}"),
    ("served / s", "served_per_s", "{:.2f}"),
    ("of what the cap lets through", "of_cap", "{:.0%}"),
    ("p50 to completion", "p50_ms", "{:,.0f} ms"),
    ("p99 to completion", "p99_ms", "{:,.0f} ms"),
]
OPTIONAL_COLUMNS = [
    ("p99 / schedule minimum", "p99_over_schedule_min", "{:.3f}"),
    ("provider max in flight", "provider_max_in_flight", "{:.0f}"),
    ("first success after recovery", "first_success_after_recovery_ms", "{:,.0f} ms"),
]


def cell(rows: list, figure: str, fmt: str) -> str:
    values = [r[figure] for r in rows if r.get(figure) is not None]
    if not values:
        return "–"
    show = lambda v: fmt.format(v, calls=rows[0]["calls"])  # noqa: E731
    lo, hi = min(values), max(values)
    if lo == hi:
        return show(lo) + ("" if len(values) == len(rows) else f" ({len(values)} of {len(rows)} runs)")
    return f"{show(lo)} – {show(hi)} ({show(statistics.median(values))})"


# Tenant storms (issue 33): per tenant, then the provider.
TENANT_FIGURES = [
    ("completed", "completed", "{:.0f}"),
    ("failed", "failed", "{:.0f}"),
    ("p50 wait", "p50_wait_ms", "{:,.0f} ms"),
    ("p95 wait", "p95_wait_ms", "{:,.0f} ms"),
    ("local 429s", "local_429s", "{:.0f}"),
]
PROVIDER_FIGURES = [
    ("provider admissions / s", "admitted_per_s", "{:.2f}"),
    ("pace used", "pace_used", "{:.0%}"),
    ("provider 429s after 1 s", "provider_429s_after_1s", "{:.0f}"),
]


def tenant_columns(rows: list) -> list:
    """The tenant storm's columns, its tenants' figures flattened into each row."""
    names = list(dict.fromkeys(n for r in rows for n in r.get("tenants", {})))
    for r in rows:
        for name, figures in r.get("tenants", {}).items():
            r.update({f"{name}_{k}": v for k, v in figures.items()})
    return [(f"{n} {h}", f"{n}_{f}", fmt) for n in names for h, f, fmt in TENANT_FIGURES] + PROVIDER_FIGURES


def storm_table(rows: list, config_order: tuple) -> str:
    """One row per configuration; with several runs, every cell is min – max (median)."""
    if any("served_in_run" in r for r in rows):
        columns = AGENT_COLUMNS
    elif any("of_cap" in r for r in rows):
        columns = CAP_COLUMNS
    elif any("tenants" in r for r in rows):
        columns = tenant_columns(rows)
    elif any("backup_requests" in r for r in rows):
        columns = FAILOVER_COLUMNS
    elif any("token_429s" in r for r in rows):
        columns = TPM_COLUMNS
    else:
        columns = COLUMNS + [c for c in OPTIONAL_COLUMNS if any(c[1] in r for r in rows)]
    by_config: dict = {}
    for r in rows:
        by_config.setdefault((r["config"], r.get("artifact")), []).append(r)
    lines = ["| config | runs | " + " | ".join(c[0] for c in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]

    def order(k: tuple) -> tuple:
        config, artifact = k
        return (config_order.index(config) if config in config_order else len(config_order),
                ARTIFACTS.index(artifact) if artifact in ARTIFACTS else -1)

    for key in sorted(by_config, key=order):
        runs = by_config[key]
        measured = [r for r in runs if "unavailable" not in r]
        label = row_label(runs[0])
        if not measured:
            lines.append(f"| {label} | 0 | not run: {runs[0]['unavailable']} |" + " |" * (len(columns) - 1))
            continue
        lines.append(f"| {label} | {len(measured)} | " + " | ".join(cell(measured, c[1], c[2]) for c in columns) + " |")
    return "\n".join(lines)


def row_label(r: dict) -> str:
    """`(e, native) Envoy + llm-governor (hold on)`; configurations without llm-governor `(a) ...`."""
    artifact = f", {r['artifact']}" if r.get("artifact") else ""
    return f"({r['config']}{artifact}) {r['config_name']}"


def replay_table(rows: list) -> str:
    lines = [
        "| schedule | config | completed | upstream requests | peak / 100 ms in throttled window "
        "| throttled-window requests after first wave | first success after recovery |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, (req, done, rate, peak) in PUBLISHED.items():
        off = analysis.published_replay(name)
        lines.append(
            f"| published: {name} | offline model | {rate:.1%} ({done}/120; re-run here: {off['completion_rate']:.1%}) "
            f"| {req} (re-run: {off['requests']}) | {peak} (re-run: {off['peak_100ms_in_throttled_window']}) | – | – |"
        )
    for r in rows:
        kind = "Strategy C fixed" if "-fixed-" in r["scenario"] else "obey retry-after-ms"
        style = r["scenario"].rsplit("-", 1)[1]
        label = f"| {kind} (hint in {style}) | {row_label(r)} |"
        if "unavailable" in r:
            lines.append(f"{label} not run: {r['unavailable']} | | | | |")
            continue
        lines.append(
            f"{label} {r['completion_rate']:.1%} | {r['upstream_requests']} | {r['peak_100ms_in_throttled_window']} "
            f"| {r['late_requests_in_throttled_window']} | {cell([r], 'first_success_after_recovery_ms', '{:,.0f} ms')} |"
        )
    return "\n".join(lines)


def module_digest(module: Path = WASM_MODULE) -> str:
    try:
        return hashlib.sha256(module.read_bytes()).hexdigest()[:16]
    except OSError:
        return ""


def run_batch(key: str, batch: list, rep: int, args, sim: Simulator, backup, artifact=None) -> list:
    """The storms of `batch`, one after the other, through one freshly started gateway `key`
    (llm-governor of `artifact` where it has one)."""
    gateway = gateways.make_gateway(key, sim, args.concurrency, backup=backup, artifact=artifact)
    shown = f"{key}, {gateway.artifact}" if gateway.artifact else key
    try:
        gateway.start()
    except gateways.GatewayUnavailable as err:
        reason = str(err).splitlines()[0]
        print(f"({shown}) {gateway.name}: not run: {reason}", flush=True)
        return [{"scenario": s.name, "title": s.title, "config": key, "config_name": gateway.name,
                 "artifact": gateway.artifact, "repeat": rep, "unavailable": reason} for s in batch]
    out = []
    try:
        for storm in batch:
            t = time.time()
            r = run_storm(storm, gateway, sim, backup)
            r["repeat"] = rep
            r["artifact"] = gateway.artifact
            out.append(r)
            split = ""
            if "backup_requests" in r:
                split = (f" [primary {r['primary_requests']} req, {r['primary_429s']} 429s, {r['primary_late_429s']} "
                         f"after its first wave of {r['primary_first_wave']}; backup {r['backup_requests']} req, "
                         f"{r['backup_429s']} 429s, {r['backup_late_429s']} after its first wave of "
                         f"{r['backup_first_wave']}; {r['backup_ok']} served by backup]")
            if "served_in_run" in r:
                print(f"[{rep + 1}/{args.repeat}] ({shown}) {storm.name}: {r['completed']} of {r['calls']} calls "
                      f"completed, {r['served_in_run']} served in the run of {r['provider_admits']} the provider "
                      f"admits, {r['provider_429s']} provider 429s ({r['input_429s']} input, {r['output_429s']} "
                      f"output), {r['client_local_429s']} local 429s, p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                      f"input prediction p50 error {r['input_error_p50_pct']} % [{time.time() - t:.1f}s]", flush=True)
                continue
            if "of_cap" in r:
                print(f"[{rep + 1}/{args.repeat}] ({shown}) {storm.name}: {r['completed']}/{r['calls']} completed, "
                      f"{r['per_call']:.2f} req/call, provider max in flight {r['provider_max_in_flight']}, "
                      f"{r['concurrency_429s']} concurrency 429s, {r['served_per_s']}/s served "
                      f"({r['of_cap']:.0%} of what the cap lets through), p99 {r['p99_ms']} ms "
                      f"[{time.time() - t:.1f}s]", flush=True)
                continue
            if "tenants" in r:
                each = ", ".join(f"{n}: {t['completed']}/{t['calls']} done, p50 {t['p50_wait_ms']} ms, p95 "
                                 f"{t['p95_wait_ms']} ms, {t['local_429s']} local 429s"
                                 for n, t in r["tenants"].items())
                print(f"[{rep + 1}/{args.repeat}] ({shown}) {storm.name}: {each}; provider {r['admitted_per_s']}/s "
                      f"({r['pace_used']:.0%} of its pace), {r['provider_429s_after_1s']} 429s after 1 s "
                      f"[{time.time() - t:.1f}s]", flush=True)
                continue
            if "token_429s" in r:
                print(f"[{rep + 1}/{args.repeat}] ({shown}) {storm.name}: {r['completed']} of {r['calls']} calls "
                      f"completed, {r['upstream_requests']} provider requests, {r['token_429s']} token 429s "
                      f"({r['token_429s_after_60s']} at t >= 60 s), {r['client_local_429s']} local 429s, held "
                      f"{r['held']}, overshoot {r['overshoot_tokens']} tokens ({r['overshoot_requests']} requests) "
                      f"[{time.time() - t:.1f}s]", flush=True)
                continue
            print(f"[{rep + 1}/{args.repeat}] ({shown}) {storm.name}: {r['completed']}/{r['calls']} completed, "
                  f"{r['per_call']:.2f} req/call, {r['provider_429s']} provider 429s ({r['late_429s']} after "
                  f"the first wave of {r['first_wave']}), {r['client_429s']} seen by clients, "
                  f"p99 {r['p99_ms']} ms{split} [{time.time() - t:.1f}s]", flush=True)
    finally:
        gateway.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="issue3,issue5,overnight,replay")
    ap.add_argument("--configs", default="abcdefg", help="configuration letters (e also selects e-cap, e-fo and the e-tpm ones)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of everything, gateways restarted each time")
    ap.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (b, c, e, f, g)")
    ap.add_argument("--out", default=str(REPO_ROOT / "bench" / "out" / "storm"))
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds the looping clients of the token storms keep calling (default 150)")
    ap.add_argument("--only", default=None, help="comma-separated configuration keys (e-tpm-default,...): only these")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--artifact", default=os.environ.get("LLM_GOVERNOR_ARTIFACT") or "wasm",
                    help="llm-governor's artifacts, comma-separated: wasm, native or wasm,native (one row each)")
    args = ap.parse_args()
    artifacts = list(dict.fromkeys(a.strip() for a in args.artifact.split(",") if a.strip()))
    if not artifacts or any(a not in ARTIFACTS for a in artifacts):
        ap.error(f"--artifact {args.artifact!r}: want wasm, native or both, comma-separated")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gitignore = out.parent / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# bench outputs are regenerated, never committed\n*\n")

    storms = [s for name in args.scenarios.split(",") for s in SCENARIOS[name]()]
    if args.duration is not None:
        storms = [dataclasses.replace(s, duration_s=args.duration, run_timeout_s=args.duration + 60,
                                      title=s.title.replace(f"for {s.duration_s:g} s", f"for {args.duration:g} s"))
                  if s.client_kind == "loop" else s for s in storms]
    only = set(args.only.split(",")) if args.only else None
    wanted = {s.name: [k for k in s.configs if k[0] in args.configs and (only is None or k in only)]
              for s in storms}
    keys = list(dict.fromkeys(k for s in storms for k in wanted[s.name]))
    results: list = []
    # Before any Envoy loads them: a rebuild during the run would show here.
    digest = module_digest(WASM_MODULE) if "wasm" in artifacts else ""
    native_digest = module_digest(NATIVE_MODULE) if "native" in artifacts else ""
    started = time.time()
    sim = Simulator().start()
    # The second provider of the failover storms, only when one is run.
    backup = Simulator().start() if any(s.backup_phases is not None for s in storms) else None
    try:
        for rep in range(args.repeat):
            for key in keys:
                mine = [s for s in storms if key in wanted[s.name]]
                # A storm with fresh_gateway gets a gateway of its own; the others share one.
                shared = [s for s in mine if not s.fresh_gateway]
                batches = ([shared] if shared else []) + [[s] for s in mine if s.fresh_gateway]
                # llm-governor's configurations once per artifact, one after the other.
                for artifact in (artifacts if gateways.governed(key) else [None]):
                    for batch in batches:
                        results += run_batch(key, batch, rep, args, sim, backup, artifact)
    finally:
        sim.cleanup()
        if backup is not None:
            backup.cleanup()

    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
            "argv": sys.argv[1:], "envoy_concurrency": args.concurrency, "litellm": gateways.litellm_version(),
            "artifacts": artifacts,
            "wasm_module": str(WASM_MODULE) if digest else "", "wasm_module_sha256": digest,
            "native_module": str(NATIVE_MODULE) if native_digest else "", "native_module_sha256": native_digest,
            "first_wave_gap_ms": analysis.FIRST_WAVE_GAP_MS}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))

    by_scenario: dict = {}
    for r in results:
        by_scenario.setdefault(r["scenario"], []).append(r)
    order = {s.name: s.configs for s in storms}
    print()
    for name, rows in by_scenario.items():
        if not name.startswith("replay"):
            print(f"### {rows[0]['title']}\n\n{storm_table(rows, order[name])}\n")
    replays = [r for name, rows in by_scenario.items() if name.startswith("replay") for r in rows]
    if replays:
        print("### replay: 120 clients, provider 429 until 2,000 ms (hint 2 s), 4 attempts, 2,500 ms budget\n")
        print(replay_table(replays) + "\n")
    if not args.no_plot:
        import plot

        for name, rows in by_scenario.items():
            path = plot.timeline([r for r in rows if r.get("repeat", 0) == 0], out / f"{name}.png")
            if path:
                print(f"plot: {path}")
    modules = ", ".join(f"{a} {meta[a + '_module_sha256']}" for a in artifacts)
    print(f"results: {out / 'results.json'} ({meta['seconds']} s, modules: {modules})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
