"""GGUF metadata: a GGUF source's keys copied, or the architecture keys, RoPE scaling and byte-level BPE
tokenizer of a Hugging Face source written as llama.cpp's converter writes them."""

from __future__ import annotations

import math

import numpy as np

from compressor.output.gated import NotRepresentableError
from compressor.output.gguf.naming import Tensor, _field, _gguf


def copy_source_metadata(writer, reader, arch: str, skip: set[str]) -> None:
    """Every key of the source GGUF (tokenizer and chat template included), the architecture's keys
    renamed to ``arch``; ``skip`` (after renaming) is left for the caller to write."""
    gguf = _gguf()
    src_arch = _field(reader, "general.architecture")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        name = arch + key[len(src_arch):] if key.startswith(src_arch + ".") else key
        if name in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)


def hf_hparams(writer, config) -> list[Tensor]:
    """The architecture keys from a Hugging Face config; returns extra tensors (RoPE factors)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = (rope.get("rope_type") or rope.get("type") or "default").lower()
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope_type == "default":
        return []
    if rope_type == "linear":
        writer.add_rope_scaling_type(_gguf().RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        return []
    if rope_type == "llama3":
        return [Tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))]
    raise NotRepresentableError(f"RoPE scaling {rope_type!r} is not written by the gguf writer (default, linear, "
                                "llama3 are); start from a GGUF of the model instead")


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE scaling (transformers' ``_compute_llama3_parameters``)."""
    base, factor = float(rope["rope_theta"]), float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))
    return out.astype(np.float32)


#: tokenizer.json pre-tokenizer (normalised) → llama.cpp's ``tokenizer.ggml.pre``.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    (("ByteLevel", True),): "gpt-2",
    (("Digits", True), ("ByteLevel", True)): "smollm",
    (("Split", _LLAMA3_SPLIT), ("ByteLevel", False)): "llama-bpe",
    (("Split", _QWEN2_SPLIT), ("ByteLevel", False)): "qwen2",
}


def _pre_signature(pre: dict | None) -> tuple:
    items = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre or {}]
    sig = []
    for p in items:
        kind = p.get("type")
        if kind == "ByteLevel":
            if p.get("add_prefix_space"):
                sig.append(("ByteLevel+prefix",))
            else:
                sig.append((kind, bool(p.get("use_regex", True))))
        elif kind == "Digits":
            sig.append((kind, bool(p.get("individual_digits"))))
        elif kind == "Split":
            pattern = p.get("pattern") or {}
            sig.append((kind, pattern.get("Regex", pattern.get("String"))))
        else:
            sig.append((kind,))
    return tuple(sig)


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE tokenizer whose ``pre_tokenizer`` structure is one
    :data:`PRE_TOKENIZERS` names (None: another tokenizer, or a structure not listed)."""
    spec = _tokenizer_spec(tokenizer)
    if spec is None or (spec.get("model") or {}).get("type") != "BPE":
        return None
    return PRE_TOKENIZERS.get(_pre_signature(spec.get("pre_tokenizer")))


def _tokenizer_spec(tokenizer) -> dict | None:
    """A fast tokenizer's ``tokenizer.json`` as a dict (None: not a fast tokenizer)."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str())


def tokenizer_problem(tokenizer) -> str | None:
    """Why a Hugging Face tokenizer cannot be written as GGUF metadata (None when it can)."""
    spec = _tokenizer_spec(tokenizer)
    alternative = ("start from a GGUF of the model (its tokenizer metadata is copied), or convert the "
                   "original with llama.cpp's convert_hf_to_gguf.py for the tokenizer")
    if spec is None:
        return (f"the gguf writer builds byte-level BPE tokenizers only; {type(tokenizer).__name__} is not one: "
                f"{alternative}")
    if (spec.get("model") or {}).get("type") != "BPE":
        return f"the tokenizer model is {(spec.get('model') or {}).get('type')!r}, not BPE: {alternative}"
    sig = _pre_signature(spec.get("pre_tokenizer"))
    if sig not in PRE_TOKENIZERS:
        return (f"the tokenizer's pre-tokenizer {sig} is not one the gguf writer maps to llama.cpp "
                f"({', '.join(sorted(PRE_TOKENIZERS.values()))}): {alternative}")
    return None


def hf_tokenizer_metadata(writer, tokenizer, vocab_size: int) -> None:
    """``tokenizer.ggml.*`` and the chat template for a byte-level BPE tokenizer (llama.cpp's
    ``gpt2`` tokenizer model), as llama.cpp's converter writes them."""
    import json

    gguf = _gguf()
    if (problem := tokenizer_problem(tokenizer)) is not None:
        raise NotRepresentableError(problem)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_size:
        raise NotRepresentableError(f"the tokenizer has ids up to {max(vocab.values())}, the model {vocab_size} rows")
    by_id = {i: tok for tok, i in vocab.items()}
    added = {t.content: t for t in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for i in range(vocab_size):
        tok = by_id.get(i)
        if tok is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif tok in added:
            tokens.append(tok)
            types.append(gguf.TokenType.CONTROL if added[tok].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(tok)
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZERS[_pre_signature(spec.get("pre_tokenizer"))])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for attr, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if (value := getattr(tokenizer, attr, None)) is not None:
            add(int(value))
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a").input_ids
    writer.add_add_bos_token(bool(bos is not None and ids and ids[0] == bos))
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)

