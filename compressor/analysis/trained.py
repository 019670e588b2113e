"""Part 2: the trained-linear pitfall — the one place the tool trains on purpose, to show why it does not.

Per block, an ``nn.Linear`` initialised at zero is trained on the block's fit
rows for a fixed number of steps with Adam and with plain gradient descent, and
scored on the held-out rows against the closed-form ceiling (R²_lin).

The loss is the mean squared error over *all* fit rows (full batch). Its
gradient, ``(2/d_out)(E[x̃x̃ᵀ] W̃ − E[x̃yᵀ])`` with ``x̃ = [x, 1]``, is a function
of the statistics the engine already keeps, so training needs no stored rows,
is deterministic (no sampling, zero start; the seed plays no part) and its time
is bounded by ``steps`` products of a ``(d+1)×(d+1)`` by ``(d+1)×d_out`` matrix.
Full batch is the optimiser's best case — no gradient noise — so the gap it
leaves is a lower bound on what minibatch training leaves at the same number of
steps. Gradient descent takes the textbook step ``1/L`` (``L`` the largest
eigenvalue of the loss's Hessian): on a quadratic its error along an input
direction of variance λ shrinks by ``(1 − λ/λ_max)`` per step, which is why the
gap follows the input covariance's condition number.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from compressor.core.stats import Moments
from compressor.fitting.solve import score

OPTIMIZERS = ("adam", "gd")


def second_moments(m: Moments) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)``: ``A = E[x̃x̃ᵀ]`` [(d+1)², float64], ``B = E[x̃yᵀ]`` [(d+1), d_out], ``x̃ = [x, 1]``."""
    n = max(m.n, 1)
    d = m.d_in
    A = torch.empty(d + 1, d + 1, dtype=torch.float64)
    A[:d, :d] = m.cxx / n + torch.outer(m.mx, m.mx)
    A[:d, d] = A[d, :d] = m.mx
    A[d, d] = 1.0
    B = torch.empty(d + 1, m.d_out, dtype=torch.float64)
    B[:d] = m.cxy / n + torch.outer(m.mx, m.my)
    B[d] = m.my
    return A, B


def train_linear(fit: Moments, optimizer: str, steps: int, *, adam_lr: float = 1e-3,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Train ``nn.Linear(d_in, d_out)`` from zero on the fit rows' MSE; returns ``(W [d_in, d_out], b, info)`` in
    float64.

    >>> W, b, info = train_linear(stats.fit, "adam", 300)     # doctest: +SKIP
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    A64, B64 = second_moments(fit)
    d, d_out = fit.d_in, fit.d_out
    layer = nn.Linear(d, d_out, dtype=dtype)
    nn.init.zeros_(layer.weight)
    nn.init.zeros_(layer.bias)
    if optimizer == "adam":
        lr = adam_lr
        opt = torch.optim.Adam(layer.parameters(), lr=lr)
    else:
        smooth = 2.0 * float(torch.linalg.eigvalsh(A64)[-1]) / d_out  # Hessian's largest eigenvalue
        lr = 1.0 / smooth
        opt = torch.optim.SGD(layer.parameters(), lr=lr)
    A, B = A64.to(dtype), B64.to(dtype)
    t0 = time.perf_counter()
    for _ in range(steps):
        with torch.no_grad():
            Wt = torch.cat([layer.weight.T, layer.bias[None]])  # [(d+1), d_out]
            G = (A @ Wt - B) * (2.0 / d_out)
            layer.weight.grad = G[:d].T.contiguous()
            layer.bias.grad = G[d].clone()
        opt.step()
    W = layer.weight.detach().T.to(torch.float64)
    b = layer.bias.detach().to(torch.float64)
    return W, b, {"lr": lr, "steps": steps, "seconds": time.perf_counter() - t0}


def trained_block(index: int, fit: Moments, held: Moments, ceiling: float, condition: float | None, *,
                  steps: int, adam_lr: float, closed_form: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict:
    """One block's trained-vs-closed-form result.

    ``closed_form`` (W, b): its largest entry is recorded, because Adam moves a weight by at most about
    ``lr`` per step — ``max|W*, b*| / lr`` is the fewest steps in which Adam can reach the ceiling."""
    out = {"index": index, "r2_closed_form": ceiling, "input_condition_number": condition}
    if closed_form is not None:
        largest = max(float(closed_form[0].abs().max()), float(closed_form[1].abs().max()))
        out["closed_form_max_abs"] = largest
        out["adam_min_steps"] = largest / adam_lr
    for name in OPTIMIZERS:
        W, b, info = train_linear(fit, name, steps, adam_lr=adam_lr)
        r2 = score(held, W, b).r2
        fit_r2 = 1.0 - float(fit.sse(W, b).sum()) / fit.sst() if fit.sst() > 0 else float("nan")
        out[name] = {"r2": r2, "gap": ceiling - r2, "fit_r2": fit_r2, "lr": info["lr"], "seconds": info["seconds"]}
    return out


def lr_rule(optimizer: str, adam_lr: float) -> str:
    return f"Adam, lr {adam_lr:g}, betas (0.9, 0.999)" if optimizer == "adam" else \
        "gradient descent (torch.optim.SGD on the full batch), lr 1/L (L = largest Hessian eigenvalue), no momentum"


def reading(res: dict) -> str:
    """Plain-words reading of the trained-vs-closed-form comparison, from its numbers."""
    from compressor.analysis.correlation import describe, excludes_zero

    rows = res["blocks"]
    if not rows:
        return "No block was trained."
    parts = []
    for name, label in (("adam", "Adam"), ("gd", "gradient descent")):
        gaps = [r[name]["gap"] for r in rows]
        worst = max(rows, key=lambda r: r[name]["gap"])
        parts.append(
            f"{label} stays a median {statistics.median(gaps):.3f} below the closed-form R² (worst "
            f"{worst[name]['gap']:.3f} at block {worst['index']}; {sum(g > 0.05 for g in gaps)} of {len(rows)} "
            "blocks understated by more than 0.05)"
        )
    c = res["correlation"]
    cond, ceil = c["gap_vs_condition"], c["gap_vs_ceiling"]
    text = (f"After {res['steps']} full-batch steps from zero, " + "; ".join(parts) + ". Across blocks the gap ranks "
            f"with the condition number of the input covariance at Spearman {describe(cond['adam'], 'spearman')} "
            f"(Adam) and {describe(cond['gd'], 'spearman')} (gradient descent)")
    if not any(excludes_zero(cond[n], "spearman") and cond[n]["spearman"]["r"] > 0 for n in OPTIMIZERS):
        text += (": the conditioning does not order the shortfall here — the paper's mechanism (ill-conditioned "
                 "inputs) is not what separates the blocks at this budget")
    text += (f"; with the closed-form R² itself at {describe(ceil['adam'], 'spearman')} (Adam) and "
             f"{describe(ceil['gd'], 'spearman')} (gradient descent). ")
    if excludes_zero(ceil["adam"], "spearman") and ceil["adam"]["spearman"]["r"] > 0:
        text += "The more linear a block is, the more a trained layer understates it: training flattens the profile. "
    slow = sum(1 for r in rows if r.get("adam_min_steps", 0) > res["steps"])
    if "adam_min_steps" in rows[0]:
        text += (f"Adam moves a weight by about lr per step, and the exact solution's largest |weight| exceeds "
                 f"steps × lr on {slow} of {len(rows)} blocks. ")
    if max(statistics.median(r[n]["gap"] for r in rows) for n in OPTIMIZERS) > 0.05:
        verdict = ("A trained linear layer would report these blocks as less linear than they are — the pitfall the "
                   "paper warns of; the closed-form ceiling is the number to quote.")
    else:
        verdict = "At this budget both optimisers come close to the closed-form ceiling on most blocks."
    return text + verdict


def summary(blocks: list[dict], *, steps: int, adam_lr: float, seconds: float, reps: int, seed: int) -> dict:
    """The part's ``analysis.json`` entry: per-block results and, per optimiser, the gap's correlation with
    log10 of the input condition number and with the closed-form R² (the ceiling); Adam's gap against log10
    of the closed form's largest weight."""
    from compressor.analysis.correlation import correlate

    def log10(v):
        return math.log10(v) if v else None

    def corr(x, name):
        return correlate(x, [b[name]["gap"] for b in blocks], reps=reps, seed=seed)

    cond = [log10(b["input_condition_number"]) for b in blocks]
    ceiling = [b["r2_closed_form"] for b in blocks]
    return {"steps": steps, "blocks": blocks, "seconds": seconds,
            "optimizers": {n: lr_rule(n, adam_lr) for n in OPTIMIZERS},
            "correlation": {"gap_vs_condition": {n: corr(cond, n) for n in OPTIMIZERS},
                            "gap_vs_ceiling": {n: corr(ceiling, n) for n in OPTIMIZERS},
                            "adam_gap_vs_largest_weight": corr([log10(b.get("closed_form_max_abs")) for b in blocks],
                                                               "adam")}}
