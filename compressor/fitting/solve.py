"""Closed-form affine and reduced-rank fits, and their held-out scores.

All from :class:`~compressor.core.stats.Moments`: the exact least-squares map
``y ≈ Wᵀx + b`` solves ``Cxx W = Cxy`` (centred covariances), ``b = μy − Wᵀμx``.
Never trained by gradient descent: on ill-conditioned activations SGD
under-converges, and the closed form is both exact and cheap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from compressor.core.stats import Moments

_F64 = torch.float64

# A column whose variance is below this fraction of the mean variance carries
# no information (e.g. a dimension the pre-norm zeroes); it is left out of the
# solve and gets a zero weight. 1e-16 is a standard-deviation ratio of 1e-8,
# below float32 resolution; small-scale but live channels stay in.
DEAD_COLUMN_RTOL = 1e-16
# Eigenvalues of the input *correlation* matrix below this fraction of the
# largest one count as exactly singular directions, left out of the solve
# (like lstsq's rcond); float32 rounding noise sits near 1e-14, real
# directions far above. Judging on the correlation, not the covariance, keeps
# small-scale but informative channels (measured on SmolLM2 blocks 21 and 24).
RANK_RTOL = 1e-10
# Damping ladder if Cholesky still fails on a full-rank covariance: λ = step × mean diagonal.
DAMPING_STEPS = (0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2, 1e-1)
# From this many live inputs the rank check estimates the extreme eigenvalues from the Cholesky
# factor (:func:`extreme_eigvals`) instead of computing all of them; a smallest estimate within
# FAST_RANK_MARGIN of the cutoff takes the full check.
FAST_RANK_CHECK_FROM = 2048
FAST_RANK_MARGIN = 100.0


@dataclass
class AffineFit:
    """The full-rank fit ``y ≈ Wᵀx + b`` (float64) and how it was obtained."""

    W: torch.Tensor  # [d_in, d_out]
    b: torch.Tensor  # [d_out]
    n_fit: int
    damping: float = 0.0
    dead_inputs: int = 0
    truncated: int = 0
    """Input directions dropped as numerically singular."""
    warnings: list[str] = field(default_factory=list)
    # Eigen-decomposition of the explained-output covariance Wᵀ Cxx W (fit
    # rows), descending: drives reduced-rank fits and the effective rank.
    explained_eigvals: torch.Tensor | None = None
    explained_eigvecs: torch.Tensor | None = None
    fit_sse: float = float("nan")
    fit_sst: float = float("nan")

    @property
    def d_in(self) -> int:
        return self.W.shape[0]

    @property
    def d_out(self) -> int:
        return self.W.shape[1]


def solve_affine(m: Moments, device: torch.device | str | None = None) -> AffineFit:
    """Exact least squares from fit-row statistics (Cholesky, damped only if needed).

    The factorisations run on ``device`` (default: where the sums are); the
    result is on the CPU."""
    if device is not None and m.cxx.device != torch.device(device):
        fit = solve_affine(m.to(device))
        return AffineFit(
            W=fit.W.cpu(), b=fit.b.cpu(), n_fit=fit.n_fit, damping=fit.damping, dead_inputs=fit.dead_inputs,
            truncated=fit.truncated, warnings=fit.warnings, explained_eigvals=fit.explained_eigvals.cpu(),
            explained_eigvecs=fit.explained_eigvecs.cpu(), fit_sse=fit.fit_sse, fit_sst=fit.fit_sst,
        )
    if m.n == 0:
        raise ValueError("no calibration rows were collected for this block; give more calibration data")
    warnings: list[str] = []
    n_params = m.d_in + 1
    if m.n < n_params:
        warnings.append(
            f"only {m.n} fit rows for {n_params} parameters per output: the fit is underdetermined "
            "and damped; raise calibration max_tokens"
        )
    cxx = m.cxx / m.n
    cxy = m.cxy / m.n
    diag = torch.diagonal(cxx)
    mean_diag = float(diag.mean()) if diag.numel() else 0.0
    if mean_diag <= 0:
        raise ValueError("the FFN input has zero variance on the calibration rows; check the calibration data")
    live = diag > DEAD_COLUMN_RTOL * mean_diag
    dead = int((~live).sum())
    if dead:
        warnings.append(f"{dead} dead input column(s) (zero variance) left out of the solve")
    c_live = cxx if dead == 0 else cxx[live][:, live]
    rhs = cxy if dead == 0 else cxy[live]
    # Rank check first: Cholesky often "succeeds" on an exactly rank-deficient
    # covariance (LayerNorm outputs are rank d-1; float32 rounding leaves a
    # ~1e-14 eigenvalue), and the solve then amplifies noise along that
    # direction. Such directions are dropped. Check and truncated solve run on
    # the correlation matrix R = D^-½ C D^-½ (D = diag C), so a channel that is
    # merely small in scale is neither dropped nor solved with the squared
    # condition number of raw normal equations. The result is the minimum-norm
    # solution in standardized inputs; on inputs in the span of the fit rows
    # its predictions equal lstsq's.
    # Large inputs (a re-solve over thousands of kept hidden units, at every gate attempt) check
    # the rank from the Cholesky factor the solve needs anyway: the extreme eigenvalues by block
    # inverse and power iteration, a second where all eigenvalues take several times the
    # factorisation. Anything near the cutoff, or a failed factorisation, takes the full path.
    scale = diag[live].sqrt()
    corr = c_live / scale[:, None] / scale[None, :]
    damping, truncated, solved = 0.0, 0, None
    if c_live.shape[0] >= FAST_RANK_CHECK_FROM:
        chol, info = torch.linalg.cholesky_ex(c_live)
        if int(info) == 0:
            lo, hi = extreme_eigvals(corr, chol, scale)
            if lo > FAST_RANK_MARGIN * RANK_RTOL * hi:
                solved = torch.cholesky_solve(rhs, chol)
    if solved is None:
        solved, damping, truncated = _solve_checked(c_live, corr, rhs, scale, mean_diag, warnings)
    W = torch.zeros(m.d_in, m.d_out, dtype=_F64, device=m.cxx.device)
    W[live] = solved
    b = m.my - W.T @ m.mx
    if not (torch.isfinite(W).all() and torch.isfinite(b).all()):
        raise FloatingPointError("the affine solve produced non-finite weights; calibration activations overflowed")
    cxx_w = m.cxx @ W  # shared by the explained covariance and the fit error
    explained = W.T @ cxx_w / m.n
    eigvals, eigvecs = torch.linalg.eigh((explained + explained.T) / 2)
    order = torch.argsort(eigvals, descending=True)
    sse = m.sse(W, b, cxx_w)
    return AffineFit(
        W=W, b=b, n_fit=m.n, damping=damping, dead_inputs=dead, truncated=truncated, warnings=warnings,
        explained_eigvals=eigvals[order].clamp_min(0), explained_eigvecs=eigvecs[:, order],
        fit_sse=float(sse.sum()), fit_sst=m.sst(),
    )


def _solve_checked(c_live, corr, rhs, scale, mean_diag, warnings) -> tuple[torch.Tensor, float, int]:
    """(solution, damping, truncated directions): the rank check on every eigenvalue of ``corr``,
    then the truncated eigen-solve or the Cholesky solve (damped only if it fails)."""
    # The check needs eigenvalues only (several times cheaper than eigenvectors at thousands of
    # inputs); the eigenvectors are computed only for the truncated solve that needs them.
    eigvals = torch.linalg.eigvalsh(corr)
    truncated = int((eigvals <= RANK_RTOL * float(eigvals[-1])).sum())
    if truncated:
        eigvals, eigvecs = torch.linalg.eigh(corr)
        truncated = int((eigvals <= RANK_RTOL * float(eigvals[-1])).sum())
        warnings.append(
            f"input covariance rank-deficient: {truncated} direction(s) below {RANK_RTOL:g} × largest eigenvalue "
            "of the input correlation dropped (minimum-norm solution in standardized inputs)"
        )
        V, lam = eigvecs[:, truncated:], eigvals[truncated:]
        return (V @ ((V.T @ (rhs / scale[:, None])) / lam[:, None])) / scale[:, None], 0.0, truncated
    for step in DAMPING_STEPS:
        lam = step * mean_diag
        a = c_live + lam * torch.eye(c_live.shape[0], dtype=_F64, device=c_live.device) if lam else c_live
        chol, info = torch.linalg.cholesky_ex(a)
        if int(info) == 0:
            break
    else:
        raise RuntimeError(
            "the input covariance is singular even with damping 0.1 × mean diagonal; "
            "the calibration data is degenerate (e.g. all windows identical)"
        )
    if step:
        warnings.append(f"input covariance singular: damped by {step:g} × mean diagonal")
    return torch.cholesky_solve(rhs, chol), step, 0


@torch.no_grad()
def extreme_eigvals(corr: torch.Tensor, chol: torch.Tensor, scale: torch.Tensor, iters: int = 4,
                    block: int = 8) -> tuple[float, float]:
    """Estimates of the smallest and largest eigenvalue of the correlation ``corr = D^-½ C D^-½``,
    given the Cholesky factor ``chol`` of ``C`` and ``scale = diag(C)^½``: block inverse iteration
    (solves with the factor) and block power iteration, each closed by a Rayleigh–Ritz step, from a
    seeded start. Ritz values lie inside the spectrum, so the smallest is an upper bound on the true
    one and the largest a lower bound on the true one; a direction far below the rest (what the rank
    check looks for) dominates the inverse iteration after one step.

    >>> lo, hi = extreme_eigvals(corr, torch.linalg.cholesky(c), c.diagonal().sqrt())   # doctest: +SKIP
    """
    g = torch.Generator().manual_seed(0)
    start = torch.randn(corr.shape[0], block, generator=g, dtype=corr.dtype).to(corr.device)
    s = scale[:, None]
    q = torch.linalg.qr(start).Q
    for _ in range(iters):  # corr⁻¹ q = D^½ C⁻¹ D^½ q
        q = torch.linalg.qr(torch.cholesky_solve(q * s, chol) * s).Q
    lo = float(torch.linalg.eigvalsh(q.T @ corr @ q)[0])
    q = torch.linalg.qr(start).Q
    for _ in range(iters):
        q = torch.linalg.qr(corr @ q).Q
    hi = float(torch.linalg.eigvalsh(q.T @ corr @ q)[-1])
    return lo, hi


def uncentered(m: Moments) -> Moments:
    """The statistics of a regression through the origin: the raw sums ``Σxxᵀ``, ``Σxyᵀ``, ``Σy²`` in
    the centred slots and zero means, so every centred solve on them is an intercept-free solve."""
    n, mx, my = m.n, m.mx, m.my
    return Moments(d_in=m.d_in, d_out=m.d_out, n=n, mx=torch.zeros_like(mx), my=torch.zeros_like(my),
                   cxx=m.cxx + n * torch.outer(mx, mx), cxy=m.cxy + n * torch.outer(mx, my),
                   cyy_diag=m.cyy_diag + n * my * my)


def solve_linear(m: Moments, device: torch.device | str | None = None) -> AffineFit:
    """Least squares without an intercept, ``y ≈ Wᵀx`` (``b = 0``), from the same statistics as
    :func:`solve_affine`: the uncentred normal equations ``Σxxᵀ W = Σxyᵀ``, with the same dead-column,
    rank and damping guards. For an output whose class has no bias to carry ``b`` (e.g. Qwen2's MLP).
    ``fit_sse``/``fit_sst`` are the true fit-row SSE and the SST about the mean, like ``solve_affine``'s.

    >>> fit = solve_linear(moments)                 # doctest: +SKIP
    >>> bool((fit.b == 0).all())                     # doctest: +SKIP
    True
    """
    fit = solve_affine(uncentered(m), device=device)
    fit.b = torch.zeros_like(fit.b)
    fit.fit_sse, fit.fit_sst = float(m.to(fit.W.device).sse(fit.W, fit.b).sum()), m.sst()
    return fit


@dataclass
class LowRankFit:
    """Reduced-rank map ``y ≈ Bᵀ(Aᵀx) + b``: A [d_in, r], B [r, d_out]."""

    A: torch.Tensor
    B: torch.Tensor
    b: torch.Tensor
    rank: int

    @property
    def W(self) -> torch.Tensor:
        return self.A @ self.B


def low_rank(fit: AffineFit, m: Moments, rank: int) -> LowRankFit:
    """Closed-form reduced-rank regression: project the full solution onto the
    top-``rank`` principal directions of its fitted outputs (Izenman 1975)."""
    if not 1 <= rank <= min(fit.d_in, fit.d_out):
        raise ValueError(f"rank must be in [1, {min(fit.d_in, fit.d_out)}], got {rank}")
    V = fit.explained_eigvecs[:, :rank]  # [d_out, r]
    A = fit.W @ V
    B = V.T.contiguous()
    b = m.my - B.T @ (A.T @ m.mx)
    return LowRankFit(A=A, B=B, b=b, rank=rank)


def fit_r2_at_rank(fit: AffineFit, rank: int) -> float:
    """Fit-row R² of the rank-``rank`` map, without refitting.

    The reduced-rank residual is the full residual plus the dropped explained
    directions, orthogonal on the fit rows, so SSE_r = SSE + n Σ_{i>r} λ_i.
    """
    dropped = float(fit.explained_eigvals[rank:].sum()) * fit.n_fit
    return 1.0 - (fit.fit_sse + dropped) / fit.fit_sst if fit.fit_sst > 0 else float("nan")


def rank_for_fraction(fit: AffineFit, fraction: float) -> int:
    """Smallest rank whose fit-row R² keeps ``fraction`` of the full-rank R²."""
    full = fit_r2_at_rank(fit, fit.explained_eigvals.numel())
    target = fraction * full
    total = float(fit.explained_eigvals.sum()) * fit.n_fit
    tail = total - torch.cumsum(fit.explained_eigvals, 0) * fit.n_fit  # dropped after keeping r=1..
    r2 = 1.0 - (fit.fit_sse + tail) / fit.fit_sst
    ok = torch.nonzero(r2 >= target - 1e-12)
    return int(ok[0]) + 1 if ok.numel() else int(fit.explained_eigvals.numel())


def affine_params(d_in: int, d_out: int, rank: int | None = None) -> int:
    """Parameters of the replacement (weights + bias)."""
    if rank is None:
        return d_in * d_out + d_out
    return rank * (d_in + d_out) + d_out


@dataclass
class Score:
    """Held-out quality of one affine map."""

    r2: float  # pooled: 1 − ΣSSE / ΣSST
    r2_median_feature: float
    sse: float
    sst: float


def score(m: Moments, W: torch.Tensor, b: torch.Tensor) -> Score:
    """Held-out R²: 1 − SSE/SST pooled over output features, SST about the held-out mean."""
    if m.n == 0:
        nan = float("nan")
        return Score(nan, nan, nan, nan)
    sse_f = m.sse(W, b)
    sst_f = m.cyy_diag
    sse, sst = float(sse_f.sum()), float(sst_f.sum())
    live = sst_f > 0
    per_feature = 1.0 - sse_f[live] / sst_f[live]
    # quantile interpolates: the usual median for an even number of features
    med = float(torch.quantile(per_feature, 0.5)) if per_feature.numel() else float("nan")
    r2 = 1.0 - sse / sst if sst > 0 else float("nan")
    return Score(r2=r2, r2_median_feature=med, sse=sse, sst=sst)


def effective_rank(values: torch.Tensor) -> float:
    """exp(entropy) of the normalised non-negative ``values`` (Roy & Vetterli 2007)."""
    v = values.clamp_min(0).to(_F64)
    total = float(v.sum())
    if total <= 0:
        return 0.0
    p = v[v > 0] / total
    return math.exp(float(-(p * p.log()).sum()))


def solve_shrunk(m: Moments, *, intercept: bool = True,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(W, b, warnings)`` on CPU of the solve on :func:`shrunk` statistics: the same Cholesky solve
    as :func:`solve_affine`'s (or :func:`solve_linear`'s, ``intercept=False``) fast path, without its
    rank check and explained spectrum — the ridge bounds the correlation matrix's smallest eigenvalue
    below by λ / (1 + λ), so there is no singular direction to find, and a gate re-solve needs only
    the weights. A factorisation that fails anyway takes the checked solve."""
    dev = torch.device(device) if device is not None else m.cxx.device
    mm = (m if intercept else uncentered(m)).to(dev)
    cxx = mm.cxx / mm.n
    diag = torch.diagonal(cxx)
    live = diag > DEAD_COLUMN_RTOL * float(diag.mean())
    c_live = cxx if bool(live.all()) else cxx[live][:, live]
    chol, info = torch.linalg.cholesky_ex(c_live)
    if int(info):
        fit = (solve_affine if intercept else solve_linear)(m, device=device)
        return fit.W, fit.b, list(fit.warnings)
    rhs = mm.cxy / mm.n
    W = torch.zeros(mm.d_in, mm.d_out, dtype=_F64, device=dev)
    W[live] = torch.cholesky_solve(rhs[live] if not bool(live.all()) else rhs, chol)
    b = mm.my - W.T @ mm.mx if intercept else torch.zeros_like(mm.my)
    if not (torch.isfinite(W).all() and torch.isfinite(b).all()):
        raise FloatingPointError("the re-solve produced non-finite weights; calibration activations overflowed")
    dead = int((~live).sum())
    warnings = [f"{dead} dead input column(s) (zero variance) left out of the solve"] if dead else []
    return W.cpu(), b.cpu(), warnings


def shrunk(m: Moments, ridge: float, prior: torch.Tensor) -> Moments:
    """The statistics of a ridge regression toward ``prior`` ([d_in, d_out]): every solve on them gives
    ``(C + λ·diag C) W = C_xy + λ·diag C · W₀`` (``λ`` = ``ridge`` times each input's own variance;
    the intercept is not shrunk). The fit-row SSE on them is the shrunk objective.

    >>> fit = solve_affine(shrunk(moments, 1.0, w0))   # doctest: +SKIP
    """
    if ridge < 0:
        raise ValueError(f"ridge must be ≥ 0, got {ridge}")
    if ridge == 0:
        return m
    dg = ridge * torch.diagonal(m.cxx)
    w0 = prior.to(m.cxy)
    return Moments(d_in=m.d_in, d_out=m.d_out, full_cyy=False, n=m.n, mx=m.mx, my=m.my,
                   cxx=m.cxx + torch.diag(dg), cxy=m.cxy + dg[:, None] * w0,
                   cyy_diag=m.cyy_diag + (dg[:, None] * w0 * w0).sum(0))


def subset(m: Moments, cols: torch.Tensor) -> Moments:
    """The statistics of the regression restricted to input columns ``cols``."""
    cols = torch.as_tensor(cols, dtype=torch.long)
    return Moments(
        d_in=int(cols.numel()), d_out=m.d_out, full_cyy=m.full_cyy, n=m.n, mx=m.mx[cols], my=m.my,
        cxx=m.cxx[cols][:, cols], cxy=m.cxy[cols], cyy_diag=m.cyy_diag, cyy=m.cyy,
    )
