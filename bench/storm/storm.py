"""`make storm`: the 429 storm through five configurations, side by side in one run.

    .venv/bin/python bench/storm/storm.py [--scenarios issue3,issue5,replay] [--configs abcdef]

Configurations: (a) no gateway, (b) Envoy retrying 429 x3, (c) Envoy with
rate_limited_retry_back_off, (d) LiteLLM's proxy with num_retries: 3, (e) Envoy + llm-governor
(one pool for /v1/chat, defaults). Scenarios and the definitions of every figure: storm_core.py
and BENCHMARKS.md (## Storm, ## Replay). Writes bench/out/storm/results.json and one timeline PNG
per scenario, and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import storm_core as core  # noqa: E402

PUBLISHED = {  # the published replay's table (shared/seeds/002): requests, completed, rate, peak
    "immediate": (480, 0, 0.0, 480),
    "exponential": (480, 0, 0.0, 120),
    "jittered": (480, 94, 0.783, 120),
}


def fmt(v, unit=""):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.0f}{unit}" if unit == " ms" else f"{v:g}{unit}"
    return f"{v}{unit}"


def storm_table(rows: list) -> str:
    head = ("| config | upstream req / call | provider 429s | 429s after first wave | max late 429s in a cooldown round "
            "| completed | p50 / p99 to completion | first success after recovery |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "unavailable" in r:
            lines.append(f"| ({r['config']}) {r['config_name']} | not run: {r['unavailable']} | | | | | | |")
            continue
        lines.append(
            f"| ({r['config']}) {r['config_name']} | {r['per_call']:.2f} | {r['provider_429s']} | {r['late_429s']} "
            f"| {r['max_late_429s_per_round']} | {r['completed']}/{r['clients']} "
            f"| {fmt(r['p50_ms'], ' ms')} / {fmt(r['p99_ms'], ' ms')} "
            f"| {fmt(r.get('first_success_after_recovery_ms'), ' ms')} |"
        )
    return "\n".join(lines)


def replay_table(rows: list) -> str:
    lines = [
        "| schedule | config | completed | upstream requests | peak / 100 ms in throttled window "
        "| throttled-window requests after first wave | first success after recovery |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, (req, done, rate, peak) in PUBLISHED.items():
        off = core.published_replay(name)
        lines.append(
            f"| published: {name} | offline model | {rate:.1%} ({done}/120; re-run here: {off['completion_rate']:.1%}) "
            f"| {req} (re-run: {off['requests']}) | {peak} (re-run: {off['peak_100ms_in_throttled_window']}) | – | – |"
        )
    for r in rows:
        kind = "Strategy C fixed" if "-fixed-" in r["scenario"] else "obey retry-after-ms"
        style = r["scenario"].rsplit("-", 1)[1]
        if "unavailable" in r:
            lines.append(f"| {kind} (hint in {style}) | ({r['config']}) {r['config_name']} | not run: {r['unavailable']} | | | | |")
            continue
        lines.append(
            f"| {kind} (hint in {style}) | ({r['config']}) {r['config_name']} | {r['completion_rate']:.1%} "
            f"| {r['upstream_requests']} | {r['peak_100ms_in_throttled_window']} "
            f"| {r['late_requests_in_throttled_window']} | {fmt(r.get('first_success_after_recovery_ms'), ' ms')} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default="issue3,issue5,replay")
    ap.add_argument("--configs", default="abcdef")
    ap.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads (b, c, e)")
    ap.add_argument("--out", default=str(core.REPO_ROOT / "bench" / "out" / "storm"))
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gitignore = out.parent / ".gitignore"
    if not gitignore.exists():
        gitignore.write_text("# bench outputs are regenerated, never committed\n*\n")

    storms = [s for name in args.scenarios.split(",") for s in core.SCENARIOS[name]()]
    results: list = []
    started = time.time()
    sim = core.Simulator().start()
    try:
        for key in args.configs:
            gateway = core.make_gateway(key, sim, args.concurrency)
            try:
                gateway.start()
            except (core.LiteLLMUnavailable, core.HarnessError) as err:
                reason = str(err).splitlines()[0]
                print(f"({key}) {gateway.name}: not run: {reason}", flush=True)
                results += [{"scenario": s.name, "title": s.title, "config": key, "config_name": gateway.name,
                             "unavailable": reason} for s in storms]
                continue
            try:
                for storm in storms:
                    t = time.time()
                    r = core.run_storm(storm, gateway, sim)
                    results.append(r)
                    print(f"({key}) {storm.name}: {r['per_call']:.2f} req/call, {r['provider_429s']} 429s "
                          f"({r['late_429s']} late), {r['completed']}/{r['clients']} completed "
                          f"[{time.time() - t:.1f}s]", flush=True)
            finally:
                gateway.stop()
    finally:
        sim.stop()

    meta = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": round(time.time() - started, 1),
            "envoy_concurrency": args.concurrency, "litellm": core.litellm_version(),
            "first_wave_ms": core.FIRST_WAVE_MS}
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))

    by_scenario: dict = {}
    for r in results:
        by_scenario.setdefault(r["scenario"], []).append(r)
    print()
    for name, rows in by_scenario.items():
        if name.startswith("replay"):
            continue
        print(f"### {rows[0]['title']}\n")
        print(storm_table(rows) + "\n")
    replays = [r for name, rows in by_scenario.items() if name.startswith("replay") for r in rows]
    if replays:
        print("### replay: 120 clients, provider 429 until 2,000 ms (hint 2 s), 4 attempts, 2,500 ms budget\n")
        print(replay_table(replays) + "\n")
    if not args.no_plot:
        import plot

        for name, rows in by_scenario.items():
            path = plot.timeline(rows, out / f"{name}.png")
            if path:
                print(f"plot: {path}")
    print(f"results: {out / 'results.json'} ({meta['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
