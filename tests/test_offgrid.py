"""``tools/size/offgrid.py``: the off-grid transform computes the same function with weights on no grid.

Tiny llama (tied embeddings) and qwen2 (q/k/v biases) models from configs, random weights and
non-trivial norm weights; nothing is downloaded. The end-to-end test writes a tiny Q8_0 GGUF with
compressor's writer and skips where ``gguf`` or llama-cpp-python (its quantizer) is not installed.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tiny import byte_level_tokenizer
from tools.size import offgrid

HIDDEN, FF, LAYERS, VOCAB = 64, 128, 2, 320
TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 123 4567 and words, words; more words! "
        "A second sentence with other letters: xylophone, quartz, jazz. ") * 12

pytestmark = pytest.mark.usefixtures("torch_single_thread")

MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"tie_word_embeddings": True,
                                                                       "attention_bias": True, "mlp_bias": True}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def tiny(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model with informative logits; norms and biases away from 1 and 0."""
    cfg, cls, extra = MODELS[model_type]
    torch.manual_seed(seed)
    model = cls(cfg(hidden_size=HIDDEN, intermediate_size=FF, num_hidden_layers=LAYERS, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn_like(p) * 0.5)
            elif p.ndim == 1:
                p.normal_(std=0.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(std=0.5)
            else:
                p.normal_(std=0.08)
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", list(MODELS))
def test_same_function_unit_norms_untied_weights_moved(model_type):
    model = tiny(model_type)
    before = logits(model, IDS)
    weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    assert offgrid.make_offgrid(model, seed=0) is model
    after = logits(model, IDS)

    assert before.std() > 0.5  # informative logits, so the comparison is too
    torch.testing.assert_close(after, before, atol=1e-4 * before.abs().max().item(), rtol=0)
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert len(norms) == 2 * LAYERS + 1 and all(torch.all(p == 1) for p in norms)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    moved = {n: (p - weights[n]).abs().max().item() for n, p in model.named_parameters() if p.ndim == 2}
    assert all(d > 1e-2 for d in moved.values()), moved
    # readers' biases (qwen2 q/k/v, llama attention_bias) stay; writers' biases rotate
    blk, orig = model.model.layers[0], "model.layers.0."
    torch.testing.assert_close(blk.self_attn.q_proj.bias, weights[orig + "self_attn.q_proj.bias"])
    if blk.mlp.down_proj.bias is not None:
        assert not torch.allclose(blk.mlp.down_proj.bias, weights[orig + "mlp.down_proj.bias"])


@pytest.mark.parametrize("model_type", list(MODELS))
def test_save_reload_in_float32_is_the_same_function(tmp_path, model_type):
    model = tiny(model_type)
    before = logits(model, IDS)
    offgrid.make_offgrid(model, seed=3).save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not reloaded.config.tie_word_embeddings
    torch.testing.assert_close(logits(reloaded, IDS), before, atol=1e-4 * before.abs().max().item(), rtol=0)


def test_the_seed_decides_the_rotation():
    a, b, c = (offgrid.make_offgrid(tiny("llama"), seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.allclose(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_the_rotation_is_haar_orthogonal():
    q = offgrid.random_orthogonal(48, seed=5)
    torch.testing.assert_close(q.T @ q, torch.eye(48, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(q, offgrid.random_orthogonal(48, seed=5), atol=0, rtol=0)
    # the sign fix: G = Q R with R's diagonal positive, the unique QR whose Q is Haar-distributed
    g = torch.randn(48, 48, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    r = q.T @ g
    assert torch.all(torch.diagonal(r) > 0)
    torch.testing.assert_close(r, r.triu(), atol=1e-10, rtol=0)


def test_other_architectures_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported: llama, qwen2"):
        offgrid.make_offgrid(gpt2, seed=0)


def test_a_norm_that_is_not_rmsnorm_is_refused_before_any_change():
    model = tiny("llama")
    model.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(HIDDEN)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="plain RMSNorm"):
        offgrid.make_offgrid(model, seed=0)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.config.tie_word_embeddings


def test_rotate_without_folding_is_refused():
    model = tiny("qwen2")
    layout = offgrid.layout_of(model)
    with pytest.raises(ValueError, match="fold_norms"):
        offgrid.rotate(model, layout, offgrid.random_orthogonal(HIDDEN, 0))


# --------------------------------------------------------------------------------------------------
# End to end: a tiny Q8_0 GGUF → an off-grid bf16 folder
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer(TEXT)


def test_cli_turns_a_q8_0_gguf_into_an_off_grid_folder(tmp_path, tokenizer, capsys):
    pytest.importorskip("gguf")
    from compressor.inputs.load import ResolvedSource
    from compressor.output.base import WriteRequest
    from compressor.output.gguf import GGUFWriter, runtime_missing

    if why := runtime_missing():  # the Q8_0 source is quantized by llama.cpp's own quantizer
        pytest.skip(why)

    src, out, text = tmp_path / "src", tmp_path / "out", tmp_path / "text.txt"
    src.mkdir()
    text.write_text(TEXT, encoding="utf-8")
    ids = torch.tensor(tokenizer(TEXT).input_ids[:128])
    GGUFWriter().write(WriteRequest(
        model=tiny("llama"), tokenizer=tokenizer, compression={}, dtype=torch.float32,
        source=ResolvedSource("/nonexistent/tiny-model", None, True), probe_tokens=ids, probe_seq_len=64,
        probe_stride=64, expected_ppl=1.0, options={"quant": "q8_0", "file": "tiny.gguf"}), src)

    assert offgrid.main([str(src / "tiny.gguf"), str(out), "--check-tokens", "48", "--text", str(text),
                         "--json", str(tmp_path / "record.json")]) == 0
    assert "top-1" in capsys.readouterr().out
    record = json.loads((out / "offgrid.json").read_text())
    assert record == {k: v for k, v in json.loads((tmp_path / "record.json").read_text()).items() if k != "output"}
    assert record["source"]["file"] == "tiny.gguf" and len(record["source"]["sha256"]) == 64
    assert record["seed"] == 0 and record["dtype"] == "bfloat16" and record["model_type"] == "llama"
    check = record["check"]
    assert check["float32_transform_vs_source"]["relative_max_diff"] < 1e-4
    assert check["float32_transform_vs_source"]["top1_agreement"] == 1.0
    assert check["saved_vs_source"]["top1_agreement"] > 0.9 and check["tokenizer_round_trip"]
    grid = check["grid_fraction_unchanged"]
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert grid["source"][name]["Q8_0"] > 0.99, grid["source"][name]  # the source's own grid
        assert grid["output"][name]["Q8_0"] < 0.05, grid["output"][name]

    # a plain folder: loads with no flags, untied, bf16, with the tokenizer
    plain = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert plain.dtype == torch.bfloat16 and not plain.config.tie_word_embeddings
    assert (out / "model.safetensors").exists() and transformers.AutoTokenizer.from_pretrained(out)
