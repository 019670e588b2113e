"""Integer grids as compressed-tensors stores them (compressor.output.ctensors.grids) and the
``compressed-tensors`` writer (compressor.output.ctensors), checked against independent references:

* the schemes against the library's own presets; the scales and codes of round-to-nearest against the
  library's ``calculate_qparams`` / ``quantize`` / ``fake_quantize``;
* GPTQ against a brute-force float64 recursion (the inverse-Hessian update of the OBS formula, one column
  at a time, no Cholesky, no batching) for several batch sizes; Ĥ = I gives round-to-nearest exactly; on
  a correlated Ĥ GPTQ's output error is below round-to-nearest's;
* the writer: save → plain ``from_pretrained`` (no flags) → logits equal to the in-memory model fake-
  quantized by the library, for W4A16, W8A16 and a mixed per-layer map with unquantized layers; the bytes
  of each layer's stored tensors equal the scheme's byte rule; GPTQ-rounded codes are the stored codes;
  the model in memory is unchanged; what cannot be written is refused by name.

Every model is built from a config with widths the groups divide; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402
from tiny import _config_and_class, random_windows  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from compressor.fitting import gridround  # noqa: E402
from compressor.output.ctensors.grids import (  # noqa: E402
    SCHEMES, IntScheme, decoded, get_scheme, gptq, output_error, rtn, scales_of, weight_bytes,
)
from compressor.output.ctensors import grids  # noqa: E402
from compressor.output import VerificationError, WriteRequest, Written, get_writer  # noqa: E402
from compressor.output import ctensors  # noqa: E402
from compressor.output.ctensors import schemes as ctschemes  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")

HIDDEN, INTER, VOCAB = 128, 256, 128


def model_of(model_type: str, seed: int = 0, intermediate: int = INTER):
    """A tiny model of ``model_type`` whose linears have 128 or 256 inputs (every group here divides them)."""
    cfg, cls = _config_and_class(model_type)
    cfg.hidden_size, cfg.intermediate_size = HIDDEN, intermediate
    cfg.head_dim = HIDDEN // cfg.num_attention_heads
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return cls(cfg).float().eval()


def request_for(model, dtype=torch.float32, **options) -> WriteRequest:
    tokens = random_windows(1, 96, vocab=VOCAB, seed=3).flatten()
    return WriteRequest(model=model, tokenizer=None, compression={}, source=None, dtype=dtype, probe_tokens=tokens,
                        probe_seq_len=32, probe_stride=32, probe_batch_size=4, options=options)


def write_and_verify(request: WriteRequest, folder) -> dict:
    folder.mkdir()
    written = get_writer("compressed-tensors").write(request, folder)
    return get_writer("compressed-tensors").verify(request, written)  # a second instance, as the pipeline does


def stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def correlated(n: int, seed: int = 0) -> torch.Tensor:
    """An input second moment with strongly correlated columns of very different scales."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(4 * n, n, generator=g, dtype=torch.float64) @ (
        torch.randn(n, n, generator=g, dtype=torch.float64) / n ** 0.5 + 0.5 * torch.eye(n, dtype=torch.float64))
    X = (X + torch.randn(4 * n, 1, generator=g, dtype=torch.float64)) * torch.rand(n, generator=g,
                                                                                    dtype=torch.float64) * 3
    return X.T @ X / X.shape[0]


# --------------------------------------------------------------------------------------------------
# Schemes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["W4A16", "W8A16"])
def test_presets_are_the_library_presets(name):
    assert SCHEMES[name].to_args() == preset_name_to_scheme(name, ["Linear"]).weights


def test_schemes_validate_and_name_what_exists():
    assert get_scheme(None) is None and get_scheme("none") is None and get_scheme("Unquantized") is None
    assert get_scheme("w4a16") is SCHEMES["W4A16"]
    with pytest.raises(ValueError, match="W4A16_G32"):
        get_scheme("W3A16")
    for bad in (dict(num_bits=9, group_size=128), dict(num_bits=4, group_size=0),
                dict(num_bits=4, group_size=128, symmetric=False)):
        with pytest.raises(ValueError, match="bad"):
            IntScheme("bad", **bad)
    s = SCHEMES["W4A16"]
    assert s.fits(256) and not s.fits(192) and SCHEMES["W4A16_G32"].fits(192)
    assert IntScheme("W8_CH", 8, None).fits(7)
    # 4 bits a weight plus a bfloat16 scale per 128: 4.125 bits, and the 16-byte weight_shape
    assert s.nbytes(64, 256) == 64 * 256 // 2 + 64 * 2 * 2 + 16
    assert weight_bytes(None, 64, 256, torch.bfloat16) == 64 * 256 * 2
    assert SCHEMES["W8A16"].nbytes(64, 256, torch.float16) == 64 * 256 + 64 * 2 * 2 + 16


# --------------------------------------------------------------------------------------------------
# Round-to-nearest: the library's rule
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", [*SCHEMES.values(), IntScheme("W8_CH", 8, None)], ids=lambda s: s.name)
def test_rtn_is_the_library_quantizer(scheme):
    torch.manual_seed(0)
    W = torch.randn(16, 256) * torch.rand(16, 1)
    W[3, :32] = 0  # an all-zero group gets the eps scale
    args = scheme.to_args()
    g = W.view(16, -1, scheme.group_size or 256)
    scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)  # the memoryless min-max observer's rule
    r = rtn(W, scheme, scale_dtype=torch.float32)
    assert torch.equal(r.scales, scale) and torch.equal(scales_of(W, scheme, torch.float32), scale)
    assert torch.equal(r.ints, quantize(W, scale, zp, args, dtype=torch.int8))
    assert torch.equal(r.weight, fake_quantize(W, scale, zp, args))
    # scales stored in bfloat16: the library's rule with scale_dtype (rounded, then a zero made the dtype's
    # eps); the codes are what it computes with the stored scale, and the decoded weight gives them back
    # exactly (what the compressor's own quantize() does at save)
    b = rtn(W, scheme, scale_dtype=torch.bfloat16)
    scale16, _ = calculate_qparams(g.amin(-1), g.amax(-1), args.model_copy(update={"scale_dtype": torch.bfloat16}))
    assert b.scales.dtype == torch.bfloat16 and torch.equal(b.scales, scale16.to(torch.bfloat16))
    assert torch.equal(b.ints, quantize(W, b.scales, zp, args, dtype=torch.int8))
    assert torch.equal(quantize(b.weight, b.scales, zp, args, dtype=torch.int8), b.ints)


# --------------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------------


def gptq_reference(W: torch.Tensor, H: torch.Tensor, s: IntScheme, damp: float = 0.01,
                   static_groups: bool = False) -> np.ndarray:
    """The GPTQ recursion, brute force in float64: one column at a time, the error spread through the
    explicit inverse, which then loses the column's row and column (Frantar et al., eq. 3 and 4); a group's
    scale from the whole group as updated when its first column comes (or from the original weights)."""
    W = W.double().numpy().copy()
    H = H.double().numpy().copy()
    n = H.shape[0]
    H[np.diag_indices(n)] += damp * np.mean(np.diag(H))
    Hinv = np.linalg.inv(H)
    gs = s.group_size or n
    half = (s.qmax - s.qmin) / 2

    def scale(block):
        v = torch.from_numpy(np.abs(block).max(1) / half).float().to(torch.bfloat16)
        return v.double().numpy()

    fixed = [scale(W[:, g:g + gs]) for g in range(0, n, gs)]
    Q = np.zeros_like(W)
    for j in range(n):
        if j % gs == 0:
            S = fixed[j // gs] if static_groups else scale(W[:, j:j + gs])
        Q[:, j] = np.clip(np.round(W[:, j] / S), s.qmin, s.qmax)
        e = (W[:, j] - Q[:, j] * S) / Hinv[j, j]
        W[:, j + 1:] -= np.outer(e, Hinv[j, j + 1:])
        Hinv = Hinv - np.outer(Hinv[:, j], Hinv[j, :]) / Hinv[j, j]
    return Q


@pytest.mark.parametrize("scheme", [IntScheme("G16", 4, 16), IntScheme("CH", 4, None), IntScheme("G8x8", 8, 16)],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_is_the_recursion_for_any_batch(scheme, static_groups):
    torch.manual_seed(1)
    W, H = torch.randn(8, 64), correlated(64)
    Q = gptq_reference(W, H, scheme, static_groups=static_groups)
    for block in (1, 5, 16, 128):
        r = gptq(W, H, scheme, block=block, static_groups=static_groups)
        assert np.array_equal(r.ints.numpy(), Q), block
        assert torch.equal(r.weight, r.ints.float() * r.scales.float().repeat_interleave(
            64 // r.scales.shape[1], dim=1))


@pytest.mark.parametrize("static_groups", [False, True])
def test_gptq_rounds_a_tall_weight_a_few_rows_at_a_time(monkeypatch, static_groups):
    """Rows are independent: an output head goes in chunks of rows, each chunk the recursion's codes."""
    torch.manual_seed(5)
    W, H, s = torch.randn(8, 64).to(torch.bfloat16), correlated(64), IntScheme("G16", 4, 16)
    whole = gptq(W, H, s, static_groups=static_groups)
    monkeypatch.setattr(grids, "ROW_CHUNK", 3 * 64)  # chunks of 3, 3 and 2 rows
    r = gptq(W, H, s, static_groups=static_groups, decode=False)
    assert np.array_equal(r.ints.numpy(), gptq_reference(W.float(), H, s, static_groups=static_groups))
    assert r.weight is None and torch.equal(r.ints, whole.ints) and torch.equal(r.scales, whole.scales)
    assert torch.equal(decoded(r), whole.weight)


def test_gptq_with_identity_moment_is_rtn():
    torch.manual_seed(2)
    W = torch.randn(32, 256)
    for name in SCHEMES:
        g, r = gptq(W, torch.eye(256), name), rtn(W, name)
        assert torch.equal(g.ints, r.ints) and torch.equal(g.scales, r.scales) and torch.equal(g.weight, r.weight)


@pytest.mark.parametrize("name", list(SCHEMES))
def test_gptq_beats_rtn_on_correlated_inputs(name):
    torch.manual_seed(3)
    W, H = torch.randn(64, 256) * 0.05, correlated(256)
    g, r = output_error(W, gptq(W, H, name).weight, H), output_error(W, rtn(W, name).weight, H)
    assert g < 0.8 * r, (g, r)
    assert output_error(W, gptq(W, H, name, static_groups=True).weight, H) < r


def test_gptq_takes_a_shared_factor_and_refuses_a_mismatched_one():
    torch.manual_seed(4)
    W, H = torch.randn(8, 128), correlated(128)
    f = gridround.factor(H, damp=0.01, act_order=False)
    assert torch.equal(gptq(W, f, "W4A16_G32").ints, gptq(W, H, "W4A16_G32").ints)
    with pytest.raises(ValueError, match="damp"):
        gptq(W, f, "W4A16_G32", damp=0.1)
    with pytest.raises(ValueError, match="static_groups"):
        gptq(W, H, "W4A16_G32", act_order=True)
    with pytest.raises(ValueError, match="divide"):
        gptq(torch.randn(8, 96), torch.eye(96), "W4A16")
    a = gptq(W, H, "W4A16_G32", act_order=True, static_groups=True)  # llm-compressor's default order
    assert output_error(W, a.weight, H) < output_error(W, rtn(W, "W4A16_G32").weight, H)


# --------------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------------


def mixed_map(model) -> dict:
    """Layer 0: attention W8A16, MLP W4A16_G32 but the down projection unquantized; the others W4A16."""
    out = {}
    for name in ctschemes.linear_names(model, head=False):
        if ".layers.0.self_attn." in name:
            out[name] = "W8A16"
        elif name.endswith("layers.0.mlp.down_proj"):
            out[name] = None
        elif ".layers.0.mlp." in name:
            out[name] = "W4A16_G32"
        else:
            out[name] = "W4A16"
    return out


def library_fake_quantized(model, schemes: dict, dtype):
    """``model`` with each quantized weight fake-quantized by the library (its observer's scales, stored in
    ``dtype``) and every other tensor rounded through ``dtype``: what the saved folder must compute in
    float32. (An all-zero group would differ: the library gives it float32's eps before the rounding.)"""
    import copy

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for t in ref.state_dict().values():
            if t.is_floating_point():
                t.copy_(t.to(dtype))
        for name, s in schemes.items():
            if s is None:
                continue
            lin, src = ref.get_submodule(name), model.get_submodule(name).weight.detach()
            args, gs = s.to_args(), s.group_size or src.shape[1]
            g = src.view(src.shape[0], -1, gs)
            scale, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
            # the stored scale, read back in float32 (the reload's compute dtype decodes in float32)
            lin.weight.copy_(fake_quantize(src, scale.to(dtype).float(), zp, args))
    return ref


@pytest.mark.parametrize("model_type, how, dtype", [
    ("llama", "W4A16", torch.float32),
    ("qwen2", "W8A16", torch.bfloat16),
    ("mistral", "mixed", torch.float16),
    ("llama", "head", torch.bfloat16),  # the untied output head quantized too (a size plan may do so)
])
def test_save_reload_logits_bytes_and_the_model_left_alone(tmp_path, model_type, how, dtype):
    model = model_of(model_type)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = ({"ct_schemes": mixed_map(model)} if how == "mixed" else
               {"ct_schemes": dict.fromkeys(ctschemes.linear_names(model), "W4A16") | {"lm_head": "W8A16_CH"}}
               if how == "head" else {"ct_scheme": how})
    request = request_for(model, dtype=dtype, **options)
    check = write_and_verify(request, tmp_path / "out")
    folder = tmp_path / "out"
    schemes = ctschemes.layer_schemes(model, options)

    assert check["passed"] and check["max_abs_logit_diff"] <= 1e-5 and math.isfinite(check["perplexity"])
    assert check["schemes"] == ctschemes.scheme_counts(schemes)
    # the model in memory: same tensors, no quantization attributes, same class
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(hasattr(m, "quantization_scheme") or hasattr(m, "weight_scale") for m in model.modules())

    cfg = json.loads((folder / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"
    assert q["quantization_status"] == "compressed" and "auto_map" not in cfg
    assert ("lm_head" in q["ignore"]) == (how != "head")
    assert ("lm_head" in schemes) == (ctschemes.head_name(model) is not None)
    assert cfg["compression"]["format"] == ctschemes.CTENSORS_FORMAT
    assert cfg["compression"]["quantization"]["output_head"] == ("W8A16_CH" if how == "head" else "unquantized")

    # bytes: every layer's stored tensors are what the scheme's rule says
    tensors = stored(folder)
    for name, s in schemes.items():
        out_f, in_f = model.get_submodule(name).weight.shape
        mine = {k: t for k, t in tensors.items() if k.startswith(name + ".") and k != name + ".bias"}
        if s is None:
            assert set(mine) == {name + ".weight"} and mine[name + ".weight"].dtype == dtype
        else:
            assert set(mine) == {f"{name}.weight_{p}" for p in ("packed", "scale", "shape")}
            assert mine[name + ".weight_scale"].dtype == dtype
        assert sum(t.nbytes for t in mine.values()) == weight_bytes(s, out_f, in_f, dtype)
    assert check["tensor_bytes"] == ctschemes.tensor_bytes(model, schemes, dtype) == sum(
        t.nbytes for t in tensors.values())
    assert ctschemes.linear_bytes(model, schemes, dtype) == sum(
        t.nbytes for k, t in tensors.items() if k.rpartition(".")[0] in schemes and not k.endswith(".bias"))
    assert check["file_bytes"] == sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    assert 0 < check["file_bytes"] - check["tensor_bytes"] < 20_000  # the JSON header

    # plain transformers, no flags, in the compute dtype: the library's own fake quantization
    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = random_windows(2, 24, vocab=VOCAB, seed=5)
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
        want = library_fake_quantized(model, schemes, dtype)(input_ids=ids).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    assert type(reloaded) is type(model)
    # and with no argument at all: the saved dtype, decoded in it
    plain = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    assert plain.dtype == dtype
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits.float(), got, rtol=0, atol=0.05)


def test_gptq_codes_are_the_stored_codes_and_a_bad_file_is_caught(tmp_path):
    model = model_of("llama", seed=1)
    names = ctschemes.linear_names(model, head=False)
    hessians = {n: correlated(model.get_submodule(n).in_features, seed=i) for i, n in enumerate(names[:4])}
    request = request_for(model, dtype=torch.bfloat16, ct_scheme="W4A16_G32", ct_hessians=hessians)
    check = write_and_verify(request, tmp_path / "out")
    assert check["gptq_layers"] == 4 and check["passed"]
    tensors = stored(tmp_path / "out")
    for name in names[:4] + names[-1:]:
        w = model.get_submodule(name).weight
        r = (gptq(w, hessians[name], "W4A16_G32", scale_dtype=torch.bfloat16, **ctschemes.GPTQ_ORDER) if name in hessians
             else rtn(w, "W4A16_G32", scale_dtype=torch.bfloat16))
        codes = unpack_from_int32(tensors[name + ".weight_packed"], 4, torch.Size(w.shape))
        assert torch.equal(codes, r.ints) and torch.equal(tensors[name + ".weight_scale"], r.scales)

    # a file whose scales are not the rounded ones is refused
    from safetensors.torch import save_file

    tensors[names[0] + ".weight_scale"] = tensors[names[0] + ".weight_scale"] * 2
    path = next((tmp_path / "out").glob("*.safetensors"))
    save_file(tensors, str(path), metadata={"format": "pt"})
    request = request_for(model, dtype=torch.bfloat16, ct_scheme="W4A16_G32", ct_hessians=hessians)
    writer = get_writer("compressed-tensors")
    with pytest.raises(VerificationError, match="Δlogit"):  # the file as it is on disk, the writer's own plan
        writer.verify(request, Written(tmp_path / "out", [path], writer.plan(request)))


def test_the_reference_copy_shares_the_weights_it_replaces():
    """The reload check's reference (the model rounded through the saved dtype) does not copy the quantized
    layers' weights, which it replaces with the decoded ones (Qwen2.5-1.5B: 6 GB in float32, the margin between
    a run and an out-of-memory kill), and rounds nothing of the model it was copied from."""
    from compressor.output.hf import rounded_copy

    model = model_of("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kept = [model.get_submodule(n).weight for n in ctschemes.linear_names(model)]
    ref = rounded_copy(model, torch.bfloat16, kept)
    for n in ctschemes.linear_names(model):
        assert ref.get_submodule(n).weight is model.get_submodule(n).weight
    emb = ref.get_input_embeddings().weight
    assert emb is not model.get_input_embeddings().weight and emb.dtype == torch.float32
    assert torch.equal(emb, before["model.embed_tokens.weight"].to(torch.bfloat16).float())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the model: not rounded


def test_a_tied_output_head_stays_with_the_embedding(tmp_path):
    """A head whose weight is the input embedding's is no candidate (quantizing it would untie it): naming it is
    refused, and the folder keeps it in the saved dtype under the config's ignore."""
    cfg, cls = _config_and_class("llama")
    cfg.hidden_size, cfg.intermediate_size, cfg.head_dim = HIDDEN, INTER, HIDDEN // cfg.num_attention_heads
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    assert ctschemes.head_name(model) is None and "lm_head" not in ctschemes.linear_names(model)
    with pytest.raises(ValueError, match=r"not quantizable.*\(lm_head\)"):
        ctschemes.layer_schemes(model, {"ct_schemes": {"lm_head": "W8A16"}})
    check = write_and_verify(request_for(model, dtype=torch.bfloat16, ct_scheme="W8A16"), tmp_path / "out")
    assert check["passed"] and check["schemes"] == {"W8A16": len(ctschemes.linear_names(model))}
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == ["lm_head"] and not any(k.startswith("lm_head.") for k in stored(tmp_path / "out"))
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["compression"]["quantization"]
    assert quant["output_head"] == "unquantized (tied to the embedding)"


def test_tokenizer_and_card_go_with_the_weights(tmp_path):
    from checkpoints import tiny_tokenizer

    model = model_of("llama")
    request = request_for(model, ct_scheme="W8A16")
    request.tokenizer = tiny_tokenizer()
    request.extra_files = {"recipe.yaml": "recipe: 1\n", "README.md": (
        "# m\n\n## Load\n\n```python\nmodel = AutoModelForCausalLM.from_pretrained(\"f\", trust_remote_code=True)\n"
        "# or, with compressor installed: `import compressor` after transformers and drop both flags\n```\n")}
    folder = tmp_path / "out"
    folder.mkdir()
    get_writer("compressed-tensors").write(request, folder)
    assert (folder / "tokenizer.json").exists() and (folder / "recipe.yaml").read_text() == "recipe: 1\n"
    card = (folder / "README.md").read_text()
    assert "trust_remote_code" not in card and "compressed-tensors" in card and "W8A16 × 21" in card


def test_what_cannot_be_written_is_refused_by_name(monkeypatch):
    writer = get_writer("compressed-tensors")
    assert writer.unsupported("llama", "none") is None and writer.unsupported("llama", "prune") is None
    assert "kind prune" in writer.unsupported("llama", "affine")
    assert writer.check_options({"ct_scheme": "W5A16"}) and writer.check_options({"ct_scheme": "none"})
    assert writer.check_options({"ct_schemes": {"model.layers.0.mlp.up_proj": "W4A16"}}) is None

    model = model_of("llama", intermediate=192)  # down_proj rows of 192: no group of 128
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*192.*W4A16\).*W4A16_G64, W4A16_G32, W4A16_CH, W8A16_CH"):
        ctschemes.layer_schemes(model, {"ct_scheme": "W4A16"})
    assert ctschemes.layer_schemes(model, {"ct_scheme": "W4A16_G32"})
    split = {n: "W4A16_G32" for n in ctschemes.linear_names(model, head=False)}
    split["model.layers.1.self_attn.k_proj"] = None
    with pytest.raises(ValueError, match="q_proj \\+ k_proj \\+ v_proj"):
        ctschemes.layer_schemes(model, {"ct_scheme": "W4A16_G32", "ct_schemes": split})
    with pytest.raises(ValueError, match="model.embed_tokens.*model.layers.0.self_attn.q_proj"):
        ctschemes.layer_schemes(model, {"ct_schemes": {"model.embed_tokens": "W8A16"}})
    with pytest.raises(ValueError, match="nothing to quantize"):
        ctschemes.layer_schemes(model, {"ct_schemes": {}})

    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # as if not installed
    why = writer.unsupported("llama", "none")
    assert ctschemes.INSTALL in why
    with pytest.raises(ValueError, match="compressor\\[compressed-tensors\\]"):
        writer.write(request_for(model), None)


def test_a_pruned_model_is_saved_as_its_base_class_at_the_pruned_width(tmp_path, monkeypatch):
    from compressor.core.modeling import HiddenUnitFFN

    model = model_of("llama", seed=2)
    with torch.no_grad():
        for block in model.model.layers:  # keep the first 128 of 256 hidden units (a grid the groups divide)
            mlp, ffn = block.mlp, HiddenUnitFFN(HIDDEN, HIDDEN, 128, "silu", True, False, False)
            ffn.up.weight.copy_(torch.cat([mlp.gate_proj.weight[:128], mlp.up_proj.weight[:128]]))
            ffn.out.weight.copy_(mlp.down_proj.weight[:, :128])
            ffn.out.bias.zero_()
            block.mlp = ffn
    from compressor.output.ctensors import rounding

    calls = []
    real = rounding.round_layers
    monkeypatch.setattr(rounding, "round_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    check = write_and_verify(request_for(model, ct_scheme="W4A16"), tmp_path / "out")
    assert check["passed"] and check["class"].endswith("LlamaForCausalLM")
    assert check["schemes"] == {"W4A16": 21, "unquantized": 1}  # the head, as llm-compressor leaves it
    assert len(calls) == 1  # verify took the write's codes: rounding (GPTQ: minutes) happens once
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["intermediate_size"] == 128 and cfg["architectures"] == ["LlamaForCausalLM"]
    assert isinstance(model.model.layers[0].mlp, HiddenUnitFFN)  # the model in memory keeps its blocks
