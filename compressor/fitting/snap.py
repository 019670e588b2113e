"""Snap: a re-solved output map onto the grid of the GGML type the shipped file stores it in.

A run that writes a GGUF at its source's quantization (``output.formats`` with ``gguf``,
``output.gguf_quant: source``) stores every re-solved down projection in that file quantized: the
float fit the gate measured is not what the user runs. :func:`snap` makes the fit what the file holds,
so the gate (and the search under it) measures the shipped weights, and quantizing costs as little
as the statistics allow:

1. the columns (hidden units) go in groups of one GGML block (32 or 256 elements of a row);
2. each group is quantized by ggml's own quantizer (:func:`compressor.core.ggml.roundtrip`), every
   column weighted by its variance (the importance matrix);
3. the group's rounding error is compensated on the columns not yet fixed by the exact
   least-squares update (optimal brain surgeon for a set of weights, as GPTQ applies it; the
   inverse covariance of the remaining columns comes from one Cholesky factor,
   ``H⁻¹ = Uᵀ U`` ⇒ ``(H[s:, s:])⁻¹ = U[s:, s:]ᵀ U[s:, s:]``; up to
   :data:`MAX_COMPENSATED_UNITS` units, rounding alone beyond);
4. the intercept is re-solved for the snapped weights (``b = ȳ − W_q x̄``).

Closed form from the statistics the fit already has: no activation is stored, nothing is trained.
The group's bytes are kept (:attr:`compressor.fitting.kinds.Fitted.stored`) and the GGUF writer stores
them as they are: quantizing the snapped values again would not give them back (ggml's scale search
depends on the values), so the file holds exactly what the gate measured.

    Wq, b, raw = snap(W, cov, mx, my, GGMLType.Q4_1)   # W [d_out, k]; needs llama-cpp-python
"""

from __future__ import annotations

import numpy as np
import torch

from compressor.core import ggml

#: The widest map whose rounding error is compensated. The compensation costs one Cholesky factor and one
#: triangular inverse of the units' covariance (⅔ k³ flops, float64): 0.1 s at SmolLM2's 1,536 units,
#: 15 s at Qwen2.5-1.5B's 8,704 on a 2-core CPU, and a search refits every narrowed block at each of its
#: steps. Wider maps are rounded with the importance matrix alone: the file still holds exactly what the
#: gate measured, at a larger rounding error.
MAX_COMPENSATED_UNITS = 4096

#: GPTQ's damping: a fraction of the mean variance added to the covariance's diagonal before it is
#: inverted, so that nearly collinear units do not send a group's error onto huge compensations.
DAMP = 0.01


def importance(cov: torch.Tensor) -> np.ndarray:
    """Column weights for ggml's quantizer: each unit's variance, floored so no block is all zero."""
    d = torch.diagonal(cov).double().clamp_min(0)
    floor = 1e-6 * float(d.mean()) if float(d.mean()) > 0 else 1.0
    return (d + floor).float().numpy()


def snap(W: torch.Tensor, cov: torch.Tensor, mx: torch.Tensor, my: torch.Tensor, qtype: ggml.GGMLType,
         *, intercept: bool = True, damp: float = DAMP) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """``(W_q, b, raw)``: ``W`` ([d_out, k], one row per output, as the file stores it) on ``qtype``'s grid
    with each group's error compensated; the least-squares intercept for ``W_q`` (zero without
    ``intercept``); and ``W_q`` as ggml's bytes ([d_out, row bytes]: what the writer stores, so the file
    holds exactly the values the gate measured). ``cov``: the regressors' covariance [k, k]; ``mx``,
    ``my``: the regressors' and outputs' means."""
    qtype = ggml.GGMLType(qtype)
    W = W.detach().double().cpu().clone()
    d_out, k = W.shape
    block = ggml.BLOCKS[qtype][0]
    if k % block:
        raise ValueError(f"{k} units are not a whole number of {qtype.name} blocks of {block}")
    H = cov.detach().double().cpu()
    if not intercept:
        H = H + torch.outer(mx.double().cpu(), mx.double().cpu())
    weights = importance(H)
    U = _inverse_cholesky(H, damp) if k <= MAX_COMPENSATED_UNITS else None
    out, raw = torch.empty_like(W), []
    for s in range(0, k, block):
        g = slice(s, s + block)
        raw.append(ggml.quantize(W[:, g].float().numpy(), qtype, weights[g]))
        q = torch.from_numpy(ggml.dequantize(raw[-1], qtype, block)).double()
        out[:, g] = q
        if s + block < k and U is not None:
            err = W[:, g] - q
            # the OBS update of the remaining columns for fixing this group: −E · U_SS⁻¹ · U_S,rest
            coef = torch.linalg.solve_triangular(U[g, g], U[g, s + block:], upper=True)
            W[:, s + block:] -= err @ coef
    b = my.double().cpu() - out @ mx.double().cpu() if intercept else torch.zeros(d_out, dtype=torch.float64)
    return out, b, np.ascontiguousarray(np.concatenate(raw, axis=1))


def _inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper ``U`` with ``(H + damp·mean(diag H)·I)⁻¹ = Uᵀ U``; None (no compensation, rounding alone)
    when the damped covariance is still not positive definite."""
    k = H.shape[0]
    mean = float(torch.diagonal(H).mean()) if k else 0.0
    if not mean > 0:
        return None
    Hd = H + damp * mean * torch.eye(k, dtype=H.dtype)
    dead = torch.diagonal(H) <= 0
    Hd[dead, dead] = mean  # a dead unit: nothing to compensate through it
    # With J the reversal, J·H·J = M·Mᵀ (M lower) gives H⁻¹ = Uᵀ·U for the upper U = J·M⁻¹·J: one
    # Cholesky and one triangular inverse (⅔ k³), not a factor, an inverse and a second factor.
    M, info = torch.linalg.cholesky_ex(Hd.flip(0, 1))
    if int(info):
        return None
    eye = torch.eye(k, dtype=H.dtype)
    return torch.linalg.solve_triangular(M, eye, upper=False).flip(0, 1)
