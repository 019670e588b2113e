"""Snapping a re-solved map onto the output file's GGML grid (compressor.fitting.snap), checked against
an independent reference: the group OBS update computed with explicit inverses of the remaining
columns' covariance, and ggml's own decoder for the bytes kept."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

from compressor.core import ggml  # noqa: E402
from compressor.fitting.snap import DAMP, importance, snap  # noqa: E402


def problem(k: int = 128, d_out: int = 24, n: int = 2048, seed: int = 0):
    """Correlated regressors (so compensation has something to do) and a linear target."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, k, generator=g, dtype=torch.float64) @ (torch.randn(k, k, generator=g, dtype=torch.float64) / k ** 0.5)
    X = X * torch.rand(k, generator=g, dtype=torch.float64) * 3 + 0.5
    W = torch.randn(d_out, k, generator=g, dtype=torch.float64) * 0.05
    Y = X @ W.T
    mx, my = X.mean(0), Y.mean(0)
    cov = (X - mx).T @ (X - mx) / n
    return X, Y, W, cov, mx, my


def naive(W, cov, qtype):
    """Group OBS the slow way: each group rounded by ggml (weighted by the variance), its error moved onto
    the remaining columns through the explicit inverse of their damped covariance."""
    W = W.clone()
    k = W.shape[1]
    block = ggml.BLOCKS[qtype][0]
    H = cov + DAMP * float(torch.diagonal(cov).mean()) * torch.eye(k, dtype=torch.float64)
    weights = importance(cov)
    for s in range(0, k, block):
        g = slice(s, s + block)
        q = torch.from_numpy(ggml.roundtrip(W[:, g].float().numpy(), qtype, weights[g])).double()
        err = W[:, g] - q
        W[:, g] = q
        if s + block < k:
            Hinv = torch.linalg.inv(H[s:, s:])  # the remaining columns' inverse covariance
            W[:, s + block:] -= err @ torch.linalg.solve(Hinv[:block, :block], Hinv[:block, block:])
    return W


def fit_error(X, Y, W, b):
    return float(((X @ W.T + b - Y) ** 2).mean() / Y.var(0).mean())


@pytest.mark.parametrize("qtype", [ggml.GGMLType.Q8_0, ggml.GGMLType.Q4_1, ggml.GGMLType.Q4_0])
def test_snap_is_the_group_obs_update(qtype):
    X, Y, W, cov, mx, my = problem()
    Wq, _, _ = snap(W, cov, mx, my, qtype)
    ref = naive(W, cov, qtype)
    # the same arithmetic up to float rounding; a rounding step can land on the neighbouring grid point
    # where the two disagree at the 1e-12 level, so compare in bulk
    assert (Wq - ref).abs().le(1e-6).float().mean() > 0.99


@pytest.mark.parametrize("qtype", [ggml.GGMLType.Q4_1, ggml.GGMLType.Q4_K, ggml.GGMLType.Q6_K])
def test_the_kept_bytes_are_the_snapped_values_and_cost_less_than_rounding(qtype):
    X, Y, W, cov, mx, my = problem(k=512)
    Wq, b, raw = snap(W, cov, mx, my, qtype)
    assert raw.dtype == np.uint8 and raw.shape == (W.shape[0], ggml.bytes_per_row(qtype, W.shape[1]))
    assert np.array_equal(ggml.dequantize(raw, qtype, W.shape[1]), Wq.float().numpy())  # the file's values
    assert torch.allclose(b, my - Wq @ mx)  # the intercept re-solved for the snapped weights
    plain = torch.from_numpy(ggml.roundtrip(W.float().numpy(), qtype)).double()
    weighted = torch.from_numpy(ggml.roundtrip(W.float().numpy(), qtype, importance(cov))).double()
    e_plain, e_weighted = fit_error(X, Y, plain, my - plain @ mx), fit_error(X, Y, weighted, my - weighted @ mx)
    e_snap = fit_error(X, Y, Wq, b)
    assert e_snap < 0.8 * e_weighted and e_weighted <= e_plain * 1.02


def test_a_width_that_is_not_whole_blocks_is_refused():
    _, _, W, cov, mx, my = problem(k=48)
    with pytest.raises(ValueError, match="not a whole number of Q4_1 blocks of 32"):
        snap(W, cov, mx, my, ggml.GGMLType.Q4_1)


def test_a_map_wider_than_the_compensation_limit_is_rounded_with_the_importance_matrix(monkeypatch):
    from compressor.fitting import snap as snap_module

    _, _, W, cov, mx, my = problem(k=128)
    monkeypatch.setattr(snap_module, "MAX_COMPENSATED_UNITS", 64)
    Wq, _, raw = snap(W, cov, mx, my, ggml.GGMLType.Q4_1)
    weights = importance(cov)
    # group by group, as the snap quantizes (ggml's weighting reads the statistics of the row it is given)
    rounded = np.concatenate([ggml.roundtrip(W[:, s:s + 32].float().numpy(), ggml.GGMLType.Q4_1, weights[s:s + 32])
                              for s in range(0, 128, 32)], axis=1)
    assert np.array_equal(Wq.float().numpy(), rounded)
    assert np.array_equal(ggml.dequantize(raw, ggml.GGMLType.Q4_1, 128), rounded)
