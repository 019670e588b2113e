"""Every GGML type the size planner offers, written as an unmodified llama.cpp reads it, and every llama.cpp preset
as a size.

A tiny llama whose rows are multiples of 256 (so that every 256-element type fits) is written in F16, then
re-quantized with every type of the menu (:data:`~compressor.output.gguf.pricing.DEFAULT_TYPES`) among its
tensors: each tensor's bytes must be ggml's, decode by gguf-py exactly as by ggml's own ``to_float``, and the
file must run in llama.cpp with the logits of a transformers model holding gguf-py's decoding of it. Each preset
``output.size`` names must be a file type gguf-py and llama.cpp's quantizer know, and llama.cpp must refuse it
without an importance matrix exactly when the table says so.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from tiny import byte_level_tokenizer

from compressor.core import ggml
from compressor.core.ggml import GGMLType
from compressor.core.presets import LLAMA_CPP_PRESETS, PRESET_ALIASES
from compressor.inputs.load import ResolvedSource
from compressor.output.base import WriteRequest
from compressor.recipe.schema import SIZE_FORMS, OutputConfig, parse_size

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")
from compressor.output import gguf as gw  # noqa: E402
from compressor.output.gguf import read as gread  # noqa: E402
from compressor.output.gguf import write as gwrite  # noqa: E402
from compressor.output.gguf.pricing import DEFAULT_TYPES  # noqa: E402

pytestmark = [pytest.mark.usefixtures("torch_single_thread"),
              pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")]

HIDDEN, FF, LAYERS, VOCAB, SEQ = 256, 512, 3, 300, 48
TEXT = ("Every block of two hundred and fifty-six weights shares its scales; the i-quants share magnitudes too. "
        "A lazy dog, a quick fox, 0123456789 and a jazz quartz xylophone. ") * 12


class _Traits(ctypes.Structure):
    """ggml's ``struct ggml_type_traits`` (ggml.h), read to reach ggml's own ``to_float``."""
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def ggml_to_float(raw: np.ndarray, t: GGMLType, n_per_row: int) -> np.ndarray:
    """float32 ``[rows, n_per_row]`` from ``t``'s bytes by ggml's own dequantization (what llama.cpp's CPU backend
    computes with), not gguf-py's numpy port of it."""
    lib = ggml._lib()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    traits = lib.ggml_get_type_traits(int(t)).contents
    assert (traits.blck_size, traits.type_size) == ggml.BLOCKS[t], t  # the block table is ggml's own
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.empty(raw.size // ggml.BLOCKS[t][1] * ggml.BLOCKS[t][0], dtype=np.float32)
    ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(traits.to_float)(
        raw.ctypes.data, out.ctypes.data, out.size)
    return out.reshape(-1, n_per_row)


@pytest.fixture(scope="module")
def f16(tmp_path_factory) -> Path:
    """The tiny llama (rows of 256 and 512) as compressor's writer writes it in F16, with its tokenizer."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:  # far from uniform logits, so a wrongly decoded tensor shows in them
                p.normal_(std=0.5 if "embed" in name or "lm_head" in name else 0.08)
    tok = byte_level_tokenizer(TEXT, vocab_size=VOCAB)
    ids = torch.tensor(tok(TEXT).input_ids[: 4 * SEQ])
    folder = tmp_path_factory.mktemp("iquant")
    request = WriteRequest(model=model, tokenizer=tok, compression={}, dtype=torch.float16,
                           source=ResolvedSource("/nonexistent/tiny-model", None, True), probe_tokens=ids,
                           probe_seq_len=SEQ, probe_stride=SEQ, expected_ppl=1.0,
                           options={"quant": "f16", "file": "f16.gguf"})
    (path,) = gw.GGUFWriter().write(request, folder).files
    return path


def _menu_of_types(reader) -> dict[str, GGMLType]:
    """Every 2-D tensor of ``reader`` → a type of the menu, each type at least once."""
    names = sorted(t.name for t in reader.tensors if len(t.shape) == 2)
    assert len(names) >= len(DEFAULT_TYPES)
    return {name: DEFAULT_TYPES[i % len(DEFAULT_TYPES)] for i, name in enumerate(names)}


def test_a_file_of_every_menu_type_runs_in_llama_cpp_as_gguf_py_decodes_it(f16, tmp_path):
    """Each tensor in its type holds ggml's bytes (with its importance matrix), gguf-py decodes them exactly as
    ggml does, and llama.cpp's logits on the file are those of a transformers model holding gguf-py's decoding."""
    source = gguf.GGUFReader(f16)
    types = _menu_of_types(source)
    g = np.random.default_rng(1)
    widths = {t.name: int(t.shape[0]) for t in source.tensors}
    imatrix = {name: g.uniform(0.2, 2.0, widths[name]).astype(np.float32) for name in types}
    values = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
              for t in source.tensors if t.name in types}
    path = tmp_path / "every-type.gguf"
    gwrite.write_requantized(f16, path, {n: t.name for n, t in types.items()}, imatrix)

    written = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert {t for t in types.values()} == set(DEFAULT_TYPES)
    for name, t in types.items():
        tensor = written[name]
        assert tensor.tensor_type.name == t.name, name
        n = values[name].shape[-1]
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1, ggml.bytes_per_row(t, n)) if t.quantized \
            else None
        if raw is not None:
            assert np.array_equal(raw, ggml.quantize(values[name].reshape(-1, n), t, imatrix[name])), name
            ours = np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(t))), dtype=np.float32)
            np.testing.assert_array_equal(ours.reshape(-1, n), ggml_to_float(raw, t, n), err_msg=name)

    window = list(range(1, SEQ + 1))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=SEQ, logits_all=True, n_threads=1, verbose=False)
    try:
        llm.eval(window)
        got = np.array(llm.scores[:SEQ])
    finally:
        llm.close()

    def logits(gguf_path: Path) -> np.ndarray:
        """transformers' logits with the weights gguf-py decodes from ``gguf_path``."""
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                                  dtype=torch.float32).eval()
        with torch.no_grad():
            return model(input_ids=torch.tensor([window])).logits[0].numpy()

    def off(want: np.ndarray) -> float:
        return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))
    # llama.cpp multiplies quantized weights by activations rounded to 8 bits (Q8_K/Q8_0), and keeps K and V in
    # F16: 0.045 here (Q8_0 everywhere: 0.036). Any one tensor of the new types put back to its F16 values moves it
    # to 0.25 or more (the embedding in IQ2_XXS 0.95), and the F16 model itself is at 1.25: a tensor llama.cpp
    # decoded otherwise than gguf-py would be far outside.
    assert off(logits(path)) < 0.12, off(logits(path))
    assert off(logits(f16)) > 0.5  # the comparison tells the files apart
    assert np.abs(got).std() > 0.5  # the logits are informative


def _quantize_with_imatrix(src: Path, dst: Path, file_type: str, imatrix: dict[str, np.ndarray]) -> int:
    """``llama_model_quantize`` to ``file_type`` with ``imatrix`` (tensor name → column weights) as its
    importance matrix, as ``llama-quantize --imatrix`` hands it over; its return code."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = int(getattr(gguf.LlamaFileType, file_type))
    params.nthread = 1
    arrays = [np.ascontiguousarray(v, dtype=np.float32) for v in imatrix.values()]
    Entry = llama_cpp.llama_model_imatrix_data
    entries = (Entry * (len(arrays) + 1))(*[Entry(name.encode(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                  a.size) for name, a in zip(imatrix, arrays)])  # last: NULL name
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(Entry))
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))


def test_every_preset_is_a_file_type_llama_cpp_makes_and_refuses_without_an_imatrix_as_recorded(f16, tmp_path):
    """Each preset's file type is gguf-py's and llama.cpp's quantizer's; the quantizer refuses to make it without an
    importance matrix exactly where :attr:`Preset.requires_imatrix` says so, and makes those with one."""
    from compressor.output.gguf.encode import quantize_file

    columns = {t.name: np.ones(int(t.shape[0]), dtype=np.float32) for t in gguf.GGUFReader(f16).tensors
               if len(t.shape) == 2}
    refused = []
    for name, preset in LLAMA_CPP_PRESETS.items():
        assert preset.file_type == f"MOSTLY_{name}" and hasattr(gguf.LlamaFileType, preset.file_type)
        dst = tmp_path / f"{name}.gguf"
        try:
            quantize_file(f16, dst, preset.file_type)
        except RuntimeError:
            refused.append(name)
            assert _quantize_with_imatrix(f16, dst, preset.file_type, columns) == 0, name
        assert gread.gguf_summary(dst)["file_type"] == preset.file_type
        dst.unlink()
    assert refused == [n for n, p in LLAMA_CPP_PRESETS.items() if p.requires_imatrix]


# the presets llama-quantize makes from IQ1_S to Q8_0 (its QUANT_OPTIONS), as users name them
USERS_SAY = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_XS",
             "IQ4_NL", "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0",
             "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0"]


@pytest.mark.parametrize("name", USERS_SAY)
def test_output_size_takes_every_preset_llama_quantize_makes(name):
    for text in (name, name.lower(), f" {name} "):
        size = OutputConfig(size=text).planned
        assert (size.kind, size.value) == ("preset", name)
    assert name in SIZE_FORMS


def test_presets_are_listed_largest_first_and_aliases_name_a_preset():
    bpw = [p.bpw for p in LLAMA_CPP_PRESETS.values()]
    assert bpw == sorted(bpw, reverse=True) and sorted(LLAMA_CPP_PRESETS) == sorted(USERS_SAY)
    for alias, name in PRESET_ALIASES.items():
        assert parse_size(alias.lower()) == ("preset", name) and f"{alias} for {name}" in SIZE_FORMS
    # the other forms stay
    assert parse_size("4.5bpw") == ("bpw", 4.5) and parse_size("1.2GB") == ("bytes", 1_200_000_000)


def test_a_size_that_is_not_one_lists_every_preset():
    with pytest.raises(ValueError) as err:
        OutputConfig(size="IQ2_XXXS")
    msg = str(err.value)
    assert "not a size" in msg and all(name in msg for name in USERS_SAY)


def test_the_docs_menu_table_is_the_menu():
    """docs/size.md's table of types says what pricing offers: each type's bits, block, rounding and importance
    matrix as the code decides them."""
    from compressor.fitting import gridround
    from compressor.output.gguf.pricing import WEIGHTED_ONLY, compensates

    text = (Path(__file__).resolve().parents[1] / "docs" / "size.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in GGMLType.__members__ and cells[2].isdigit():
            rows[cells[0]] = cells[1:]
    assert list(rows) == sorted(rows, key=lambda n: ggml.bits_per_weight(GGMLType[n]))  # by bits
    assert set(rows) == {t.name for t in DEFAULT_TYPES}
    for t in DEFAULT_TYPES:
        rounding = ("—" if not t.quantized else "nearest" if not compensates(t)
                    else "block-wise or nearest" if gridround.rounds_blockwise(t) else "GPTQ or nearest")
        weights = "—" if not t.quantized else "always" if t in WEIGHTED_ONLY or ggml.requires_imatrix(t) \
            else "with or without"
        assert rows[t.name] == [f"{ggml.bits_per_weight(t):g}", str(ggml.BLOCKS[t][0]), rounding, weights], t.name
