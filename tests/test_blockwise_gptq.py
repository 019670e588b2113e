"""Block-wise error-compensating rounding of the codebook i-quants (IQ1_*, IQ2_*, IQ3_*), priced and written.

ggml quantizes each 256-column block of a row as it stands once the blocks before it have carried their error
onto it through Ĥ's factor (:func:`compressor.fitting.gridround.blockwise_quantize`). On inputs that are strongly
correlated it lowers the Ĥ-weighted output error against ggml's nearest rounding at the same bytes; through a wrong
factor it does not. Pricing offers it as the type's compensated option, the plan's rounding makes the same bytes,
and the file holds them and decodes (gguf-py) to the values the price was computed from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressor.core.ggml import GGMLType

gguf = pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")
from compressor.core import ggml  # noqa: E402
from compressor.fitting import gridround as gr  # noqa: E402

BLOCKWISE_TYPES = [t for t in GGMLType if gr.rounds_blockwise(t)]


def correlated(n: int, seed: int, rank: int = 24, noise: float = 0.3) -> np.ndarray:
    """Ĥ of inputs that mostly live in a few directions (every column correlated with every block)."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((8 * n, rank)) @ g.standard_normal((rank, n)) + noise * g.standard_normal((8 * n, n))
    return (x.T @ x / x.shape[0]).astype(np.float32)


def problem(rows: int = 24, n: int = 768, seed: int = 0):
    g = np.random.default_rng(seed + 100)
    h = correlated(n, seed)
    w = (g.standard_normal((rows, n)) * 0.05).astype(np.float32)
    return w, h, (np.diag(h) / np.diag(h).max()).astype(np.float32)


def error(w, raw, t, h) -> float:
    return gr.output_error(w, ggml.dequantize(raw, t, w.shape[1]), h)


def test_the_codebook_types_are_the_blockwise_ones():
    assert {t.name for t in BLOCKWISE_TYPES} >= {"IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"}
    assert not any(gr.rounds_blockwise(t) for t in (GGMLType.Q4_K, GGMLType.IQ4_XS, GGMLType.Q4_0, GGMLType.F16))
    assert gr.rounds_blockwise("IQ2_XS") and not gr.rounds_blockwise("W4A16")  # another format's scheme name


@pytest.mark.parametrize("t", BLOCKWISE_TYPES, ids=lambda t: t.name)
def test_blockwise_lowers_the_output_error_against_nearest(t):
    w, h, imat = problem()
    nearest = ggml.quantize(w, t, imat)
    raw = gr.blockwise_quantize(w, h, t, imat)
    assert raw.shape == nearest.shape and raw.dtype == np.uint8  # the same bytes
    assert error(w, raw, t, h) < 0.8 * error(w, nearest, t, h)
    # the column-GPTQ entry point rounds these types block by block, whatever is rounded beside them
    both = gr.gptq_quantize_many(w, h, [GGMLType.Q4_K, t], imat)
    assert np.array_equal(both[1], raw)
    assert np.array_equal(both[0], gr.gptq_quantize(w, h, GGMLType.Q4_K, imat))


@pytest.mark.parametrize("t", [GGMLType.IQ2_XS, GGMLType.IQ3_S], ids=lambda t: t.name)
def test_a_wrong_factor_raises_the_error(t):
    """The identity's factor moves no error: ggml's own bytes, whose error the right factor beats; the factor of
    another Ĥ moves the error along directions the inputs do not take, and loses to the right one."""
    w, h, imat = problem()
    right = error(w, gr.blockwise_quantize(w, h, t, imat, weights="imatrix"), t, h)
    eye = gr.blockwise_quantize(w, np.eye(w.shape[1], dtype=np.float32), t, imat, weights="imatrix")
    assert np.array_equal(eye, ggml.quantize(w, t, imat))
    assert error(w, eye, t, h) > 1.5 * right
    other = gr.blockwise_quantize(w, correlated(w.shape[1], seed=7), t, imat, weights="imatrix")
    assert error(w, other, t, h) > 1.5 * right


def test_a_factor_without_its_blockwise_factor_is_refused():
    w, h, imat = problem(rows=2, n=512)
    with pytest.raises(ValueError, match="blockwise=True"):
        gr.blockwise_quantize(w, gr.factor(h), GGMLType.IQ2_XS, imat)
    with pytest.raises(ValueError, match="256-element blocks"):
        gr.blockwise_quantize(w[:, :288], correlated(288, 0), GGMLType.IQ2_XS, None)
    f = gr.factor(h, blockwise=True)
    assert np.array_equal(gr.blockwise_quantize(w, f, GGMLType.IQ2_XS, imat),
                          gr.blockwise_quantize(w, h, GGMLType.IQ2_XS, imat))


def test_shared_factors_add_the_blockwise_factor_and_spill_it(tmp_path):
    h = torch.from_numpy(correlated(512, 3))
    shared = gr.SharedFactors([h, h], keep_bytes=1 << 30)
    first = shared.get(h)
    assert first.blockwise is None
    second = shared.get(h, blockwise=True)
    assert second.blockwise is not None and np.array_equal(second.r, first.r)
    assert shared.kept_bytes == second.nbytes == first.r.nbytes + second.blockwise.r.nbytes
    spilled = gr.spill_factor(second, tmp_path / "f.npy")
    w, _, imat = problem(rows=4, n=512)
    assert np.array_equal(gr.blockwise_quantize(w, spilled, GGMLType.IQ3_S, imat),
                          gr.blockwise_quantize(w, second, GGMLType.IQ3_S, imat))
    assert shared.take(h) is second and shared.kept_bytes == 0


def _priced(types):
    """A site priced on all its rows in ``types``, the bytes pricing kept, and the site."""
    from compressor.output.gguf.pricing import PROBE_ROWS, price
    from compressor.sizing.plan import Rounded
    from compressor.sizing.sites import Site

    w, h, imat = problem(rows=2 * PROBE_ROWS, n=512, seed=5)
    f = torch.from_numpy(np.random.default_rng(6).uniform(0.5, 2.0, w.shape[0]))
    site = Site("blk.0.ffn_down.weight", "m", torch.from_numpy(w), torch.from_numpy(h), f, imat)
    kept = Rounded(1 << 24)
    return price(site, types, kept=kept), kept, site


def test_pricing_compensates_the_codebook_types_and_the_plan_rounds_the_same_bytes():
    """Each IQ option is priced compensated, below its nearest price, at its bytes; the plan's rounding (the
    target's call: every compensated type pricing rounded the tensor in, through the shared factor) makes the
    bytes pricing kept, and the price is the cost of gguf-py's decoding of them."""
    types = (GGMLType.IQ2_XS, GGMLType.IQ3_XXS, GGMLType.IQ3_S)
    opts, kept, site = _priced(types)
    w = site.weight
    assert [o.name for o in opts] == [t.name for t in types]
    factors = gr.SharedFactors([site.h])
    fac = factors.get(site.h, blockwise=True)  # as the plan's rounding asks (rounding.Compensator._round_layer)
    alongside = [GGMLType[o.name] for o in opts if o.payload.compensated]
    again = gr.gptq_quantize_many(w, fac, alongside, site.imatrix)
    for o in opts:
        t = GGMLType[o.name]
        assert o.payload.compensated and o.payload.weighted, o.name
        raw = kept[site.name, o.name]
        assert raw.nbytes == o.size == w.shape[0] * ggml.bytes_per_row(t, w.shape[1])
        assert np.array_equal(raw, again[alongside.index(t)]), o.name
        decoded = torch.from_numpy(ggml.dequantize(raw, t, w.shape[1]))
        assert o.cost == pytest.approx(site.cost(decoded - w), rel=1e-9)
        nearest = site.cost(torch.from_numpy(ggml.roundtrip(w.numpy(), t, site.imatrix)) - w)
        assert o.cost < 0.9 * nearest, o.name


def test_the_file_holds_the_priced_bytes_and_decodes_to_the_priced_values(tmp_path):
    from compressor.output.gguf.write import write_requantized

    opts, kept, site = _priced((GGMLType.IQ2_S,))
    (opt,) = opts
    name, w = site.name, site.weight.numpy()
    src = tmp_path / "src.gguf"
    writer = gguf.GGUFWriter(str(src), "llama")
    writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = tmp_path / "out.gguf"
    write_requantized(src, out, {name: opt.name}, {name: site.imatrix}, stored={name: (opt.name, kept[name, opt.name])})
    (tensor,) = [t for t in gguf.GGUFReader(out).tensors if t.name == name]
    assert tensor.tensor_type.name == opt.name and int(tensor.n_bytes) == opt.size
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(w.shape[0], -1)
    assert np.array_equal(raw, kept[name, opt.name])
    decoded = np.asarray(gguf.quants.dequantize(raw, tensor.tensor_type), dtype=np.float32).reshape(w.shape)
    assert opt.cost == pytest.approx(site.cost(torch.from_numpy(decoded) - site.weight), rel=1e-9)
    assert not np.array_equal(raw, ggml.quantize(w, GGMLType.IQ2_S, site.imatrix))  # not ggml's nearest bytes
