"""The report's figures, one function per part, each drawn from ``analysis.json``'s dict alone.

Small PNGs (100 dpi): they go into docs. matplotlib is imported when drawing.
"""

from __future__ import annotations

from pathlib import Path

DPI = 100


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _v(x):
    return float("nan") if x is None else x


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)
    return path


def regimes(a: dict, path: Path) -> Path:
    """The paper's Figure 4: global R²_lin vs per-feature median R², point size ∝ explained effective rank."""
    plt = _plt()
    blocks = a["profile"]
    fig, ax = plt.subplots(figsize=(5.6, 4.4))
    ranks = [_v(b["explained_effective_rank"]) for b in blocks]
    top = max([r for r in ranks if r == r] or [1.0])
    for b, r in zip(blocks, ranks):
        flagged = b["outlier_dominated"]
        ax.scatter(_v(b["r2_lin"]), _v(b["r2_median_feature"]), s=20 + 280 * (r / top if r == r else 0),
                   c="#d62728" if flagged else "#1f77b4", alpha=0.6, edgecolors="k", linewidths=0.4,
                   marker="^" if flagged else "o")
        ax.annotate(str(b["index"]), (_v(b["r2_lin"]), _v(b["r2_median_feature"])), fontsize=6, ha="center",
                    va="center")
    lo = min([_v(b["r2_lin"]) for b in blocks] + [_v(b["r2_median_feature"]) for b in blocks] + [0.0])
    ax.plot([lo, 1], [lo, 1], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("global R²_lin (pooled over output features)")
    ax.set_ylabel("per-feature median R²")
    ax.set_title("Two regimes: size ∝ explained effective rank; red ▲ outlier-dominated", fontsize=8)
    return _save(fig, path)


def probe(a: dict, path: Path) -> Path:
    plt = _plt()
    rows = a["probe"]["blocks"]
    idx = [r["index"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    ax.plot(idx, [_v(r["r2_lin"]) for r in rows], "o-", ms=3, label="R²_lin (affine)")
    label = f"R²_poly (+{rows[0]['extra_features']} products)"
    ax.plot(idx, [_v(r["r2_poly"]) for r in rows], "s-", ms=3, label=label)
    ax.set_xlabel("block")
    ax.set_ylabel("held-out R²")
    ax.legend(fontsize=7)
    x = [1 - _v(r["r2_lin"]) for r in rows]
    g = [_v(r["gain"]) for r in rows]
    ax2.scatter(x, g, s=14)
    for i, xi, gi in zip(idx, x, g):
        ax2.annotate(str(i), (xi, gi), fontsize=6, xytext=(2, 2), textcoords="offset points")
    c = a["probe"]["correlation"]
    ax2.set_xlabel("1 − R²_lin")
    ax2.set_ylabel("R²_poly − R²_lin")
    ax2.set_title(f"Pearson {_r(c, 'pearson')}, Spearman {_r(c, 'spearman')}", fontsize=8)
    return _save(fig, path)


def _r(c: dict, name: str) -> str:
    e = c[name]
    return "n/a" if e["r"] is None else f"{e['r']:+.2f}"


def trained(a: dict, path: Path) -> Path:
    plt = _plt()
    rows = a["trained"]["blocks"]
    idx = [r["index"] for r in rows]
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(13, 3.6))
    ax.plot(idx, [_v(r["r2_closed_form"]) for r in rows], "k-o", ms=3, label="closed form (ceiling)")
    steps = a["trained"]["steps"]
    for name, style in (("adam", "s--"), ("gd", "^:")):
        ax.plot(idx, [_v(r[name]["r2"]) for r in rows], style, ms=3, label=f"{name}, {steps} steps")
    ax.set_xlabel("block")
    ax.set_ylabel("held-out R²")
    ax.set_ylim(max(-1.0, ax.get_ylim()[0]), 1.02)
    ax.legend(fontsize=7)
    for name, m in (("adam", "s"), ("gd", "^")):
        ax2.scatter([_v(r["input_condition_number"]) for r in rows], [_v(r[name]["gap"]) for r in rows], marker=m,
                    s=14, label=name)
    ax2.set_xscale("log")
    ax2.set_xlabel("condition number of the input covariance")
    ax2.set_ylabel("ceiling − trained R²")
    ax2.legend(fontsize=7)
    for name, m in (("adam", "s"), ("gd", "^")):
        ax3.scatter([_v(r["r2_closed_form"]) for r in rows], [_v(r[name]["gap"]) for r in rows], marker=m, s=14,
                    label=name)
    ax3.set_xlabel("closed-form R² (the ceiling)")
    ax3.set_ylabel("ceiling − trained R²")
    ax3.legend(fontsize=7)
    return _save(fig, path)


def corpora(a: dict, path: Path) -> Path:
    plt = _plt()
    c = a["corpora"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for name, d in c["domains"].items():
        ax.plot(c["blocks"], [_v(v) for v in d["r2_lin"]], "o-", ms=3, label=f"{name} ({d['fit_rows']} fit rows)")
    ax.set_xlabel("block")
    ax.set_ylabel("held-out R²_lin")
    ax.set_title("R²_lin profile per domain", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, path)


def crossfeed(a: dict, path: Path) -> Path:
    import numpy as np

    plt = _plt()
    c = a["crossfeed"]
    M = np.array([[_v(v) for v in row] for row in c["matrix"]])
    fig, ax = plt.subplots(figsize=(1.2 + 0.55 * len(c["blocks"]), 0.9 + 0.5 * len(c["blocks"])))
    im = ax.imshow(M, cmap="viridis", vmin=min(0.0, np.nanmin(M)), vmax=1.0)
    for r in range(M.shape[0]):
        for k in range(M.shape[1]):
            ax.text(k, r, f"{M[r, k]:.2f}", ha="center", va="center", fontsize=6,
                    color="white" if M[r, k] < 0.6 else "black")
    ax.set_xticks(range(len(c["blocks"])), c["blocks"], fontsize=7)
    ax.set_yticks(range(len(c["blocks"])), c["blocks"], fontsize=7)
    ax.set_xlabel("inputs of block i (residual stream before its FFN)", fontsize=8)
    ax.set_ylabel("FFN of block j", fontsize=8)
    ax.set_title("R²_lin(j | inputs of i)", fontsize=8)
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def control(a: dict, path: Path) -> Path:
    plt = _plt()
    c = a["control"]
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.plot(c["blocks"], [_v(v) for v in c["trained_r2_lin"]], "o-", ms=3, label="trained weights")
    ax.plot(c["blocks"], [_v(v) for v in c["random_r2_lin"]], "s--", ms=3, label=f"random weights (seed {c['seed']})")
    ax.set_xlabel("block")
    ax.set_ylabel("held-out R²_lin")
    ax.set_title(f"Same architecture, same {c['fit_rows']} fit rows: trained vs untrained", fontsize=8)
    ax.legend(fontsize=7)
    return _save(fig, path)


#: part → (figure function, file name)
FIGURES = {
    "regimes": (regimes, "regimes.png"), "probe": (probe, "probe.png"), "trained": (trained, "trained.png"),
    "corpora": (corpora, "corpora.png"), "crossfeed": (crossfeed, "crossfeed.png"), "control": (control, "control.png"),
}


def draw_all(a: dict, out_dir: Path) -> dict[str, Path]:
    """Every figure whose part is in the analysis."""
    paths = {}
    for part, (fn, name) in FIGURES.items():
        if part == "regimes" or a.get(part):
            paths[part] = fn(a, Path(out_dir) / name)
    return paths
