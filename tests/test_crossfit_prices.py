"""Cross-fitted prices of error-compensating rounding (:meth:`compressor.sizing.sites.Site.fit_pairs`).

GPTQ chooses its codes to make ``ΔW Ĥ ΔWᵀ`` small under the Ĥ it is given, so the same Ĥ prices it too well,
most where it has freedom the calibration did not constrain (more inputs than tokens). Priced on the half of
the windows the fit did not see, the price must land nearer the error on fresh tokens than the in-sample one.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressor.fitting.gridround import factor
from compressor.output.ctensors.grids import SCHEMES, gptq
from compressor.output.ctensors.target import price_layer
from compressor.pipeline.size.prices import mean_moments
from compressor.sizing.sites import Site


def _moments(x: torch.Tensor) -> torch.Tensor:
    return (x.T @ x) / x.shape[0]


def _layer(tokens_per_half: int, n_in: int = 256, n_out: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g) / n_in ** 0.5 + torch.eye(n_in)  # correlated inputs
    draw = lambda n: torch.randn(n, n_in, generator=g) @ mix  # noqa: E731
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    a, b, fresh = _moments(draw(tokens_per_half)), _moments(draw(tokens_per_half)), _moments(draw(20000))
    return w, a, b, fresh


def _site(w, h, folds=None) -> Site:
    return Site("l", "l", w, h, torch.ones(w.shape[0]), np.ones(w.shape[1], dtype=np.float32), folds=folds)


def test_the_cross_fitted_price_is_the_mean_of_each_half_fitted_and_priced_on_the_other():
    w, a, b, _ = _layer(200)
    site = _site(w, (a + b) / 2, (a, b))
    got = price_layer(site, "gptq", torch.float32)["W4A16_CH"][1]
    s = SCHEMES["W4A16_CH"]
    want = 0.0
    for fit, on in ((a, b), (b, a)):
        d = (gptq(w, factor(fit, act_order=True), s, scale_dtype=torch.float32, act_order=True,
                  static_groups=True).weight - w).double().numpy()
        want += 0.5 * 0.5 * float(np.einsum("oi,ij,oj->", d, on.double().numpy(), d))  # ½ Σ_o F_o (ΔW Ĥ ΔWᵀ)_oo
    assert got == pytest.approx(want, rel=1e-5)


def test_with_fewer_tokens_than_inputs_the_cross_fitted_price_is_nearer_the_error_on_fresh_tokens():
    for seed in range(3):
        w, a, b, fresh = _layer(96, seed=seed)  # 192 tokens in all for 256 inputs: Ĥ is rank-deficient
        h = (a + b) / 2
        s = SCHEMES["W4A16_CH"]
        d = gptq(w, factor(h, act_order=True), s, scale_dtype=torch.float32, act_order=True,
                 static_groups=True).weight - w
        true = _site(w, fresh).cost(d)  # what the rounding the plan will apply costs on tokens it never saw
        in_sample = price_layer(_site(w, h), "gptq", torch.float32)["W4A16_CH"][1]
        crossed = price_layer(_site(w, h, (a, b)), "gptq", torch.float32)["W4A16_CH"][1]
        assert in_sample < 0.5 * true  # the optimism this removes is real here
        assert abs(crossed - true) < abs(in_sample - true)


def test_round_to_nearest_is_priced_on_all_windows_as_before():
    w, a, b, _ = _layer(200)
    h = (a + b) / 2
    assert price_layer(_site(w, h, (a, b)), "nearest", torch.float32) == price_layer(_site(w, h), "nearest",
                                                                                     torch.float32)


def test_the_mean_of_the_halves_weights_them_by_their_windows_and_keeps_shared_matrices_shared():
    q = torch.ones(2, 2)
    even = {"q": q, "k": q, "down": torch.zeros(2, 2)}
    odd_q = torch.full((2, 2), 4.0)
    odd = {"q": odd_q, "k": odd_q, "down": torch.ones(2, 2)}
    full = mean_moments(even, odd, 3)  # windows 0 and 2 are even, 1 odd
    assert torch.allclose(full["q"], torch.full((2, 2), 2 / 3 * 1 + 1 / 3 * 4))
    assert full["q"] is full["k"]
    assert torch.allclose(full["down"], torch.full((2, 2), 1 / 3))
