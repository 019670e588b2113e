"""Plot bytes against perplexity change from ``tools/size/bench_size_frontier.py`` results.

    python tools/size/plot_size_frontier.py tools/size/results/size_frontier_*.json \
        --output tools/size/results/size_frontier.png

With ``--kld``: one run, bytes against KL divergence from the F16 (log scale), one panel per domain scored (the
evaluation text and ``--code-text``): every llama.cpp preset a point, compressor a line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--output", required=True)
    ap.add_argument("--kld", action="store_true", help="bytes against KL divergence, a panel per domain (one run)")
    args = ap.parse_args()
    if args.kld:
        return plot_kld(json.loads(Path(args.results[0]).read_text()), args.output)
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


def plot_kld(run: dict, output: str) -> None:
    """Bytes against mean KLD per domain: presets with an importance matrix (squares), plain (circles), compressor
    at each planned size (a line of stars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = [("text", run.get("eval_text", "evaluation text"))]
    if any(r.get("code", {}).get("kld") for r in run["rows"]):
        domains.append(("code", "Python stdlib (code)"))
    fig, axes = plt.subplots(1, len(domains), figsize=(6.2 * len(domains), 4.6), squeeze=False)
    for ax, (domain, title) in zip(axes[0], domains):
        pts = {"ours": [], "imatrix": [], "plain": []}
        for r in run["rows"]:
            src = r if domain == "text" else r.get("code", {})
            k = (src.get("kld") or {}).get("mean")
            if r["file"] == "F16" or k is None:
                continue
            kind = "ours" if r["file"].startswith("compressor-") else "imatrix" if r["file"].endswith("-imatrix") \
                else "plain"
            if r["file"].startswith("compressor-") and r["file"].count("-") > 1:
                continue  # other roundings: not the line
            name = r["file"].replace("compressor-", "").removesuffix("-imatrix")
            pts[kind].append((r["bytes"] / 1e6, k, name))
        for kind, marker, color, label in (("plain", "o", "tab:gray", "llama.cpp preset"),
                                            ("imatrix", "s", "tab:blue", "preset + llama-imatrix"),
                                            ("ours", "*", "tab:red", "compressor output.size")):
            if not pts[kind]:
                continue
            p = sorted(pts[kind])
            ax.plot([x for x, _, _ in p], [y for _, y, _ in p], marker=marker, color=color, label=label,
                    linestyle="-" if kind == "ours" else "none", markersize=11 if kind == "ours" else 7)
            if kind == "imatrix":
                for x, y, name in p:
                    ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{run['model']}: {title}, llama.cpp")
        ax.set_xlabel("file size (MB)")
        ax.set_ylabel("KL divergence from the F16 (mean, nats)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(output)


if __name__ == "__main__":
    main()
