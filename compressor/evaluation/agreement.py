"""Greedy agreement with the original model: what a deployer sees when the compressed model answers.

Two numbers, both on the gate's held-out evaluation windows:

* **next token** — the share of scored tokens where the compressed model's most likely next token is
  the original's; computed by every gate evaluation from the teacher cache
  (:attr:`compressor.evaluation.perplexity.Evaluation.agreement`), so it costs nothing extra;
* **continuations** — a handful of prompts cut from the first evaluation domain's windows, each
  continued greedily for :data:`CONTINUATION_TOKENS` tokens by the original (before anything is
  replaced) and by the compressed model: the share of continuations that are identical, and the
  mean share of tokens before the first difference.

>>> ref = continuation_reference(model, tokens, seq_len=256)      # doctest: +SKIP
>>> # … compress …                                                   # doctest: +SKIP
>>> continuation_agreement(model, ref)["identical"]                  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from compressor.core.onload import input_device

#: Prompts continued by both models, and the tokens each continuation has.
CONTINUATION_PROMPTS = 4
CONTINUATION_TOKENS = 32
PROMPT_TOKENS = 32


@dataclass
class ContinuationReference:
    """The prompts and the original model's greedy continuations of them."""

    prompts: torch.Tensor  # [n, prompt_len]
    continuations: torch.Tensor  # [n, new_tokens]


def prompts_from(tokens: torch.Tensor, seq_len: int, n: int = CONTINUATION_PROMPTS,
                 prompt_len: int = PROMPT_TOKENS) -> torch.Tensor:
    """``n`` prompts of ``prompt_len`` tokens: the starts of evenly spaced evaluation windows (each window
    starts as the model's input does, BOS included where the tokenizer adds one)."""
    tokens = tokens.flatten()
    prompt_len = max(1, min(prompt_len, seq_len, tokens.numel()))
    starts = list(range(0, max(1, tokens.numel() - prompt_len + 1), seq_len))
    pick = [starts[round(i * (len(starts) - 1) / max(1, n - 1))] for i in range(min(n, len(starts)))]
    return torch.stack([tokens[s: s + prompt_len] for s in dict.fromkeys(pick)])


@torch.no_grad()
def greedy_continue(model: nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations ``[n, new_tokens]``: no sampling, end-of-text not a stop (every continuation
    has ``new_tokens`` tokens), the model's own generation loop and cache."""
    device = input_device(model)
    ids = prompts.to(device)
    was = model.training
    model.eval()
    try:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, num_beams=1, temperature=None,
                             top_p=None, top_k=None, pad_token_id=0)
    finally:
        model.train(was)
    return out[:, ids.shape[1]:].cpu()


def continuation_reference(model: nn.Module, tokens: torch.Tensor, *, seq_len: int,
                           new_tokens: int = CONTINUATION_TOKENS) -> ContinuationReference:
    """The original model's continuations of :func:`prompts_from` (call before anything is replaced).
    Prompt and continuation stay within the model's ``max_position_embeddings``."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or (PROMPT_TOKENS + new_tokens)
    prompt_len = max(1, min(PROMPT_TOKENS, limit - new_tokens, seq_len))
    new_tokens = max(1, min(new_tokens, limit - prompt_len))
    prompts = prompts_from(tokens, seq_len, prompt_len=prompt_len)
    return ContinuationReference(prompts, greedy_continue(model, prompts, new_tokens))


def continuation_agreement(model: nn.Module, ref: ContinuationReference) -> dict:
    """How the compressed ``model``'s continuations compare with the original's."""
    got = greedy_continue(model, ref.prompts, ref.continuations.shape[1])
    same = got == ref.continuations
    # tokens before the first difference (the whole length when there is none)
    prefix = torch.where(same.all(1), same.shape[1], (~same).int().argmax(1))
    return {"prompts": int(same.shape[0]), "prompt_tokens": int(ref.prompts.shape[1]),
            "tokens": int(same.shape[1]), "identical": float(same.all(1).double().mean()),
            "matching_prefix": float(prefix.double().mean() / same.shape[1]),
            "token_agreement": float(same.double().mean())}
