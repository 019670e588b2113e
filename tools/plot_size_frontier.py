"""Plot bytes against perplexity change from ``tools/bench_size_frontier.py`` results.

    python tools/plot_size_frontier.py tools/results/size_frontier_*.json --output tools/results/size_frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in args.results]
    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.2), squeeze=False)
    styles = {"plain": ("llama.cpp preset", "o", "tab:gray"), "imatrix": ("preset + llama-imatrix", "s", "tab:blue"),
              "ours": ("compressor output.size", "*", "tab:red")}
    for ax, run in zip(axes[0], runs):
        groups: dict[str, list] = {k: [] for k in styles}
        for r in run["rows"]:
            if r["file"] == "F16":
                continue
            kind = "ours" if r["file"].startswith("compressor-") else "imatrix" if r["file"].endswith("-imatrix") else "plain"
            groups[kind].append((r["bytes"] / 1e6, 100 * r["change_vs_f16"], r["file"].replace("compressor-", "")))
        for kind, pts in groups.items():
            if not pts:
                continue
            label, marker, color = styles[kind]
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=label,
                    markersize=11 if kind == "ours" else 7)
            if kind == "plain":
                for x, y, name in pts:
                    ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(f"{run['model']}: WikiText-2 test, llama.cpp")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("perplexity vs F16 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
