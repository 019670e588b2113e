#!/usr/bin/env python
"""The frontier's best points and plot, from a ``bench_frontier.py`` result; run alone, prints / redraws them.

For each calibration size and series: the most FFN parameters removed within
+5 % and +20 % perplexity on WikiText-2 test; the plot is perplexity change
against FFN parameters removed, one panel per calibration size.

    python tools/structural/bench_frontier_report.py     # best points of tools/structural/results/bench_frontier.json
    python tools/structural/bench_frontier_report.py other.json --png /tmp/frontier.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def best_points(run: dict) -> dict:
    """Per series: the largest share of FFN parameters removed within +5 % and +20 % perplexity."""
    res = {}
    for name, pts in run["series"].items():
        for lim in (0.05, 0.20):
            ok = [p for p in pts if p["rel_ppl"] <= lim]
            res.setdefault(name, {})[f"+{int(lim * 100)}%"] = max((p["ffn_removed"] for p in ok), default=0.0)
    return res


def summary(out: dict) -> dict:
    """The baseline perplexity and, per calibration size, each series' best points."""
    return {"baseline_ppl": out["baseline_ppl"],
            "runs": [{"cal_tokens": r["cal_tokens"], "best": best_points(r)} for r in out["runs"]]}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = out["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4.5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        for name, pts in sorted(run["series"].items()):
            pts = sorted(pts, key=lambda p: p["ffn_removed"])
            ax.plot([100 * p["ffn_removed"] for p in pts], [100 * p["rel_ppl"] for p in pts], marker="o", ms=3, label=name)
        ax.axhline(5, color="grey", ls="--", lw=0.8)
        ax.axhline(20, color="grey", ls=":", lw=0.8)
        ax.set_ylim(-1, 60)
        ax.set_xlabel("FFN parameters removed (%)")
        ax.set_ylabel("perplexity change on WikiText-2 test (%)")
        ax.set_title(f"SmolLM2-135M, {run['cal_tokens']:,} calibration tokens")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", type=Path, default=RESULTS_DIR / "bench_frontier.json",
                    help="a bench_frontier.py result (default %(default)s)")
    ap.add_argument("--png", type=Path, default=None, help="also draw the plot here")
    args = ap.parse_args(argv)
    out = json.loads(args.result.read_text(encoding="utf-8"))
    if args.png:
        plot(out, args.png)
    print(json.dumps(summary(out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
