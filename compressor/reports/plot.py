"""The per-block linearity figure of a profile (matplotlib, written as a PNG)."""

from __future__ import annotations

from pathlib import Path

from compressor.engine.profiling import Profile

BULK_FLOOR = -0.5  # bulk R² below this is drawn at the floor, with its value written next to it


def profile_figure(profile: Profile, threshold: float | None = None):
    """The per-block figure: R² panel (R²_lin bars, bulk R² dots, the candidate
    threshold) above an outlier-share panel (0–1, with the flag level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if threshold is None:
        from compressor.recipe.schema import PolicyConfig

        threshold = PolicyConfig.model_fields["threshold"].default
    flag = profile.settings.get("outlier_share_flag", 0.5)
    blocks = profile.blocks
    idx = [b.index for b in blocks]

    def val(v):
        return v if v is not None and v == v else 0.0

    fig, (ax, ax2) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(max(6, 0.28 * len(idx) + 2) + 2, 5.5),
        dpi=120,
        gridspec_kw={"height_ratios": [3, 1.3]},
    )
    colors = ["#d62728" if b.outlier_dominated else "#1f77b4" for b in blocks]
    ax.bar(idx, [max(val(b.r2_lin), BULK_FLOOR) for b in blocks], color=colors, label="R²_lin (held-out)")
    bulk = [val(b.r2_bulk) for b in blocks]
    ax.plot(idx, [max(v, BULK_FLOOR) for v in bulk], "k.", label="bulk R² (no sink/spike rows)")
    clipped = [(i, v) for i, v in zip(idx, bulk) if v < BULK_FLOOR]
    if clipped:
        ax.plot(
            [i for i, _ in clipped],
            [BULK_FLOOR] * len(clipped),
            "kv",
            ms=5,
            label=f"bulk R² < {BULK_FLOOR} (value shown)",
        )
        for i, v in clipped:
            ax.annotate(f"{v:.3g}", (i, BULK_FLOOR), xytext=(0, 6), textcoords="offset points", ha="center",
                        fontsize=6, rotation=90, va="bottom")
    ax.axhline(threshold, color="#2ca02c", ls="--", lw=1, label=f"threshold {threshold:g}")
    for b in blocks:
        if b.outlier_dominated:
            ax.annotate("⚠", (b.index, min(1.0, max(val(b.r2_lin), 0)) + 0.02), ha="center", color="#d62728")
    ax.set_ylabel("R²")
    ax.set_ylim(BULK_FLOOR - 0.08, 1.12)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_title(f"{profile.model}: per-block linearity (red = outlier-dominated)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside: no data hidden

    ax2.bar(idx, [val(b.outlier_sst_share) for b in blocks], color=colors)
    ax2.axhline(flag, color="#ff7f0e", ls="--", lw=1, label=f"flag at {flag:g}")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("outlier share\nof SST", fontsize=8)
    ax2.set_xlabel("block")
    ax2.set_xticks(idx)
    ax2.tick_params(axis="x", labelsize=7)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def profile_plot(profile: Profile, path: str | Path, threshold: float | None = None) -> Path:
    """Write :func:`profile_figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = profile_figure(profile, threshold)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
