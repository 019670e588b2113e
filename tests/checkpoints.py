"""Tiny saved checkpoints (model + tokenizer) for end-to-end tests: no downloads."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from tiny import COMPRESSIBLE, VOCAB, tiny_model  # noqa: F401  (COMPRESSIBLE re-exported)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from compressor.inputs.data import _embedded_documents

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok.train_from_iterator(_embedded_documents("calibration")[:20], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_causal_lm(model_type: str = "llama", seed: int = 0):
    return tiny_model(model_type, seed)


def save_tiny_checkpoint(folder: Path, model_type: str = "llama", seed: int = 0) -> Path:
    folder = Path(folder)
    tiny_causal_lm(model_type, seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


#: The first lines of a script run in a subprocess as a user without compressor: importing it fails
#: there (the output must load with torch and transformers alone).
BLOCK_COMPRESSOR = textwrap.dedent(
    """
    import json, sys

    class BlockCompressor:
        def find_spec(self, name, path=None, target=None):
            if name == "compressor" or name.startswith("compressor."):
                raise ImportError(f"compressor is not installed here (blocked {name})")
            return None

    sys.meta_path.insert(0, BlockCompressor())
    """
)


#: The recipe a notebook user writes for the tiny model: small windows, the gate on (oneshot, card, tasks tests).
TINY_RECIPE = {
    "calibration": {"dataset": "embedded", "max_tokens": 2048, "seq_len": 32},
    "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 64},
    "policy": {"threshold": -100, "ppl_budget": 0.5},
    "replacement": {"kind": "affine"},  # whole-block swaps, the greedy search (prune, the default, allocates)
    "measure": {"cache": False},
}
