"""Timeline of one storm scenario: upstream requests/s and provider 429s/s per configuration."""

from __future__ import annotations

from pathlib import Path

BIN_MS = 100


def timeline(rows: list, path: Path, bin_ms: int = BIN_MS):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "upstream" in r]
    if not rows:
        return None
    end_ms = max((t for r in rows for t, _ in r["upstream"]), default=1000) + bin_ms
    nbins = int(end_ms // bin_ms) + 1
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.55 * len(rows) + 0.9), sharex=True, squeeze=False)
    scale = 1000 / bin_ms
    peak = 1.0
    series = []
    for r in rows:
        total = [0] * nbins
        rejected = [0] * nbins
        for t, status in r["upstream"]:
            b = max(0, int(t // bin_ms))
            total[b] += 1
            if status == 429:
                rejected[b] += 1
        series.append((total, rejected))
        peak = max(peak, max(total) * scale)
    xs = [i * bin_ms / 1000 for i in range(nbins)]
    for ax, r, (total, rejected) in zip(axes[:, 0], rows, series):
        ax.fill_between(xs, [v * scale for v in total], step="post", color="#4c72b0", alpha=0.55, label="upstream req/s")
        ax.fill_between(xs, [v * scale for v in rejected], step="post", color="#c44e52", alpha=0.8, label="429/s")
        ax.set_yscale("symlog", linthresh=10)
        ax.set_ylim(0, peak * 1.3)
        artifact = f", {r['artifact']}" if r.get("artifact") else ""
        label = (f"({r['config']}{artifact}) {r['config_name']}\n{r['per_call']:.2f} req/call, "
                 f"{r['completed']}/{r['calls']} done")
        ax.text(0.995, 0.93, label, transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        ax.tick_params(labelsize=7)
        ax.grid(axis="x", alpha=0.3)
    axes[0, 0].legend(loc="upper left", fontsize=7, ncol=2)
    axes[-1, 0].set_xlabel(f"seconds since the clients started ({bin_ms} ms bins, per-second rates, symlog)", fontsize=8)
    fig.suptitle(rows[0]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
