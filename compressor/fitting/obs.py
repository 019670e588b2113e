"""Which hidden units to keep: greedy optimal-brain-surgeon removal, in closed form.

For the joint least-squares map ``y ≈ Bᵀz + c`` with regressors ``z`` (the
block input ``x`` and the hidden units ``h`` its down projection receives),
removing regressor ``j`` and re-solving the rest optimally raises the
fit-row SSE by exactly ``‖B_j‖² / [S⁻¹]_jj`` (Hassibi & Stork 1993; the
structured form used by ZipLM/SparseGPT-style solvers), with ``S`` the
covariance of ``z``. Removing a *set* ``J`` at once costs
``tr(B_Jᵀ [S⁻¹]_JJ⁻¹ B_J)`` and updates ``B`` and ``S⁻¹`` by one rank-|J|
correction, so the path runs as a few hundred small GEMMs instead of
``d_ff`` rank-1 updates. The first ``n_fixed`` regressors (the affine bypass
``x``) are never removed.

The path is nested: the units kept at size ``k`` are ``order[d_ff-k:]``. At
every step the held-out relative error is tracked exactly from held-out
statistics (a rank-|J| update of ``S_held B``), which is the block's error
curve used for allocation. Everything runs in float64 on standardized
regressors (unit variance), so the costs do not depend on the scale of a unit.

With ``ridge`` λ > 0 every solve is shrunk toward ``prior`` (the block's original coefficients),
``(S + λ I) B = S_y + λ B₀`` on the standardized regressors: exact OBS on the ridge-augmented normal equations,
so removing a unit also gives up its prior term ``λ‖B₀ⱼ‖²``. Why (the exact re-solve fits the fit rows' noise
when they barely outnumber the units): docs/benchmarks.md, ``tools/structural/bench_resolve_rows.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from compressor.fitting.solve import DEAD_COLUMN_RTOL
from compressor.core.stats import Moments

logger = logging.getLogger(__name__)

_F64 = torch.float64
# Ridge on the standardized covariance for the path only (the final fit is
# re-solved exactly by compressor.fitting.solve): keeps the running inverse stable when
# hidden units are nearly collinear.
PATH_DAMPING = 1e-6
PATH_RETRY_DAMPING = (1e-5, 1e-4, 1e-3, 1e-2)
"""Tried in turn when the Cholesky factorisation fails at PATH_DAMPING."""
COMPACT_BELOW = 0.75
"""The path's matrices drop their removed rows once fewer than this share of them are live."""


@dataclass
class ObsPath:
    order: torch.Tensor
    """Removable-regressor indices (0-based among the removable ones), first removed first."""
    sizes: list[int]
    """Kept removable regressors after each step, descending from all to 0."""
    fit_rel_error: list[float]
    heldout_rel_error: list[float]

    def kept(self, size: int) -> torch.Tensor:
        """Sorted indices (among the removable regressors) kept at ``size``."""
        n = self.order.numel()
        if not 0 <= size <= n:
            raise ValueError(f"size must be in [0, {n}], got {size}")
        return torch.sort(self.order[n - size:]).values


def _standardize(m: Moments) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale s, live mask, correlation-like matrix R = C / s sᵀ) of the fit covariance."""
    c = m.cxx / m.n
    diag = torch.diagonal(c)
    live = diag > DEAD_COLUMN_RTOL * float(diag.mean())
    s = torch.where(live, diag.clamp_min(0).sqrt(), torch.ones_like(diag))
    r = c / s[:, None] / s[None, :]
    r[~live] = 0
    r[:, ~live] = 0
    r[~live, ~live] = 1.0
    return s, live, r


def _check_path_args(zfit: Moments, step: int, ridge: float, prior: torch.Tensor | None) -> None:
    if zfit.n == 0:
        raise ValueError("no calibration rows for the hidden-unit path")
    if step < 1:
        raise ValueError(f"step must be ≥ 1, got {step}")
    if ridge < 0:
        raise ValueError(f"ridge must be ≥ 0, got {ridge}")
    if prior is not None and tuple(prior.shape) != (zfit.d_in, zfit.d_out):
        raise ValueError(f"prior must be [{zfit.d_in}, {zfit.d_out}], got {list(prior.shape)}")


def _damped_inverse(r: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``(R + damping I)⁻¹`` by Cholesky, the damping the smallest of the ladder that factorises.

    Float32 chunk products leave rounding of ~1e-7 × the largest eigenvalue; when the rows barely
    outnumber the regressors (or do not), that can exceed the default damping."""
    p = r.shape[0]
    eye = torch.eye(p, dtype=_F64, device=r.device)
    ladder = (PATH_DAMPING, *(x for x in PATH_RETRY_DAMPING if x > PATH_DAMPING))
    for damping in ladder:
        chol, info = torch.linalg.cholesky_ex(r + damping * eye)
        if int(info) == 0:
            break
    else:
        raise FloatingPointError(
            f"hidden-unit covariance ({p} regressors, {n_rows} calibration rows) is not positive definite even "
            f"with damping {ladder[-1]:g}: give more calibration tokens (calibration.max_tokens)")
    if damping > ladder[0] or n_rows < p:
        logger.warning("hidden-unit path: %d calibration rows for %d regressors; damping %g used. The fit is "
                       "under-determined: give more calibration tokens (≥ %d)", n_rows, p, damping, 10 * p)
    del eye
    return torch.cholesky_inverse(chol)


def _full_fit(zfit: Moments, s: torch.Tensor, live: torch.Tensor, rinv: torch.Tensor, w: torch.Tensor,
              ridge: float, prior: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The path's start, every regressor in: ``(B, S_y, weighted SST, weighted SSE)`` on the standardized
    regressors, shrunk toward ``prior`` by ``ridge`` (``S_y`` then includes ``λ B₀``)."""
    dev = rinv.device
    cy = zfit.cxy.to(dev) / zfit.n / s[:, None]
    b0 = None
    if ridge and prior is not None:
        b0 = s[:, None] * prior.to(dev, _F64) * live[:, None]  # B₀ in standardized units
        cy = cy + ridge * b0
    b = rinv @ cy
    b[~live] = 0
    sst = float((zfit.cyy_diag.to(dev) * w).sum()) / zfit.n
    # SSE of the augmented rows: the prior's rows add λ‖B₀‖² to the total they are fitted against.
    prior_ss = ridge * float((b0 * b0 * w).sum()) if b0 is not None else 0.0
    return b, cy, sst, max(sst + prior_ss - float((b * cy * w).sum()), 0.0)


class _HeldOut:
    """The held-out relative error of the path's current coefficients, kept exact under removals:
    ``S_held B`` (weighted by the output weight ``w``) is updated by the same rank-|J| corrections as ``B``."""

    def __init__(self, zfit: Moments, zheld: Moments, s: torch.Tensor, b: torch.Tensor, w: torch.Tensor):
        dev = b.device
        self.ch = zheld.cxx.to(dev) / zheld.n / s[:, None] / s[None, :]
        self.cyh_w = zheld.cxy.to(dev) / zheld.n / s[:, None] * w  # the output weight folded in once
        self.gw = (self.ch @ b) * w  # (S_held B) W
        self.dmu = (zheld.mx.to(dev) - zfit.mx.to(dev)) / s
        self.dmy = zheld.my.to(dev) - zfit.my.to(dev)
        self.sst = float((zheld.cyy_diag.to(dev) * w).sum()) / zheld.n
        self.w = w

    def rel_error(self, b: torch.Tensor) -> float:
        mean_res = self.dmy - b.T @ self.dmu
        bf = b.reshape(-1)
        sse = (self.sst - 2 * float(bf @ self.cyh_w.reshape(-1)) + float(bf @ self.gw.reshape(-1))
               + float((mean_res**2 * self.w).sum()))
        return max(sse, 0.0) / self.sst if self.sst > 0 else float("nan")

    def remove(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """The update of removing a set: ``B −= u v`` (``u`` the inverse's columns, ``v`` the solve)."""
        self.gw.addmm_(self.ch @ u, v * self.w, alpha=-1)

    def compact(self, idx: torch.Tensor) -> None:
        self.gw, self.cyh_w, self.dmu = self.gw[idx], self.cyh_w[idx], self.dmu[idx]
        self.ch = self.ch[idx[:, None], idx]


@torch.no_grad()
def _cheapest(b: torch.Tensor, rinv: torch.Tensor, w: torch.Tensor, cand: torch.Tensor, step: int) -> torch.Tensor:
    """The ``step`` candidates whose removal raises the (weighted) fit error least:
    cost_j = Σ_o w_o B_jo² / [S⁻¹]_jj (ties in index order)."""
    bj = b[cand]
    cost = (bj * bj) @ w / torch.diagonal(rinv)[cand].clamp_min(1e-300)
    return cand[torch.argsort(cost, stable=True)[: min(step, cand.numel())]]


def _remove(b: torch.Tensor, rinv: torch.Tensor, w: torch.Tensor, take: torch.Tensor,
            held: "_HeldOut | None") -> float:
    """Remove regressors ``take`` from the fit in place (coefficients ``b``, inverse ``rinv``, the held-out
    error's state) by the block OBS update; returns the rise of the weighted fit SSE."""
    u = rinv[:, take]
    rjj = u[take]
    rjj_inv = torch.linalg.inv((rjj + rjj.T) / 2)
    v = rjj_inv @ b[take]
    rise = float((b[take] * v * w).sum())
    b.addmm_(u, v, alpha=-1)
    if held:
        held.remove(u, v)
    rinv.addmm_(u, rjj_inv @ u.T, alpha=-1)  # in place: no p × p temporary
    return rise


def obs_path(
    zfit: Moments,
    zheld: Moments | None,
    n_fixed: int,
    *,
    step: int = 1,
    output_weight: torch.Tensor | None = None,
    device: torch.device | str | None = None,
    ridge: float = 0.0,
    prior: torch.Tensor | None = None,
) -> ObsPath:
    """Greedy removal path over regressors ``n_fixed..p-1`` of ``zfit``.

    ``step`` regressors are removed per update (1 = exact greedy).
    ``output_weight`` (d_out, the diagonal of a PSD output weight such as the
    loss-gradient second moment) makes the choice loss-aware:
    cost_j = Σ_o w_o B_jo² / [S⁻¹]_jj; the coefficients do not depend on it,
    and the reported errors are then weighted the same way. The matrices
    shrink as regressors leave, and run on ``device`` (e.g. the GPU the
    layer lives on). ``ridge`` (≥ 0) shrinks every solve toward ``prior``
    ([p, d_out] coefficients in the units of ``zfit``; zeros when None), and
    ``fit_rel_error`` is then the shrunk objective, not the plain fit error.

    >>> path = obs_path(zfit, zheld, n_fixed=d, step=16)      # doctest: +SKIP
    >>> path.kept(512)                                         # doctest: +SKIP
    """
    _check_path_args(zfit, step, ridge, prior)
    dev = torch.device(device) if device is not None else zfit.cxx.device
    p = zfit.d_in
    n_rem = p - n_fixed
    s, live, r = (t.to(dev) for t in _standardize(zfit))
    diag_live = torch.nonzero(live).flatten()
    r[diag_live, diag_live] += ridge  # dead regressors keep their 1
    rinv = _damped_inverse(r, zfit.n)
    del r
    w = torch.ones(zfit.d_out, dtype=_F64, device=dev) if output_weight is None else output_weight.to(dev, _F64)
    b, cy, sst_fit, sse_fit = _full_fit(zfit, s, live, rinv, w, ridge, prior)
    held = _HeldOut(zfit, zheld, s, b, w) if zheld is not None and zheld.n > 0 else None

    # `ids[k]` is the original index of row k of the matrices, `alive[k]` whether it is still in the
    # fit. A removed regressor's row and column of the updated inverse are exactly zero (its
    # Schur complement), as is its coefficient, so it stays in place until the live rows fall
    # below COMPACT_BELOW of the matrix: copying a large matrix costs more than a few steps of
    # updates on its dead rows.
    ids = torch.arange(p, device=dev)
    alive = torch.ones(p, dtype=torch.bool, device=dev)
    order: list[int] = []
    sizes = [n_rem]
    fit_err = [sse_fit / sst_fit if sst_fit > 0 else float("nan")]
    held_err = [held.rel_error(b) if held else float("nan")]

    def drop(local: torch.Tensor) -> None:
        nonlocal rinv, b, cy, ids, alive
        order.extend(int(j) for j in ids[local])
        alive[local] = False
        rinv[local] = 0
        rinv[:, local] = 0
        b[local] = 0
        if int(alive.sum()) < COMPACT_BELOW * alive.numel():
            idx = torch.nonzero(alive).flatten()
            rinv = rinv[idx[:, None], idx]
            b, cy, ids, alive = b[idx], cy[idx], ids[idx], alive[idx]
            if held:
                held.compact(idx)
        sizes.append(n_rem - len(order))
        fit_err.append(sse_fit / sst_fit if sst_fit > 0 else float("nan"))
        held_err.append(held.rel_error(b) if held else float("nan"))

    # Dead regressors go first, at no cost (their coefficients are zero).
    dead = torch.nonzero(~live[ids] & (ids >= n_fixed)).flatten()
    if dead.numel():
        drop(dead)
    while len(order) < n_rem:
        take = _cheapest(b, rinv, w, torch.nonzero(alive & (ids >= n_fixed)).flatten(), step)
        sse_fit += _remove(b, rinv, w, take, held)
        drop(take)
    order_t = torch.tensor(order, dtype=torch.long) - n_fixed
    return ObsPath(order=order_t, sizes=sizes, fit_rel_error=fit_err, heldout_rel_error=held_err)
