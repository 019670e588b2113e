"""Closed-form affine / reduced-rank fits against independent numpy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compressor.fitting.solve import (
    extreme_eigvals,
    effective_rank,
    fit_r2_at_rank,
    low_rank,
    rank_for_fraction,
    score,
    solve_affine,
)
from compressor.core.stats import Moments

pytestmark = pytest.mark.usefixtures("torch_single_thread")

F64 = torch.float64


@pytest.fixture(autouse=True, params=["all eigenvalues", "extreme eigenvalues"])
def rank_check(request, monkeypatch):
    """Every solve in this module runs twice: with the rank check on all eigenvalues (small inputs),
    and with the check from the Cholesky factor that large inputs take (forced down to any size)."""
    if request.param == "extreme eigenvalues":
        monkeypatch.setattr("compressor.fitting.solve.FAST_RANK_CHECK_FROM", 1)
    return request.param


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extreme_eigvals_bracket_and_match_numpy(seed):
    """The estimates from the Cholesky factor match numpy's smallest and largest eigenvalue of the
    correlation, for a spread spectrum and for one direction 1e-13 below the rest."""
    rng = np.random.default_rng(seed)
    p = 60
    q, _ = np.linalg.qr(rng.standard_normal((p, p)))
    for spectrum in (np.exp(rng.uniform(-6, 3, p)), np.r_[1e-13, rng.uniform(0.5, 2, p - 1)]):
        d = np.exp(rng.uniform(-3, 3, p))  # unequal channel scales: the check is on the correlation
        c = d[:, None] * ((q * spectrum) @ q.T) * d[None, :]
        c = (c + c.T) / 2
        scale = np.sqrt(np.diag(c))
        corr = c / scale[:, None] / scale[None, :]
        ref = np.linalg.eigvalsh(corr)
        ct = torch.from_numpy(c)
        args = torch.from_numpy(corr), torch.linalg.cholesky(ct), torch.from_numpy(scale)
        lo, hi = extreme_eigvals(*args, iters=20)
        assert ref[0] - 1e-12 <= lo <= ref[0] * (1 + 1e-6) + 1e-12, (lo, ref[0])
        # the largest only scales the cutoff: a lower bound within 1 % is plenty
        assert ref[-1] * 0.99 <= hi <= ref[-1] * (1 + 1e-12), (hi, ref[-1])
        # the few iterations the solve runs: still bounds, close enough for the check's margin
        lo, hi = extreme_eigvals(*args)
        assert ref[0] - 1e-12 <= lo <= ref[0] * 10 + 1e-12, (lo, ref[0])
        assert ref[-1] * 0.5 <= hi <= ref[-1] * (1 + 1e-12), (hi, ref[-1])


def _problem(n=400, d_in=12, d_out=9, noise=0.3, seed=0, nonlinear=0.0):
    """Well-conditioned random regression data (numpy float64)."""
    rng = np.random.default_rng(seed)
    mix = np.eye(d_in) + 0.2 * rng.standard_normal((d_in, d_in))
    x = rng.standard_normal((n, d_in)) @ mix + rng.standard_normal(d_in)
    W = rng.standard_normal((d_in, d_out))
    b = rng.standard_normal(d_out)
    y = x @ W + b + noise * rng.standard_normal((n, d_out)) + nonlinear * np.tanh(x[:, :d_out]) ** 2
    return x, y


def _moments(x: np.ndarray, y: np.ndarray, chunk: int | None = None) -> Moments:
    m = Moments(x.shape[1], y.shape[1])
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    step = chunk or x.shape[0]
    for lo in range(0, x.shape[0], step):
        m.update(xt[lo : lo + step], yt[lo : lo + step], compute_dtype=F64)
    return m


def _lstsq_affine(x: np.ndarray, y: np.ndarray):
    """Reference: ordinary least squares with an explicit intercept column."""
    X1 = np.hstack([x, np.ones((x.shape[0], 1))])
    sol, *_ = np.linalg.lstsq(X1, y, rcond=None)
    return sol[:-1], sol[-1]


def _np_r2(y: np.ndarray, pred: np.ndarray) -> float:
    sse = ((y - pred) ** 2).sum()
    sst = ((y - y.mean(0)) ** 2).sum()
    return 1.0 - sse / sst


# -- full-rank solve ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_solve_affine_matches_lstsq(seed):
    x, y = _problem(seed=seed)
    fit = solve_affine(_moments(x, y, chunk=97))
    W_ref, b_ref = _lstsq_affine(x, y)
    assert fit.W.dtype == F64 and fit.W.shape == (12, 9)
    np.testing.assert_allclose(fit.W.numpy(), W_ref, atol=1e-8, rtol=0)
    np.testing.assert_allclose(fit.b.numpy(), b_ref, atol=1e-8, rtol=0)
    assert fit.damping == 0.0 and fit.dead_inputs == 0 and fit.warnings == []
    assert fit.n_fit == 400
    # fit-row SSE / SST are the direct ones
    pred = x @ W_ref + b_ref
    assert fit.fit_sse == pytest.approx(((y - pred) ** 2).sum(), rel=1e-9)
    assert fit.fit_sst == pytest.approx(((y - y.mean(0)) ** 2).sum(), rel=1e-12)


def test_solve_affine_without_rows_raises():
    with pytest.raises(ValueError, match="no calibration rows"):
        solve_affine(Moments(3, 2))


@pytest.mark.parametrize(
    "d_out",
    [
        9,  # odd number of features: the median is the middle value
        10,  # even (every real hidden size): numpy averages the two middle values
    ],
)
def test_heldout_score_matches_numpy(d_out):
    x, y = _problem(n=600, d_out=d_out, seed=2, nonlinear=1.5)
    fit = solve_affine(_moments(x[:400], y[:400]))
    xh, yh = x[400:], y[400:]
    s = score(_moments(xh, yh, chunk=64), fit.W, fit.b)

    pred = xh @ fit.W.numpy() + fit.b.numpy()
    sse_f = ((yh - pred) ** 2).sum(0)
    sst_f = ((yh - yh.mean(0)) ** 2).sum(0)  # about the *held-out* mean
    assert s.r2 == pytest.approx(1.0 - sse_f.sum() / sst_f.sum(), abs=1e-10)
    assert s.sse == pytest.approx(sse_f.sum(), rel=1e-10)
    assert s.sst == pytest.approx(sst_f.sum(), rel=1e-10)
    per_feature = 1.0 - sse_f / sst_f
    assert s.r2_median_feature == pytest.approx(float(np.median(per_feature)), abs=1e-10)
    # held-out R² is worse than the fit-row R² here (the test can tell them apart)
    assert s.r2 < 1.0 - fit.fit_sse / fit.fit_sst


def test_score_of_empty_moments_is_nan():
    s = score(Moments(3, 2), torch.zeros(3, 2, dtype=F64), torch.zeros(2, dtype=F64))
    assert all(math.isnan(v) for v in (s.r2, s.r2_median_feature, s.sse, s.sst))


def test_dead_input_column_gets_zero_weight():
    x, y = _problem(seed=3)
    x[:, 4] = 0.0
    fit = solve_affine(_moments(x, y))
    assert fit.dead_inputs == 1
    assert any("dead input" in w for w in fit.warnings), fit.warnings
    assert torch.all(fit.W[4] == 0)
    assert torch.isfinite(fit.W).all() and torch.isfinite(fit.b).all()
    assert fit.damping == 0.0
    # the live part is still the least-squares solution on the other columns
    live = [i for i in range(12) if i != 4]
    W_ref, b_ref = _lstsq_affine(x[:, live], y)
    np.testing.assert_allclose(fit.W[live].numpy(), W_ref, atol=1e-8)
    np.testing.assert_allclose(fit.b.numpy(), b_ref, atol=1e-8)


def test_small_scale_channel_is_kept_and_null_direction_dropped():
    """A channel 1e-6 × smaller than the others but informative must stay in
    the solve (its raw covariance eigenvalue is ~1e-12 of the largest), while
    an exact redundancy (LayerNorm-style: features sum to zero) is dropped."""
    x, y = _problem(n=600, d_in=10, d_out=6, noise=0.05, seed=7)
    x[:, 3] *= 1e-6
    y[:, 0] += 3e6 * x[:, 3]  # y really depends on the tiny channel
    x = np.hstack([x, -x.sum(1, keepdims=True)])  # exact linear redundancy
    fit = solve_affine(_moments(x, y))
    assert fit.truncated == 1, fit.warnings
    X1 = np.hstack([x, np.ones((x.shape[0], 1))])
    sol, *_ = np.linalg.lstsq(X1, y, rcond=None)
    np.testing.assert_allclose(x @ fit.W.numpy() + fit.b.numpy(), X1 @ sol, atol=1e-6)
    # the tiny channel's weight carries its effect instead of being zeroed
    assert _np_r2(y, x @ fit.W.numpy() + fit.b.numpy()) > 0.99


@pytest.mark.parametrize(
    "n, d_in, seed",
    [
        (6, 12, 4),
        (11, 12, 0),
        (30, 32, 0),
        (6, 8, 6),
        (11, 12, 4),
        (63, 64, 0),
    ],
)
def test_singular_covariance_is_damped_not_nan(n, d_in, seed):
    """Fewer rows than input features: the covariance is singular, so the
    solve must be damped (and say so) and give a finite, near minimum-norm map."""
    x, y = _problem(n=n, d_in=d_in, d_out=5, seed=seed)
    fit = solve_affine(_moments(x, y))
    assert torch.isfinite(fit.W).all() and torch.isfinite(fit.b).all()
    assert torch.isfinite(fit.explained_eigvals).all()
    assert any("underdetermined" in w for w in fit.warnings), fit.warnings
    # rank-deficient directions are dropped (minimum norm); damping only if Cholesky still fails
    assert fit.truncated > 0 or fit.damping > 0
    assert any("rank-deficient" in w or "damped by" in w for w in fit.warnings), fit.warnings
    # the minimum-norm least-squares solution in standardized inputs (what a
    # vanishing ridge on standardized features tends to) interpolates these rows
    xc = x - x.mean(0)
    sd = xc.std(0)
    W_min_norm = (np.linalg.pinv(xc / sd) @ (y - y.mean(0))) / sd[:, None]
    np.testing.assert_allclose(fit.W.numpy(), W_min_norm, atol=1e-3 * np.abs(W_min_norm).max())
    pred = x @ fit.W.numpy() + fit.b.numpy()
    assert _np_r2(y, pred) > 0.99


# -- reduced rank ------------------------------------------------------------


def _rrr_reference(x: np.ndarray, y: np.ndarray, r: int):
    """Reduced-rank regression, independently: full OLS, then project onto the
    top-r right singular vectors of the centred fitted values Ŷ = X̃W."""
    W, _ = _lstsq_affine(x, y)
    xc = x - x.mean(0)
    _, _, Vt = np.linalg.svd(xc @ W, full_matrices=False)
    Vr = Vt[:r].T
    W_r = W @ Vr @ Vr.T
    b_r = y.mean(0) - W_r.T @ x.mean(0)
    return W_r, b_r


@pytest.mark.parametrize("r", [1, 3, 6])
def test_low_rank_matches_reduced_rank_regression(r):
    x, y = _problem(n=500, d_in=12, d_out=9, seed=5)
    m = _moments(x, y)
    fit = solve_affine(m)
    lr = low_rank(fit, m, r)
    assert lr.rank == r and lr.A.shape == (12, r) and lr.B.shape == (r, 9)
    W_r, b_r = _rrr_reference(x, y, r)
    np.testing.assert_allclose(lr.W.numpy(), W_r, atol=1e-8, rtol=0)
    np.testing.assert_allclose(lr.b.numpy(), b_r, atol=1e-8, rtol=0)
    assert np.linalg.matrix_rank(lr.W.numpy(), tol=1e-8) == r


def test_low_rank_at_full_rank_equals_full_fit():
    x, y = _problem(seed=6)
    m = _moments(x, y)
    fit = solve_affine(m)
    lr = low_rank(fit, m, 9)
    assert torch.allclose(lr.W, fit.W, atol=1e-10, rtol=0)
    assert torch.allclose(lr.b, fit.b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("bad", [0, 10, -1])
def test_low_rank_rejects_bad_rank(bad):
    x, y = _problem(seed=6)
    m = _moments(x, y)
    with pytest.raises(ValueError, match="rank must be"):
        low_rank(solve_affine(m), m, bad)


@pytest.mark.parametrize("r", [0, 1, 2, 5, 9])
def test_fit_r2_at_rank_is_the_direct_fit_row_r2(r):
    x, y = _problem(n=500, seed=7)
    m = _moments(x, y)
    fit = solve_affine(m)
    if r == 0:
        pred = np.broadcast_to(y.mean(0), y.shape)  # nothing kept: the mean
    else:
        W_r, b_r = _rrr_reference(x, y, r)
        pred = x @ W_r + b_r
    assert fit_r2_at_rank(fit, r) == pytest.approx(_np_r2(y, pred), abs=1e-10)


@pytest.mark.parametrize("fraction", [0.5, 0.8, 0.9, 0.99])
def test_rank_for_fraction_is_the_smallest_sufficient_rank(fraction):
    # outputs driven by a few strong directions, so the answer varies with the fraction
    rng = np.random.default_rng(8)
    x = rng.standard_normal((800, 12))
    W = rng.standard_normal((12, 9)) * np.array([8, 4, 2, 1, 0.5, 0.3, 0.2, 0.1, 0.05])
    y = x @ W + 0.3 * rng.standard_normal((800, 9))
    fit = solve_affine(_moments(x, y))

    def r2(r):  # direct fit-row R² of the rank-r reduced-rank fit
        if r == 0:
            return _np_r2(y, np.broadcast_to(y.mean(0), y.shape))
        W_r, b_r = _rrr_reference(x, y, r)
        return _np_r2(y, x @ W_r + b_r)

    target = fraction * r2(9)
    r = rank_for_fraction(fit, fraction)
    assert 1 <= r <= 9
    assert r2(r) >= target - 1e-12
    assert r2(r - 1) < target, f"rank {r - 1} already keeps {fraction:.0%}"


def test_rank_for_fraction_one_needs_full_rank_on_isotropic_data():
    x, y = _problem(n=800, seed=9, noise=0.01)
    fit = solve_affine(_moments(x, y))
    assert rank_for_fraction(fit, 1.0) == 9


# -- effective rank ------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 17])
def test_effective_rank_uniform_and_one_hot(k):
    assert effective_rank(torch.full((k,), 2.5)) == pytest.approx(k, rel=1e-12)
    # zeros don't count
    assert effective_rank(torch.cat([torch.ones(k), torch.zeros(5)])) == pytest.approx(k, rel=1e-12)
    one_hot = torch.zeros(k + 4)
    one_hot[k] = 7.0
    assert effective_rank(one_hot) == pytest.approx(1.0, abs=1e-12)


def test_effective_rank_between_extremes_and_of_zero():
    v = torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=F64)
    p = v / v.sum()
    ref = math.exp(-(p * p.log()).sum().item())
    assert effective_rank(v) == pytest.approx(ref, rel=1e-12)
    assert 1.0 < effective_rank(v) < 4.0
    assert effective_rank(torch.zeros(5)) == 0.0


@pytest.mark.parametrize("intercept", [True, False])
def test_shrunk_solve_equals_the_checked_solve_and_ridge_lstsq(intercept):
    """The gate's lean re-solve on ridge statistics gives the checked solve's weights, and both equal
    float64 lstsq with the ridge written out as extra rows toward the prior (a dead column gets 0)."""
    from compressor.fitting.solve import shrunk, solve_linear, solve_shrunk

    rng = np.random.default_rng(3)
    n, p, q, lam = 40, 12, 3, 0.5  # barely more rows than inputs: where the ridge matters
    x = rng.standard_normal((n, p)) @ (np.eye(p) + 0.4 * rng.standard_normal((p, p))) + 2.0
    x[:, 5] = 0.0  # a dead column (a unit that never fires)
    y = x @ rng.standard_normal((p, q)) + 0.5 * rng.standard_normal((n, q)) + 1.0
    prior = rng.standard_normal((p, q))
    m = Moments(p, q)
    m.update(torch.from_numpy(x), torch.from_numpy(y), torch.float64)
    ms = shrunk(m, lam, torch.from_numpy(prior))
    W, b, warnings = solve_shrunk(ms, intercept=intercept)
    ref = (solve_affine if intercept else solve_linear)(ms)
    torch.testing.assert_close(W, ref.W, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(b, ref.b, rtol=1e-9, atol=1e-10)
    assert float(W[5].abs().max()) == 0.0 and any("dead" in w for w in warnings)
    # independent reference: the ridge as rows √(λ dⱼ) eⱼ → √(λ dⱼ) priorⱼ, dⱼ the centred sum of squares
    live = [j for j in range(p) if j != 5]
    d = ((x - x.mean(0)) ** 2).sum(0)
    a = x[:, live] if not intercept else np.concatenate([x[:, live], np.ones((n, 1))], axis=1)
    extra = np.zeros((len(live), a.shape[1]))
    extra[np.arange(len(live)), np.arange(len(live))] = np.sqrt(lam * d[live])
    coef, *_ = np.linalg.lstsq(np.concatenate([a, extra]),
                               np.concatenate([y, np.sqrt(lam * d[live])[:, None] * prior[live]]), rcond=None)
    np.testing.assert_allclose(W[live].numpy(), coef[:len(live)], rtol=1e-8, atol=1e-10)
    if intercept:
        np.testing.assert_allclose(b.numpy(), coef[-1], rtol=1e-8, atol=1e-10)
