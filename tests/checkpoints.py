"""Tiny saved checkpoints (model + tokenizer) for end-to-end tests: no downloads."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compressor.data import _embedded_documents

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok.train_from_iterator(_embedded_documents("calibration")[:20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_causal_lm(model_type: str = "llama", seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if model_type == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=256))
    elif model_type == "gpt_neox":
        model = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=3, num_attention_heads=4,
                                                        max_position_embeddings=256))
    elif model_type == "gemma3_text":
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(head_dim=8, sliding_window=16, **common))
    else:
        cfg_cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[model_type]
        model_cls = {"llama": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM, "qwen2": tf.Qwen2ForCausalLM,
                     "qwen3": tf.Qwen3ForCausalLM}[model_type]
        model = model_cls(cfg_cls(**common))
    return model.eval()


def save_tiny_checkpoint(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    folder = Path(folder)
    tiny_causal_lm(model_type, seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


COMPRESSIBLE = ["gpt2", "gpt_neox", "llama", "mistral", "qwen2", "qwen3", "gemma3_text"]
