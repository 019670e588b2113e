"""Perplexity on sliding windows, with a standard error: the windows, the statistics, the records.

Windows of ``seq_len`` tokens advance by ``stride``; in each window only the
tokens not already scored by the previous window count (the rest is context),
exactly as in the transformers perplexity guide. The same windows are used
before and after a swap, so deltas compare like with like.

The sampling unit is the window (tokens inside a window are strongly
correlated, windows much less so): the mean NLL is the ratio estimator
``Σ S_w / Σ n_w`` of per-window NLL sums ``S_w`` over scored-token counts
``n_w``, its standard error the usual ratio-estimator one, and the
perplexity's by the delta method (``se_ppl = ppl · se_nll``).

Holds :class:`Perplexity` and :class:`Evaluation` (the records every
measurement returns), :func:`windows`, :func:`ratio_mean_se`, the batching of
windows under a logits budget (:func:`logits_batch`), :func:`perplexity`
itself, and :func:`pool` (one evaluation of several disjoint window sets).
The KL to the original lives in :mod:`compressor.evaluation.teacher`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import distributed as dist
from compressor.core.onload import input_device
from compressor.core.progress import progress
from compressor.engine.records import register_record


@dataclass(frozen=True)
class Perplexity:
    ppl: float
    nll: float  # mean negative log-likelihood per scored token
    tokens: int  # scored tokens
    seq_len: int
    stride: int
    windows: int = 0
    nll_se: float | None = None
    """Standard error of ``nll`` with windows as the sampling unit (None with one window)."""
    ppl_se: float | None = None
    """Standard error of ``ppl`` by the delta method."""

    @property
    def relative_se(self) -> float | None:
        return None if self.ppl_se is None else self.ppl_se / self.ppl

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "scores"}


@dataclass(frozen=True)
class Evaluation(Perplexity):
    """Perplexity plus KL fidelity to the teacher on one domain."""

    name: str = ""
    kl: float | None = None
    """Mean KL(teacher ‖ model) per scored token, nats (a lower bound when top_k < vocab)."""
    kl_se: float | None = None
    top_k: int | None = None
    nll_delta_se: float | None = None
    """Standard error of (this NLL − teacher NLL), paired by window: the noise of a *difference*."""
    agreement: float | None = None
    """Greedy next-token agreement: the share of scored tokens whose most likely next token is the
    teacher's (1.0 for the teacher itself)."""
    agreement_se: float | None = None
    scores: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """Per window ``[nll sum, KL sum, agreeing tokens, scored tokens, teacher NLL sum]`` (float64): what
    :func:`pool` adds up to the evaluation of several window sets (not in :meth:`to_json`)."""


def windows(n: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window of a stream of ``n`` ids: every ``stride`` tokens a window of at most
    ``seq_len``, scoring only the tokens the previous window did not (the windows every perplexity here uses,
    in transformers and in llama.cpp alike).

    >>> windows(10, 4, 2)
    [(0, 4, 4), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    """
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


_windows = windows  # the name tests/test_evaluate.py imports


def window_count(tokens: int, seq_len: int, stride: int) -> int:
    """The windows a stream of ``tokens`` ids is scored in."""
    return len(windows(tokens, seq_len, stride))


def ratio_mean_se(sums: torch.Tensor, counts: torch.Tensor) -> tuple[float, float | None]:
    """Ratio estimator ``Σ sums / Σ counts`` and its standard error, windows as sampling units.

    ``se² = Σ (s_w − R n_w)² / (m (m − 1) n̄²)``; with equal ``n_w`` this is the
    standard error of the mean of per-window means. None with fewer than 2 windows.
    """
    s, n = sums.double(), counts.double()
    m = s.numel()
    r = float(s.sum() / n.sum())
    if m < 2:
        return r, None
    resid = s - r * n
    var = float((resid**2).sum()) / (m * (m - 1) * float(n.mean()) ** 2)
    return r, math.sqrt(var)


def _check_stride(seq_len: int, stride: int) -> None:
    if stride < 1 or stride > seq_len:
        raise ValueError(f"stride must be in [1, seq_len={seq_len}], got {stride}")


def _batches(tokens: torch.Tensor, seq_len: int, stride: int, batch_size: int, keep: list[int] | None = None):
    """Yield ``(window_indices, ids[B, L], scored_counts)``, equal-length windows batched together.

    Order does not change any sum; per-window results are stored by window index. ``keep``: score
    only these windows; the batches stay those of all windows (a batch left without windows is
    empty), so each rank scores windows of its own share of the teacher's batches.
    """
    wins = windows(tokens.numel(), seq_len, stride)
    if not wins:
        raise ValueError(f"evaluation text has {tokens.numel()} tokens; need at least 2")
    kept = None if keep is None else set(keep)
    groups: dict[int, list[int]] = {}
    for w, (b, e, _) in enumerate(wins):
        groups.setdefault(e - b, []).append(w)
    out = []
    for length, idx in groups.items():
        for i in range(0, len(idx), batch_size):
            chunk = [w for w in idx[i : i + batch_size] if kept is None or w in kept]
            if not chunk:
                out.append(([], None, []))
                continue
            ids = torch.stack([tokens[wins[w][0] : wins[w][1]] for w in chunk])
            # Token t is predicted at position t-1; score the last `scored` tokens
            # (the first token of the stream has no prediction).
            ks = [min(wins[w][2], length - 1) for w in chunk]
            out.append((chunk, ids, ks))
    return wins, out


#: Bytes of one evaluation batch's logits and their log-softmax (float32, about three copies alive): a batch of
#: 8 windows of 512 tokens over Llama 3's 128,256-token vocabulary would hold 6.3 GB, more than an onloaded 8B's
#: layer; so a batch is cut to what this holds (at least one window).
LOGITS_BUDGET_BYTES = 1 << 30


def logits_batch(batch_size: int, seq_len: int, model: nn.Module) -> int:
    """Windows per evaluation batch: ``batch_size``, or fewer where their logits would pass
    :data:`LOGITS_BUDGET_BYTES`."""
    cfg = getattr(model.config, "text_config", None) or model.config
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    per_window = 3 * 4 * seq_len * max(vocab, 1)
    return max(1, min(batch_size, LOGITS_BUDGET_BYTES // per_window))


def _share(n_batches: int, shard: bool) -> list[int]:
    """The batches this rank scores: a contiguous share under a process group, else all."""
    return list(dist.shard(n_batches)) if shard else list(range(n_batches))


class _EvalMode:
    """Puts a model in eval mode for a block and restores its training flag."""

    def __init__(self, model: nn.Module):
        self.model, self.was = model, model.training

    def __enter__(self):
        self.model.eval()

    def __exit__(self, *exc):
        self.model.train(self.was)


@torch.no_grad()
def perplexity(
    model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 256, stride: int = 128,
    batch_size: int = 8, desc: str = "perplexity", shard: bool = True,
) -> Perplexity:
    """Perplexity of ``model`` on a 1-D id stream ``tokens``, with its standard error.

    ``shard``: split the windows across the ranks of a running process group (a
    collective: every rank must call it); False for a call made on one rank alone."""
    _check_stride(seq_len, stride)
    tokens = tokens.flatten()
    wins, batches = _batches(tokens, seq_len, stride, logits_batch(batch_size, seq_len, model))
    device = input_device(model)
    sums = torch.zeros(len(wins), dtype=torch.float64)
    counts = torch.zeros(len(wins), dtype=torch.float64)
    owned: list[int] = []
    mine = _share(len(batches), shard)
    with _EvalMode(model), progress(total=len(mine), desc=desc, unit="batch") as bar:
        for chunk, ids, ks in (batches[j] for j in mine):
            ids = ids.to(device)
            logp = F.log_softmax(model(input_ids=ids).logits.float()[:, :-1], dim=-1)
            nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, length-1]
            for row, (w, k) in enumerate(zip(chunk, ks)):
                sums[w] = nll[row, -k:].double().sum()
            owned.extend(chunk)
            bar.update(1)
    for chunk, _, ks in batches:
        counts[chunk] = torch.tensor(ks, dtype=torch.float64)
    if shard:
        sums = dist.fill_rows(sums, owned)
    return _perplexity(sums, counts, seq_len, stride)


def _perplexity(sums: torch.Tensor, counts: torch.Tensor, seq_len: int, stride: int, **extra) -> Perplexity:
    mean, se = ratio_mean_se(sums, counts)
    ppl = math.exp(mean)
    cls = Evaluation if extra else Perplexity
    return cls(ppl=ppl, nll=mean, tokens=int(counts.sum()), seq_len=seq_len, stride=stride, windows=int(counts.numel()),
               nll_se=se, ppl_se=None if se is None else ppl * se, **extra)


def _summary(scores: torch.Tensor, seq_len: int, stride: int, name: str, top_k: int | None) -> Evaluation:
    """The :class:`Evaluation` of per-window ``scores`` (see :attr:`Evaluation.scores`)."""
    nll, kl, agree, counts, teacher_nll = (scores[:, i].contiguous() for i in range(5))
    kl_mean, kl_se = ratio_mean_se(kl, counts)
    agreement, agreement_se = ratio_mean_se(agree, counts)
    _, delta_se = ratio_mean_se(nll - teacher_nll, counts)
    return _perplexity(nll, counts, seq_len, stride, name=name, kl=kl_mean, kl_se=kl_se, top_k=top_k,
                       nll_delta_se=delta_se, agreement=agreement, agreement_se=agreement_se, scores=scores)


def pool(*parts: Evaluation) -> Evaluation:
    """One evaluation of the windows of ``parts`` together (disjoint window sets of one domain,
    e.g. the gate's search and confirmation windows of one model): exactly the evaluation of all
    of them, standard errors included."""
    first = parts[0]
    if any(p.scores is None for p in parts):
        raise ValueError("pool needs evaluations made by evaluate (with their per-window scores)")
    return _summary(torch.cat([p.scores for p in parts]), first.seq_len, first.stride, first.name, first.top_k)


register_record(Evaluation)
