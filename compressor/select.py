"""Select: which blocks are candidates, in which order, and with which replacement.

Pure functions of the profile and the recipe's policy; the perplexity gate that
decides which candidates survive lives in :mod:`compressor.compress`.
"""

from __future__ import annotations

from .fit import AffineFit, LowRankFit, affine_params, low_rank, rank_for_fraction
from .profiling import BlockProfile
from .recipe import PolicyConfig, ReplacementConfig
from .stats import Moments


def candidates(
    profiles: list[BlockProfile], policy: PolicyConfig, swap_delta: dict[int, float] | None = None
) -> tuple[list[int], dict[int, str]]:
    """Return (ordered candidate indices, reason for every non-candidate)."""
    n = len(profiles)
    bad = [i for i in policy.include + policy.exclude if i >= n]
    if bad:
        raise ValueError(f"policy.include/exclude: blocks {bad} do not exist; the model has {n} blocks (0..{n - 1})")
    reasons: dict[int, str] = {}
    chosen: list[BlockProfile] = []
    for p in profiles:
        if p.index in policy.exclude:
            reasons[p.index] = "excluded by policy.exclude"
        elif p.index in policy.include:
            chosen.append(p)
        elif not p.r2_lin >= policy.threshold:  # also rejects NaN
            reasons[p.index] = f"R²_lin {p.r2_lin:.4f} < threshold {policy.threshold}"
        elif policy.skip_outlier_dominated and p.outlier_dominated:
            reasons[p.index] = (
                f"outlier-dominated: {p.outlier_sst_share:.0%} of held-out variance in {p.outlier_rows} rows "
                f"(bulk R² {p.r2_bulk:.2f}); set policy.skip_outlier_dominated: false to try it anyway"
            )
        else:
            chosen.append(p)
    if policy.order == "r2":
        chosen.sort(key=lambda p: (-p.r2_lin, p.index))
    elif policy.order == "swap_ppl":
        if swap_delta is None:
            raise ValueError("policy.order: swap_ppl needs the single-swap sweep")
        chosen.sort(key=lambda p: (swap_delta.get(p.index, float("inf")), p.index))
    else:
        chosen.sort(key=lambda p: p.index)
    return [p.index for p in chosen], reasons


def make_fit(fit: AffineFit, moments: Moments, cfg: ReplacementConfig, ffn_params: int) -> AffineFit | LowRankFit:
    """The replacement's closed-form fit under the replacement config's rank rule."""
    if cfg.kind == "affine":
        return fit
    max_rank = min(fit.d_in, fit.d_out)
    if cfg.rank is not None:
        rank = min(cfg.rank, max_rank)
    elif cfg.rank_fraction is not None:
        rank = rank_for_fraction(fit, cfg.rank_fraction)
    else:
        budget = cfg.max_params_fraction * ffn_params
        rank = max(r for r in range(1, max_rank + 1) if r == 1 or affine_params(fit.d_in, fit.d_out, r) <= budget)
    return low_rank(fit, moments, rank)


def replacement_params(fit: AffineFit | LowRankFit) -> int:
    if isinstance(fit, LowRankFit):
        return affine_params(fit.A.shape[0], fit.B.shape[1], fit.rank)
    return affine_params(fit.d_in, fit.d_out)
