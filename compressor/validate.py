"""Validate: perplexity with the Hugging Face sliding-window convention.

Windows of ``seq_len`` tokens advance by ``stride``; in each window only the
tokens not already scored by the previous window count (the rest is context),
exactly as in the transformers perplexity guide. The same windows are used
before and after a swap, so deltas compare like with like.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from ._progress import progress


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    tokens: int  # scored tokens
    seq_len: int
    stride: int

    def to_json(self) -> dict:
        return asdict(self)


def _windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + seq_len, n)
        scored = end - prev_end
        if end - begin >= 2 and scored > 0:
            out.append((begin, end, scored))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def perplexity(
    model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 256, stride: int = 128,
    batch_size: int = 8, desc: str = "perplexity",
) -> Perplexity:
    """Perplexity of ``model`` on a 1-D id stream ``tokens``."""
    if stride < 1 or stride > seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")
    tokens = tokens.flatten()
    wins = _windows(tokens.numel(), seq_len, stride)
    if not wins:
        raise ValueError(f"evaluation text has {tokens.numel()} tokens; need at least 2")
    device = model.get_input_embeddings().weight.device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    # Group equal-length windows so they batch; order does not change the sum.
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for w in wins:
        groups.setdefault(w[1] - w[0], []).append(w)
    n_batches = sum(math.ceil(len(g) / batch_size) for g in groups.values())
    bar = progress(total=n_batches, desc=desc, unit="batch")
    try:
        for length, group in groups.items():
            for i in range(0, len(group), batch_size):
                chunk = group[i : i + batch_size]
                ids = torch.stack([tokens[b:e] for b, e, _ in chunk]).to(device)
                logits = model(input_ids=ids).logits.float()
                logp = F.log_softmax(logits[:, :-1], dim=-1)
                nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, length-1]
                for row, (_, _, scored) in enumerate(chunk):
                    # Token t is predicted at position t-1; score the last `scored` tokens
                    # (the first token of the stream has no prediction).
                    k = min(scored, length - 1)
                    total_nll += float(nll[row, -k:].double().sum())
                    total_tokens += k
                bar.update(1)
    finally:
        bar.close()
        model.train(was_training)
    mean = total_nll / total_tokens
    return Perplexity(ppl=math.exp(mean), nll=mean, tokens=total_tokens, seq_len=seq_len, stride=stride)
