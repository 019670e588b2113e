"""Moments (mergeable centred sufficient statistics) and LogHistogram."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressor.core.stats import LogHistogram, Moments, gram

pytestmark = pytest.mark.usefixtures("torch_single_thread")

F64 = torch.float64
FIELDS = ("mx", "my", "cxx", "cxy", "cyy_diag", "cyy")


def _data(n=300, d_in=7, d_out=5, seed=0, offset=0.0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = offset + scale * torch.randn(n, d_in, generator=g, dtype=F64)
    y = x[:, :d_out] * 2.0 - 1.0 + torch.randn(n, d_out, generator=g, dtype=F64)
    return x, y


def _assert_moments_close(a: Moments, b: Moments, atol=1e-10, rtol=1e-10):
    assert a.n == b.n
    assert (a.d_in, a.d_out, a.full_cyy) == (b.d_in, b.d_out, b.full_cyy)
    for f in FIELDS:
        ta, tb = getattr(a, f), getattr(b, f)
        if ta is None or tb is None:
            assert ta is None and tb is None, f
            continue
        assert ta.dtype == F64, f
        assert torch.allclose(ta, tb, rtol=rtol, atol=atol), f


def _numpy_moments(x: torch.Tensor, y: torch.Tensor):
    xn, yn = x.numpy(), y.numpy()
    xc, yc = xn - xn.mean(0), yn - yn.mean(0)
    return dict(mx=xn.mean(0), my=yn.mean(0), cxx=xc.T @ xc, cxy=xc.T @ yc, cyy_diag=(yc**2).sum(0), cyy=yc.T @ yc)


def test_single_pass_matches_numpy():
    x, y = _data()
    m = Moments(7, 5, full_cyy=True)
    m.update(x, y, compute_dtype=F64)
    ref = _numpy_moments(x, y)
    assert m.n == x.shape[0]
    for f, v in ref.items():
        np.testing.assert_allclose(getattr(m, f).numpy(), v, rtol=1e-12, atol=1e-10, err_msg=f)


@pytest.mark.parametrize("full_cyy", [False, True])
def test_merge_of_three_shards_equals_single_pass(full_cyy):
    x, y = _data(n=301)
    single = Moments(7, 5, full_cyy)
    single.update(x, y, compute_dtype=F64)

    # uneven shards, different means per shard (sorted by a column)
    order = torch.argsort(x[:, 0])
    x, y = x[order], y[order]
    cuts = [0, 50, 190, 301]
    shards = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        s = Moments(7, 5, full_cyy)
        s.update(x[lo:hi], y[lo:hi], compute_dtype=F64)
        shards.append(s)
    merged = Moments(7, 5, full_cyy)
    for s in shards:
        merged.merge_(s)
    _assert_moments_close(merged, single)
    # a shard-wise merge differs from any single shard (the test can fail)
    assert not torch.allclose(shards[0].cxx, single.cxx)


def test_add_equals_merge_and_leaves_operands_untouched():
    x, y = _data(n=200, seed=1)
    a = Moments(7, 5, True)
    a.update(x[:80], y[:80], F64)
    b = Moments(7, 5, True)
    b.update(x[80:], y[80:], F64)
    a_before = {f: getattr(a, f).clone() for f in FIELDS}
    b_n = b.n

    summed = a + b
    merged = Moments(7, 5, True)
    merged.merge_(a)
    merged.merge_(b)
    _assert_moments_close(summed, merged, atol=0, rtol=0)
    assert summed.n == 200
    # + must not mutate its operands
    assert a.n == 80 and b.n == b_n
    for f in FIELDS:
        assert torch.equal(getattr(a, f), a_before[f]), f
    # and both orders agree
    _assert_moments_close(b + a, summed)


@pytest.mark.parametrize("d, block", [(5, 8), (16, 8), (50, 8), (51, 7), (64, 16)])
def test_blocked_gram_equals_the_full_product(d, block):
    """Only the blocks on and below the diagonal are multiplied; the rest is their mirror. Checked
    against numpy's full product, at widths that split into 1 (no blocking), 2 and uneven blocks."""
    a = torch.from_numpy(np.random.default_rng(d).standard_normal((40, d)))
    g = gram(a, block=block)
    np.testing.assert_allclose(g.numpy(), a.numpy().T @ a.numpy(), rtol=1e-12, atol=1e-12)


def test_chunked_update_with_blocked_gram_matches_numpy(monkeypatch):
    """Statistics accumulated chunk by chunk with the blocked product (and in-place float32 → float64
    merges) equal numpy's float64 centred sums to float32 rounding."""
    monkeypatch.setattr("compressor.core.stats.GRAM_BLOCK", 8)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 37)) * rng.uniform(0.1, 10, 37) + 5.0
    y = x[:, :6] ** 2 + rng.standard_normal((300, 6))
    m = Moments(37, 6)
    for lo in range(0, 300, 64):
        m.update(torch.from_numpy(x[lo:lo + 64]).float(), torch.from_numpy(y[lo:lo + 64]).float())
    xc, yc = x - x.mean(0), y - y.mean(0)
    assert m.cxx.dtype == torch.float64 and m.n == 300
    np.testing.assert_allclose(m.cxx.numpy(), xc.T @ xc, rtol=1e-5, atol=1e-4 * np.abs(xc.T @ xc).max())
    np.testing.assert_allclose(m.cxy.numpy(), xc.T @ yc, rtol=1e-5, atol=1e-4 * np.abs(xc.T @ yc).max())
    np.testing.assert_allclose(m.cyy_diag.numpy(), (yc * yc).sum(0), rtol=1e-5)


def test_merge_with_empty_is_identity():
    x, y = _data(n=50)
    a = Moments(7, 5)
    a.update(x, y, F64)
    e = Moments(7, 5)
    _assert_moments_close(a + e, a, atol=0, rtol=0)
    _assert_moments_close(e + a, a, atol=0, rtol=0)


def test_merge_shape_mismatch_raises():
    with pytest.raises(ValueError, match="different blocks"):
        Moments(3, 2).merge_(Moments(4, 2))


def test_chunk_centering_keeps_precision_with_huge_means():
    """Means 1e4 × the spread: float32 chunk products must still give the
    float64-accurate centred covariance (naive Σxxᵀ − nμμᵀ in float32 would not)."""
    g = np.random.default_rng(3)
    n, d = 4096, 6
    spread = 1.0
    mean = 1e4 * spread * (1 + g.random(d))
    x64 = mean + spread * g.standard_normal((n, d))
    y64 = x64[:, :3] * 0.5 + spread * g.standard_normal((n, 3))
    x32 = torch.from_numpy(x64).float()
    y32 = torch.from_numpy(y64).float()

    m = Moments(d, 3)
    for lo in range(0, n, 512):  # several chunks, merged with Chan's update
        m.update(x32[lo : lo + 512], y32[lo : lo + 512], compute_dtype=torch.float32)

    # reference: float64 numpy on the *same* float32-rounded values
    xr = x32.double().numpy()
    xc = xr - xr.mean(0)
    ref = xc.T @ xc
    rel = np.abs(m.cxx.numpy() - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel

    # the naive uncentred float32 formula is hopeless at this offset: make sure
    # the comparison above is sensitive enough to tell the two apart
    naive = (x32.T @ x32 - n * torch.outer(x32.mean(0), x32.mean(0))).double().numpy()
    naive_rel = np.abs(naive - ref).max() / np.abs(ref).max()
    assert naive_rel > 100 * rel


def test_sse_matches_direct_residuals():
    x, y = _data(n=120, seed=4)
    m = Moments(7, 5)
    m.update(x, y, F64)
    g = torch.Generator().manual_seed(9)
    W = torch.randn(7, 5, generator=g, dtype=F64)
    b = torch.randn(5, generator=g, dtype=F64)
    direct = ((y - x @ W - b) ** 2).sum(0)
    assert torch.allclose(m.sse(W, b), direct, rtol=1e-10, atol=1e-9)
    c = torch.randn(5, generator=g, dtype=F64)
    assert m.sst(about=c) == pytest.approx(float(((y - c) ** 2).sum()), rel=1e-12)
    assert m.sst() == pytest.approx(float(((y - y.mean(0)) ** 2).sum()), rel=1e-12)


@pytest.mark.parametrize("full_cyy", [False, True])
def test_moments_state_dict_round_trip(full_cyy):
    x, y = _data(n=90, seed=5)
    m = Moments(7, 5, full_cyy)
    m.update(x, y, F64)
    sd = m.state_dict("blk")
    assert ("blk.cyy" in sd) == full_cyy
    back = Moments.from_state_dict(sd, "blk")
    _assert_moments_close(back, m, atol=0, rtol=0)
    # a copy, not a view: mutating the restored object leaves the original alone
    back.cxx += 1
    assert not torch.equal(back.cxx, m.cxx)


# -- LogHistogram -------------------------------------------------------------

BIN = 2 ** (1 / LogHistogram.STEPS_PER_OCTAVE)  # ≈ 1.09: one bin, multiplicatively


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_median_within_one_bin(seed):
    g = np.random.default_rng(seed)
    v = np.exp(g.normal(loc=seed - 1.0, scale=1.5, size=5001))
    h = LogHistogram()
    h.update(torch.from_numpy(v))
    med = np.median(v)
    q = h.quantile(0.5)
    assert med / BIN <= q <= med * BIN, (q, med)
    assert h.total == v.size
    assert h.max == pytest.approx(v.max(), rel=1e-6)
    # other quantiles too
    for p in (0.1, 0.9):
        ref = np.quantile(v, p)
        assert ref / BIN <= h.quantile(p) <= ref * BIN, p


def test_histogram_empty_quantile_is_nan():
    assert np.isnan(LogHistogram().quantile(0.5))


def test_histogram_merge_adds_counts():
    g = np.random.default_rng(7)
    a_vals, b_vals = np.exp(g.normal(size=400)), np.exp(g.normal(2.0, size=700))
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    a.update(torch.from_numpy(a_vals))
    b.update(torch.from_numpy(b_vals))
    both.update(torch.from_numpy(np.concatenate([a_vals, b_vals])))
    a_counts = a.counts.clone()
    a.merge_(b)
    assert torch.equal(a.counts, a_counts + b.counts)
    assert torch.equal(a.counts, both.counts)
    assert a.total == 1100
    assert a.max == both.max


def test_histogram_state_dict_round_trip():
    h = LogHistogram()
    h.update(torch.tensor([0.5, 1.0, 3.0, 1e3]))
    back = LogHistogram.from_state_dict(h.state_dict("norms"), "norms")
    assert torch.equal(back.counts, h.counts)
    assert back.max == h.max == pytest.approx(1e3)
    assert back.quantile(0.5) == h.quantile(0.5)
    back.update(torch.tensor([2.0]))
    assert back.total == h.total + 1  # independent copy
