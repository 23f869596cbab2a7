#!/usr/bin/env python3
"""docs/img/dashboard.png: the main panels of deploy/grafana/llm-governor.json, drawn from the
data their queries returned in test_dashboard.py's storm (a real Envoy, scraped by a real
Prometheus). Grafana cannot be installed here, so matplotlib draws what Grafana would.

    .venv/bin/python -m pip install matplotlib   # once; not a test dependency
    .venv/bin/python scripts/render-dashboard.py [--data storm.json] [--out docs/img/dashboard.png]

Without --data it runs the test (`make build sim envoy venv` first) with
LLM_GOVERNOR_DASHBOARD_DATA set, then draws.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAIN_PANELS = [
    "Provider 429s by class and pool",
    "Local answers by reason",
    "Held requests",
    "Hold wait",
    "In flight vs cap",
    "Requests: remaining vs limit",
    "Cooldowns started and requests answered while cooling",
    "Failovers",
]
UNITS = {"reqps": "per second", "ms": "ms", "short": "", "percentunit": "fraction"}


def storm_data() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "storm.json"
        env = {**os.environ, "LLM_GOVERNOR_DASHBOARD_DATA": str(out)}
        subprocess.run(
            [sys.executable, "-m", "pytest", "integration/e2e/test_dashboard.py", "-q", "-p", "no:cacheprovider",
             "-k", "parses_and_returns_data"],
            cwd=REPO_ROOT, env=env, check=True,
        )
        return json.loads(out.read_text())


def legend(template: str, metric: dict) -> str:
    out = template
    for key, value in metric.items():
        out = out.replace("{{" + key + "}}", value)
    return out or ", ".join(f"{k}={v}" for k, v in metric.items() if k != "__name__")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, help="storm data written by test_dashboard.py")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: matplotlib missing: .venv/bin/python -m pip install matplotlib", file=sys.stderr)
        return 1
    data = json.loads(args.data.read_text()) if args.data else storm_data()
    dash = json.loads((REPO_ROOT / "deploy" / "grafana" / "llm-governor.json").read_text())
    units = {p["title"]: p["fieldConfig"]["defaults"].get("unit", "") for p in dash["panels"] if "fieldConfig" in p}
    start = data["start"]

    fig, axes = plt.subplots(4, 2, figsize=(13, 12), sharex=True)
    for ax, title in zip(axes.flat, MAIN_PANELS):
        for query in data["panels"][title]:
            for series in query["result"]:
                metric = series["metric"]
                if metric.get("llm_pool") == "default":
                    continue  # no request matched no pool in the storm: flat zero lines
                points = [(float(t) - start, float(v)) for t, v in series["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if not points or max(v for _, v in points) == 0:
                    continue
                xs, ys = zip(*points)
                ax.plot(xs, ys, label=legend(query["legend"], metric), linewidth=1.4)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(UNITS.get(units.get(title, ""), ""), fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("seconds into the storm", fontsize=8)
    fig.suptitle("llm-governor dashboard, main panels: a 17 s storm through Envoy 1.40, scraped by Prometheus every 1 s",
                 fontsize=11)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
