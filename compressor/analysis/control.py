"""Part 4b: the untrained control — the same architecture with random weights, on the same text.

Built from the model's config (the library's own initialisation, seeded) and
profiled on exactly the fit and held-out rows of the trained model's
``--data`` subset (:class:`compressor.analysis.corpora.SubsetPart`), so the two
profiles differ only in the weights. If the trained model's blocks differ from
each other and the random ones do not, the heterogeneity was learned.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from compressor.analysis.correlation import spearman


def random_model(config, device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """A freshly initialised model of ``config``'s architecture (float32, eval mode); the global RNG is left as it
    was."""
    from transformers import AutoModel, AutoModelForCausalLM

    from compressor.core.archs import ARCHITECTURES

    spec = ARCHITECTURES.get(config.model_type)
    auto = AutoModel if spec is not None and not spec.causal_lm else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = auto.from_config(config, dtype=torch.float32)
    return fresh.to(device).eval()


def summarize(trained: list[float], random: list[float]) -> dict:
    t = np.array([np.nan if v is None else v for v in trained], dtype=float)
    r = np.array([np.nan if v is None else v for v in random], dtype=float)
    depth = list(range(len(t)))
    return {
        "trained_mean": float(np.nanmean(t)), "trained_std": float(np.nanstd(t)),
        "trained_range": [float(np.nanmin(t)), float(np.nanmax(t))],
        "random_mean": float(np.nanmean(r)), "random_std": float(np.nanstd(r)),
        "random_range": [float(np.nanmin(r)), float(np.nanmax(r))],
        "spearman_trained_vs_random": spearman(trained, random),
        "spearman_random_vs_depth": spearman(random, depth), "spearman_trained_vs_depth": spearman(trained, depth),
    }


def reading(s: dict) -> str:
    """Plain-words reading of trained vs random weights, from the numbers: level first, then shape."""
    rho, rd = s["spearman_trained_vs_random"], s["spearman_random_vs_depth"]
    text = (f"With random weights the blocks score R²_lin {s['random_range'][0]:.3f} to {s['random_range'][1]:.3f} "
            f"(mean {s['random_mean']:.3f}, σ {s['random_std']:.3f}); trained, on the same rows, "
            f"{s['trained_range'][0]:.3f} to {s['trained_range'][1]:.3f} (mean {s['trained_mean']:.3f}, "
            f"σ {s['trained_std']:.3f}). ")
    if s["random_range"][1] < s["trained_range"][0]:
        text += "Every trained block is more linear than every random-weight block: the linearity was learned. "
    elif s["random_mean"] < s["trained_mean"] - 0.1:
        text += (
            f"On average training made the blocks more linear (by {s['trained_mean'] - s['random_mean']:.2f} in R²). "
        )
    elif s["random_mean"] > s["trained_mean"] + 0.1:
        text += (
            f"Random-weight blocks are more linear than trained ones (by {s['random_mean'] - s['trained_mean']:.2f} "
            "in R²): training made the FFNs less linear. "
        )
    else:
        text += "The average level is about the same with random and trained weights. "
    if rho is None:
        return text
    if abs(rho) < 0.5:
        text += (
            f"The random profile does not predict which trained blocks are linear (Spearman {rho:+.2f}"
            + (
                f"; it is mostly a trend in depth, Spearman with block index {rd:+.2f}"
                if rd is not None and abs(rd) >= 0.7
                else ""
            )
            + "): the shape of the trained profile is learned, not set by the architecture."
        )
    else:
        text += (f"The random profile already ranks the blocks like the trained one (Spearman {rho:+.2f}): part of the "
                 "shape comes from the architecture and depth, not from learning.")
    return text


def run_control(config, device, cal, trained_r2: list[float], *, seed: int, batch_size: int,
                compute_dtype: torch.dtype) -> dict:
    """Profile a random-weight model of ``config`` on ``cal`` (the rows ``trained_r2`` was measured on)."""
    from compressor.analysis.corpora import profile_windows

    rand = random_model(config, device, seed=seed)
    profs = profile_windows(rand, cal, batch_size=batch_size, compute_dtype=compute_dtype, desc="random-weight control")
    del rand
    out = {"seed": seed, "blocks": [p.index for p in profs], "fit_rows": int(cal.fit.numel()),
           "heldout_rows": int(cal.heldout.numel()), "trained_r2_lin": list(trained_r2),
           "random_r2_lin": [p.r2_lin for p in profs], "random_r2_median_feature": [p.r2_median_feature for p in profs]}
    out.update(summarize(out["trained_r2_lin"], out["random_r2_lin"]))
    return out
