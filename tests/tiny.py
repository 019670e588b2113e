"""Tiny, randomly initialised Hugging Face models for the test-suite.

Plain functions (importable as ``from tiny import ...`` because pytest puts
``tests/`` on ``sys.path`` for rootdir-level test modules); ``conftest.py``
re-exports them and wraps them in fixtures. Nothing here downloads anything:
every model is built from a config.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
HIDDEN = 32
INTERMEDIATE = 64
LAYERS = 3
HEADS = 4
KV_HEADS = 2
MAX_POS = 64

ARCH_MATRIX = [
    "gpt2",
    "gpt_neox",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "phi3",
    "bert",
    "roberta",
]

# Mixtures of experts: size plans only (their rows say ``moe``); not in ARCH_MATRIX, which the structural
# paths run over.
MOE_TYPES = ["qwen3_moe", "qwen2_moe", "mixtral"]

# Architectures whose FFN is one module that ``compressor.fitting.replace`` can swap.
PROFILE_ONLY = ("bert", "roberta")

#: A short English text every tiny tokenizer and size test reads (byte-level BPE trained on it).
TEXT = ("The quick brown fox jumps over the lazy dog. Numbers 123 4567 and words, words; more words! "
        "A second sentence with other letters: xylophone, quartz, jazz. ") * 12
COMPRESSIBLE = [t for t in ARCH_MATRIX if t not in PROFILE_ONLY]
# Compressible types with separate up (and gate) projections: the hidden-unit kinds (prune, hybrid). Phi-3's
# gate and up are one fused gate_up_proj, which those kinds refuse (its ArchSpec has no ffn_up).
HIDDEN_UNITS = [t for t in COMPRESSIBLE if t != "phi3"]


def _decoder_common() -> dict:
    return _common_fields(num_key_value_heads=KV_HEADS)


def _common_fields(**overrides) -> dict:
    """Config fields shared by the tiny configs (BERT-style names, as most configs use)."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=MAX_POS,
    ) | overrides


def _config_and_class(model_type: str):
    t = transformers
    if model_type == "gpt2":
        cfg = t.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POS, n_inner=INTERMEDIATE,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
        )
        return cfg, t.GPT2LMHeadModel
    if model_type == "gpt_neox":
        return t.GPTNeoXConfig(**_common_fields()), t.GPTNeoXForCausalLM
    if model_type == "llama":
        return t.LlamaConfig(**_decoder_common()), t.LlamaForCausalLM
    if model_type == "mistral":
        return t.MistralConfig(**_decoder_common(), sliding_window=None), t.MistralForCausalLM
    if model_type == "qwen2":
        return t.Qwen2Config(**_decoder_common()), t.Qwen2ForCausalLM
    if model_type == "qwen3":
        return t.Qwen3Config(**_decoder_common(), head_dim=HIDDEN // HEADS), t.Qwen3ForCausalLM
    if model_type == "gemma3_text":
        cfg = t.Gemma3TextConfig(
            **_decoder_common(),
            head_dim=HIDDEN // HEADS,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )
        return cfg, t.Gemma3ForCausalLM
    if model_type == "phi3":
        return t.Phi3Config(**_decoder_common(), pad_token_id=0), t.Phi3ForCausalLM
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=INTERMEDIATE // 2)
    if model_type == "qwen3_moe":
        return t.Qwen3MoeConfig(**_decoder_common(), **moe, head_dim=HIDDEN // HEADS), t.Qwen3MoeForCausalLM
    if model_type == "qwen2_moe":
        return (t.Qwen2MoeConfig(**_decoder_common(), **moe, shared_expert_intermediate_size=INTERMEDIATE),
                t.Qwen2MoeForCausalLM)
    if model_type == "mixtral":
        return t.MixtralConfig(**_decoder_common(), num_local_experts=4, num_experts_per_tok=2), t.MixtralForCausalLM
    if model_type == "bert":
        return t.BertConfig(**_common_fields()), t.BertModel
    if model_type == "roberta":
        # RoBERTa offsets positions by pad_token_id + 1
        cfg = t.RobertaConfig(**_common_fields(max_position_embeddings=MAX_POS + 2), pad_token_id=1)
        return cfg, t.RobertaModel
    raise KeyError(f"no tiny config for model type {model_type!r}; known: {ARCH_MATRIX}")


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``model_type`` (seeded, eval mode, float32, eager attention)."""
    cfg, cls = _config_and_class(model_type)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32).eval()
    assert model.config.model_type == model_type, (model.config.model_type, model_type)
    return model


def random_windows(n: int, seq_len: int, vocab: int = VOCAB, seed: int = 0) -> torch.LongTensor:
    """``n`` windows of ``seq_len`` uniform random token ids in ``[2, vocab)``.

    Ids 0 and 1 are avoided so that no window contains RoBERTa's padding id.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n, seq_len), generator=g, dtype=torch.long)


def ffn_reference_modules(model: torch.nn.Module, model_type: str, index: int):
    """``(in_module, out_module)`` of block ``index``, resolved independently of compressor.core.archs."""
    if model_type in PROFILE_ONLY:
        base = getattr(model, model_type, model)  # BertModel itself, or BertFor*.bert
        layer = base.encoder.layer[index]
        return layer.intermediate, layer.output.dense
    if model_type == "gpt2":
        block = model.transformer.h[index]
    elif model_type == "gpt_neox":
        block = model.gpt_neox.layers[index]
    else:
        block = model.model.layers[index]
    return block.mlp, block.mlp


def ffn_down_reference(model: torch.nn.Module, model_type: str, index: int) -> torch.nn.Module:
    """Block ``index``'s down projection (its input is the hidden units), resolved independently of compressor.core.archs."""
    mlp, _ = ffn_reference_modules(model, model_type, index)
    name = {"gpt2": "c_proj", "gpt_neox": "dense_4h_to_h"}.get(model_type, "down_proj")
    return getattr(mlp, name)


def block_reference(model: torch.nn.Module, model_type: str, index: int) -> torch.nn.Module:
    """Decoder layer ``index`` (whose output is the residual stream after it)."""
    if model_type == "gpt2":
        return model.transformer.h[index]
    if model_type == "gpt_neox":
        return model.gpt_neox.layers[index]
    return model.model.layers[index]


def activation_name(model: torch.nn.Module) -> str:
    """The FFN activation the model's config names (the attribute differs per architecture)."""
    for attr in ("hidden_activation", "hidden_act", "activation_function"):
        value = getattr(model.config, attr, None)
        if isinstance(value, str):
            return value
    raise KeyError(f"{model.config.model_type} config names no activation")


def byte_level_tokenizer(text: str, vocab_size: int = 300):
    """A byte-level BPE tokenizer (llama.cpp's ``gpt2`` tokenizer model) trained on ``text``: what the gguf
    writer can carry as GGUF metadata."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
