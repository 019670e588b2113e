"""GPTQ rounding onto ggml's own grids (compressor.fitting.gridround), checked against independent
references: gguf-py's decoder at every code (the brute-force grid), the conditional optimum of each
column computed by an explicit solve, ggml's own C decoder (what llama.cpp runs) and a written GGUF."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

from compressor.core import ggml  # noqa: E402
from compressor.core.ggml import BLOCKS, GGMLType  # noqa: E402
from compressor.fitting import gridround as gr  # noqa: E402

TYPES = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
         GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS]
#: Types of 3–4 bits a weight, where rounding matters most: GPTQ must clearly beat ggml there.
LOW_BITS = {GGMLType.Q3_K, GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS}


def problem(rows: int = 32, n: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Weights and an input second moment with strongly correlated columns (a mixing matrix, a component
    shared by all columns, very different column scales)."""
    g = np.random.default_rng(seed)
    X = g.standard_normal((4 * n, n)) @ (g.standard_normal((n, n)) / n ** 0.5 + 0.5 * np.eye(n))
    X = (X + g.standard_normal((4 * n, 1))) * g.uniform(0.2, 3.0, n)
    return (g.standard_normal((rows, n)) * 0.05).astype(np.float32), X.T @ X / X.shape[0]


def imatrix(H: np.ndarray) -> np.ndarray:
    return np.diag(H).astype(np.float32)


def every_level(raw: np.ndarray, t: GGMLType, n: int) -> np.ndarray:
    """``[codes, rows, n]``: gguf-py's decoding of every element at every code, ggml's scales kept."""
    lay = gr.layout(t)
    return np.stack([ggml.dequantize(lay.pack(raw, c), t, n) for c in range(2 ** lay.width)])


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_every_listed_type_is_supported(t):
    assert gr.supports(t) is None


@pytest.mark.parametrize("t", [GGMLType.IQ2_XXS, GGMLType.IQ3_S, GGMLType.F16], ids=lambda t: t.name)
def test_types_without_a_per_element_grid_are_refused_by_name(t):
    why = gr.supports(t)
    assert why is not None and t.name in why
    W, H = problem(rows=2, n=256)
    if gr.rounds_blockwise(t):  # codebook types are compensated block by block instead (test_blockwise_gptq.py)
        assert np.array_equal(gr.gptq_quantize(W, H, t, imatrix(H)), gr.blockwise_quantize(W, H, t, imatrix(H)))
        return
    with pytest.raises(ValueError, match=t.name):
        gr.gptq_quantize(W, H, t, imatrix(H))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_codes_round_trip_and_the_grid_is_ggml_decoder(t):
    W, H = problem(rows=8, n=512)
    lay = gr.layout(t)
    raw = ggml.quantize(W, t, imatrix(H))
    codes = lay.unpack(raw)
    assert codes.shape == W.shape and codes.max() < 2 ** lay.width
    assert np.array_equal(lay.pack(raw, codes), raw)
    base, step = lay.grid(raw, W.shape[1])
    assert np.array_equal(lay.values(base, step, codes), ggml.dequantize(raw, t, W.shape[1]))
    # any codes: only code bits change, and the model still is the decoder
    other = np.random.default_rng(1).integers(0, 2 ** lay.width, size=W.shape)
    moved = lay.pack(raw, other)
    assert np.array_equal(lay.unpack(moved), other)
    assert np.array_equal(lay.pack(moved, codes), raw)
    assert np.array_equal(lay.values(base, step, other), ggml.dequantize(moved, t, W.shape[1]))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_a_row_that_is_not_whole_blocks_is_refused_with_the_block_size(t):
    block = BLOCKS[t][0]
    W, H = problem(rows=2, n=block + block // 2)
    with pytest.raises(ValueError, match=f"{t.name} blocks of {block}"):
        gr.gptq_quantize(W, H, t, imatrix(H))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_without_correlation_every_code_is_the_nearest_level(t):
    """H diagonal (no correlation, act-order still reorders): nothing to compensate, so GPTQ rounds
    every element to its nearest level, found here by brute force over every code."""
    W, _ = problem(rows=8, n=256)
    H = np.diag(np.random.default_rng(2).uniform(0.1, 4.0, W.shape[1]))
    raw = gr.gptq_quantize(W, H, t, imatrix(H))
    got = gr.dequantize(raw, t, W.shape)
    levels = every_level(raw, t, W.shape[1])
    nearest = np.abs(levels - W).min(0)
    assert np.all(np.abs(got - W) <= nearest + 1e-6 * np.abs(W).max())


def conditional_targets(W, Q, H, order, damp, positions):
    """The value of column ``order[p]`` minimising the (damped) output error with the columns rounded
    before it fixed at ``Q`` and those after it free, by an explicit solve: what GPTQ rounds."""
    n = W.shape[1]
    Hp = H[np.ix_(order, order)].copy()
    dead = ~(np.diag(Hp) > 0)
    Hp[dead, dead] = 1.0
    Hp += damp * np.diag(Hp).mean() * np.eye(n)
    delta = (W - Q).astype(np.float64)[:, order]
    out = {}
    for p in positions:
        free = -np.linalg.solve(Hp[p:, p:], Hp[p:, :p] @ delta[:, :p].T)  # [n - p, rows]
        out[p] = W[:, order[p]] - free[0]
    return out


@pytest.mark.parametrize("act_order", [True, False], ids=["act_order", "natural"])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_each_column_is_rounded_at_its_conditional_optimum(t, act_order):
    """GPTQ's guarantee: column ``j``'s codes are the nearest levels to the error-minimising value of
    column ``j`` given the columns rounded before it (and the rest free). For the last column that is exact
    coordinate-wise optimality. (A single-element change can still lower the total error elsewhere: the
    earlier columns were chosen before the later ones were rounded; GPTQ is greedy, not a local optimum.)"""
    W, H = problem(rows=6, n=256, seed=3)
    H[:, 7] = H[7, :] = 0  # a dead column
    raw = gr.gptq_quantize(W, H, t, imatrix(H), act_order=act_order, block=64)
    Q = gr.dequantize(raw, t, W.shape)
    order = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(W.shape[1])
    positions = [0, 1, 2, 31, 63, 64, 65, 127, 128, 200, 254, 255, int(np.flatnonzero(order == 7)[0])]
    targets = conditional_targets(W, Q, H, order, gr.DAMP, positions)
    levels = every_level(raw, t, W.shape[1])
    for p, x in targets.items():
        j = order[p]
        step = np.abs(levels[1, :, j] - levels[0, :, j])
        best = np.abs(levels[:, :, j] - x).min(0)
        assert np.all(np.abs(Q[:, j] - x) <= best + 1e-3 * step + 1e-7), (p, j)
    assert np.allclose(targets[int(np.flatnonzero(order == 7)[0])], W[:, 7])  # nothing reaches a dead column


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_gptq_beats_ggml_rounding_on_correlated_inputs(t):
    W, H = problem()
    w = imatrix(H)
    ggml_err = gr.output_error(W, ggml.roundtrip(W, t, w), H)
    ratio = {ao: gr.output_error(W, gr.dequantize(gr.gptq_quantize(W, H, t, w, act_order=ao), t, W.shape), H)
             / ggml_err for ao in (True, False)}
    assert ratio[True] < (0.5 if t in LOW_BITS else 0.6), ratio
    assert ratio[False] < 0.75, ratio


def test_a_shared_factor_gives_the_same_bytes_and_must_match_the_call():
    W, H = problem(rows=4, n=256)
    f = gr.factor(H)
    assert np.array_equal(gr.gptq_quantize(W, f, GGMLType.Q4_K, imatrix(H)),
                          gr.gptq_quantize(W, H, GGMLType.Q4_K, imatrix(H)))
    with pytest.raises(ValueError, match="act_order"):
        gr.gptq_quantize(W, f, GGMLType.Q4_K, imatrix(H), act_order=False)
    with pytest.raises(ValueError, match=r"\[256, 256\]"):
        gr.gptq_quantize(W, H[:128, :128], GGMLType.Q4_K, imatrix(H))


def test_many_types_in_one_pass_give_each_type_its_own_bytes():
    """Pricing rounds a tensor in every type in one pass of the column loop: affine types of 2–8 bits
    searched together (capped at each one's top code), IQ4's table apart, Q8_0's signed codes apart. Each
    type's bytes must be exactly those it gets alone, and each column still at its conditional optimum."""
    W, H = problem(rows=6, n=256, seed=5)
    f = gr.factor(H)
    many = gr.gptq_quantize_many(W, f, TYPES, imatrix(H), block=64)
    assert len(many) == len(TYPES)
    order = np.argsort(-np.diag(H), kind="stable")
    for t, raw in zip(TYPES, many):
        assert np.array_equal(raw, gr.gptq_quantize(W, f, t, imatrix(H), block=64)), t.name
        Q = gr.dequantize(raw, t, W.shape)
        levels = every_level(raw, t, W.shape[1])
        for p, x in conditional_targets(W, Q, H, order, gr.DAMP, [0, 65, 255]).items():
            j = order[p]
            step = np.abs(levels[1, :, j] - levels[0, :, j])
            assert np.all(np.abs(Q[:, j] - x) <= np.abs(levels[:, :, j] - x).min(0) + 1e-3 * step + 1e-7), (t, p)
    assert gr.gptq_quantize_many(W, f, [], imatrix(H)) == []


def test_a_large_tensor_is_rounded_in_chunks_of_rows_to_the_same_bytes(monkeypatch):
    """Rows are independent (per-row scales, error carried along a row): rounded a few rows at a time, to
    bound memory on an output head of 152k rows, every byte is the same."""
    W, H = problem(rows=7, n=256, seed=6)
    f = gr.factor(H)
    types = [GGMLType.Q4_K, GGMLType.IQ4_NL]
    whole = gr.gptq_quantize_many(W, f, types, imatrix(H))
    monkeypatch.setattr(gr, "CHUNK_ELEMENTS", 2 * 256 * len(types))  # two rows a chunk, the last one alone
    chunked = gr.gptq_quantize_many(W, f, types, imatrix(H))
    assert all(np.array_equal(a, b) for a, b in zip(whole, chunked))
    assert chunked[0].shape == (7, ggml.bytes_per_row(GGMLType.Q4_K, 256))
    with pytest.raises(ValueError, match="Q4_K"):
        gr.gptq_quantize_many(W[:, :224], H[:224, :224], [GGMLType.Q4_0, GGMLType.Q4_K], imatrix(H[:224, :224]))


def test_output_error_is_the_trace_form():
    g = np.random.default_rng(4)
    W, A = g.standard_normal((3, 5)), g.standard_normal((3, 5))
    H = g.standard_normal((5, 5))
    H = H @ H.T
    assert np.isclose(gr.output_error(W, A, H), np.trace((A - W) @ H @ (A - W).T))


def _ggml_decode(raw: np.ndarray, t: GGMLType, shape: tuple[int, int]) -> np.ndarray:
    """ggml's own C decoder from llama.cpp's libggml (``dequantize_row_*``, what its CPU backend runs)."""
    import llama_cpp._ggml as ggml_lib

    fn = getattr(ggml_lib.libggml, "dequantize_row_" + t.name.lower().replace("_k", "_K"), None)
    if fn is None:
        pytest.skip(f"this libggml does not export dequantize_row for {t.name}")
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    src = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty(shape, dtype=np.float32)
    fn(src.ctypes.data, out.ctypes.data, out.size)
    return out


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_the_bytes_load_from_a_gguf_as_llama_cpp_reads_them(tmp_path, t):
    import gguf

    W, H = problem(rows=4, n=256)
    raw = gr.gptq_quantize(W, H, t, imatrix(H))
    assert np.array_equal(raw & ~_scale_free_mask(t, raw.shape), ggml.quantize(W, t, imatrix(H))
                          & ~_scale_free_mask(t, raw.shape))  # every scale byte as ggml wrote it
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf.GGMLQuantizationType(int(t)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    assert [int(d) for d in tensor.shape] == [W.shape[1], W.shape[0]]
    stored = np.asarray(tensor.data).reshape(raw.shape)
    assert np.array_equal(stored, raw)
    expect = gr.dequantize(raw, t, W.shape)
    assert np.array_equal(np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(W.shape), expect)
    assert np.array_equal(_ggml_decode(stored, t, W.shape), expect)


def _scale_free_mask(t: GGMLType, shape: tuple[int, int]) -> np.ndarray:
    """The code bits of raw bytes of ``shape``, set."""
    lay = gr.layout(t)
    zeros = np.zeros(shape, dtype=np.uint8)
    return lay.pack(zeros, np.full((shape[0], shape[1] // lay.nbytes * lay.block), 2 ** lay.width - 1))


def test_shared_factors_solve_each_matrix_once_and_keep_it_within_the_bytes(monkeypatch):
    """One solve per Ĥ however many tensors (and threads) ask for it, released after the last expected ask, or kept
    for a later round within ``keep_bytes``; the factor is :func:`factor`'s."""
    from concurrent.futures import ThreadPoolExecutor

    real, calls = gr.factor, []
    monkeypatch.setattr(gr, "factor", lambda h, **kw: calls.append(id(h)) or real(h, **kw))
    g = np.random.default_rng(3)
    x1, x2 = g.standard_normal((64, 16)), g.standard_normal((64, 16))
    h1, h2 = x1.T @ x1, x2.T @ x2
    shared = gr.SharedFactors([h1, h1, h1, h2])
    got = [shared.get(h1) for _ in range(3)]
    assert got[0] is got[1] is got[2] and calls == [id(h1)]
    assert np.array_equal(got[0].r, real(h1).r) and np.array_equal(got[0].order, real(h1).order)
    shared.get(h2)
    assert calls == [id(h1), id(h2)] and not shared._entries  # all released
    shared.get(h1)  # not expected any more: solved again, not kept
    assert calls.count(id(h1)) == 2 and not shared._entries
    kept = gr.SharedFactors([h1], keep_bytes=1 << 20)
    first = kept.get(h1)
    kept.expect([h1])
    assert kept.get(h1) is first and kept.kept_bytes == first.r.nbytes
    small = gr.SharedFactors([h1], keep_bytes=16)
    small.get(h1)
    assert not small._entries and small.kept_bytes == 0
    calls.clear()
    many = gr.SharedFactors([h2] * 8)
    with ThreadPoolExecutor(4) as pool:
        made = list(pool.map(many.get, [h2] * 8))
    assert all(m is made[0] for m in made) and calls == [id(h2)]


def test_shared_factors_beyond_the_bytes_go_to_disk_and_are_handed_over(tmp_path, caplog):
    """With ``spill``, a factor over ``keep_bytes`` is written and mapped back (file pages, the same numbers),
    kept for the rounding; :meth:`take` hands it over and forgets it with its Ĥ. A full disk is said once, and
    the factors are then solved again, not kept."""
    g = np.random.default_rng(5)
    x1, x2 = g.standard_normal((64, 16)), g.standard_normal((64, 24))
    h1, h2 = x1.T @ x1, x2.T @ x2
    written = []

    def spill(f):
        written.append(tmp_path / f"f{len(written)}.npy")
        return gr.spill_factor(f, written[-1])

    shared = gr.SharedFactors([h1, h1, h2], spill=spill)
    a, b = shared.get(h1), shared.get(h1)
    assert a is b and len(written) == 1 and not isinstance(a.r, np.memmap)  # the caller's own
    kept = shared.take(h1)
    assert isinstance(kept.r, np.memmap) and np.array_equal(kept.r, gr.factor(h1).r)
    assert np.array_equal(kept.order, a.order) and (kept.damp, kept.act_order) == (a.damp, a.act_order)
    assert shared.take(h1) is None and id(h1) not in shared._entries
    assert shared.get(kept) is kept  # a factor is its own
    assert shared.take(h2) is None  # expected, never asked: nothing kept

    def full(f):
        raise OSError(28, "No space left on device")

    broke = gr.SharedFactors([h1, h2], spill=full)
    with caplog.at_level("WARNING"):
        broke.get(h1)
        broke.get(h2)
    assert broke.take(h1) is None and broke.take(h2) is None and broke.spill is None
    assert sum("no longer kept on disk" in r.message for r in caplog.records) == 1


def test_factor_is_the_damped_cholesky_in_rounding_order_that_gptq_reads():
    """R̂ is unit upper triangular, and it is GPTQ's textbook factor by another route: the upper Cholesky factor U
    of the damped Ĥ's inverse (float64, in rounding order) has ``U⁻¹ = R`` with ``R̂ = R / diag(R)`` column by
    column; a dead column (Ĥ_jj = 0) is set to 1 before damping, as GPTQ does."""
    import torch

    from compressor.fitting import gridround

    g = torch.Generator().manual_seed(3)
    n = 300
    x = torch.randn(n + 64, n, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, n, dtype=torch.float64)
    h = x.T @ x / x.shape[0]
    h[:, 11] = h[11, :] = 0
    f = gridround.factor(h.float())
    o = torch.from_numpy(f.order)
    hd = h.float().double()[o][:, o]
    hd.diagonal()[hd.diagonal() == 0] = 1.0
    hd.diagonal().add_(f.damp * float(hd.diagonal().mean()))
    r = torch.from_numpy(f.r).double()
    assert f.r.dtype == np.float32 and torch.equal(r, torch.triu(r)) and torch.equal(r.diagonal(), torch.ones(n))
    u = torch.linalg.cholesky(torch.linalg.inv(hd), upper=True)
    ref = torch.linalg.inv(u)
    ref = ref / ref.diagonal()
    assert torch.allclose(r, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_factor_falls_back_to_float64_where_float32_finds_no_cholesky():
    """The Cholesky is float32 as GPTQ implementations take it; an Ĥ positive definite only in float64 (here: one
    strong direction over a floor 10⁻¹⁰ of it, undamped) is factored in float64 instead of refused, and an Ĥ not
    positive definite at all is refused naming the damping."""
    import torch

    n = 64
    g = torch.Generator().manual_seed(4)
    v = torch.randn(n, 1, generator=g, dtype=torch.float64)
    h = v @ v.T + 1e-10 * torch.eye(n, dtype=torch.float64)
    assert int(torch.linalg.cholesky_ex(h.float())[1]) != 0 and int(torch.linalg.cholesky_ex(h)[1]) == 0
    f = gr.factor(h, damp=0.0)
    assert np.isfinite(f.r).all() and np.allclose(np.diag(f.r), 1.0)
    with pytest.raises(ValueError, match="larger damp"):
        gr.factor(-torch.eye(n, dtype=torch.float64) + 0.5 * (v @ v.T), damp=0.0)


def test_given_scales_give_the_bytes_quantized_here_in_chunks_too(monkeypatch):
    """Pricing hands GPTQ ggml's bytes of the rows it already quantized (``quantized=``): only their scales are
    read, so the codes are those GPTQ gets quantizing the rows itself, whole or a few rows a chunk; bytes for the
    wrong rows are refused."""
    W, H = problem(rows=7, n=256, seed=8)
    f = gr.factor(H)
    types = [GGMLType.Q4_K, GGMLType.IQ4_XS, GGMLType.Q3_K]
    given = [ggml.quantize(W, t, imatrix(H)) for t in types]
    alone = gr.gptq_quantize_many(W, f, types, imatrix(H))
    assert all(np.array_equal(a, b) for a, b in zip(alone, gr.gptq_quantize_many(W, f, types, imatrix(H),
                                                                                 quantized=given)))
    monkeypatch.setattr(gr, "CHUNK_ELEMENTS", 2 * 256 * len(types))
    chunked = gr.gptq_quantize_many(W, f, types, imatrix(H), quantized=given)
    assert all(np.array_equal(a, b) for a, b in zip(alone, chunked))
    with pytest.raises(ValueError, match="all 7 rows"):
        gr.gptq_quantize_many(W, f, types, imatrix(H), quantized=[q[:3] for q in given])


def test_a_non_finite_moment_is_refused_as_such_not_as_a_damping_problem():
    """A NaN in Ĥ (activations that overflowed) names the cause; more damping would not help it."""
    _, H = problem(rows=2, n=64)
    H = H.copy()
    H[3, 5] = H[5, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        gr.factor(H)
