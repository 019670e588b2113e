"""KL fidelity to the original model: the teacher's cached distributions and :func:`evaluate`.

``KL(teacher ‖ student)`` per scored token, where the teacher is the original
model. A :class:`TeacherCache` is built once, before anything is replaced, and
keeps per scored token only the teacher's top-k log-probs, their token ids and
the log of the remaining (tail) mass; no second model is held. With ``p`` the
teacher and ``q`` the student::

    KL ≈ Σ_{i ∈ topk} p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail)

which is the KL between the two distributions coarsened to k + 1 outcomes (the
top-k tokens and "anything else"). It is exact when ``k ≥ vocab`` and
otherwise a lower bound of the full KL (coarsening never increases a KL, by
the log-sum inequality); with k = 64 the tail carries little teacher mass, so
the bound is tight in practice. The cache also keeps the teacher's own NLL per
token, so the baseline perplexity needs no second pass.

**Greedy agreement** (the model's top token is the teacher's) comes from the cached top-1: no extra pass. Under
``torch.distributed`` (see :mod:`compressor.core.distributed`) each rank
scores a contiguous share of the batches; the per-window sums are gathered
in window order, so every rank computes the same numbers as one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import distributed as dist
from compressor.core.onload import input_device
from compressor.core.progress import progress
from compressor.engine.records import register_record
from compressor.evaluation.perplexity import (
    Evaluation, _batches, _check_stride, _EvalMode, _perplexity, _share, _summary, logits_batch,
)


@dataclass
class TeacherCache:
    """The original model's next-token distributions on one domain's evaluation windows.

    Per scored token (in window order): ``topk_logp`` [T, k] float32,
    ``topk_idx`` [T, k] int64, ``tail_logp`` [T] (log of the mass outside the
    top-k; −inf when k ≥ vocab) and ``nll`` [T] (the teacher's own NLL).
    ``offsets[w]`` is where window ``w``'s tokens start. About 8·k bytes per
    scored token: 2 MiB for 4,096 tokens at k = 64. Under a process group each
    rank fills (and touches the memory of) only its own windows' rows;
    ``window_nll`` (the teacher's NLL sum per window) is complete on every rank.
    """

    tokens: torch.Tensor
    seq_len: int
    stride: int
    batch_size: int
    top_k: int
    topk_logp: torch.Tensor
    topk_idx: torch.Tensor
    tail_logp: torch.Tensor
    nll: torch.Tensor
    offsets: torch.Tensor
    name: str = ""
    baseline: Evaluation | None = field(default=None, repr=False)
    window_nll: torch.Tensor | None = field(default=None, repr=False)
    shards: int = 1
    """Ranks the windows were split across (evaluate must split them the same way)."""
    keep: list[int] | None = None
    """The windows (of all the stream's, in order) that :func:`evaluate` scores; None: every one.
    A :meth:`subset` shares the rows of the cache it was taken from."""

    @classmethod
    @torch.no_grad()
    def build(
        cls, model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 256, stride: int = 128, batch_size: int = 8,
        top_k: int = 64, name: str = "", desc: str = "teacher",
    ) -> "TeacherCache":
        """One pass of the original ``model`` over ``tokens``; also yields the baseline perplexity."""
        _check_stride(seq_len, stride)
        if top_k < 1:
            raise ValueError(f"top_k must be ≥ 1, got {top_k}")
        tokens = tokens.flatten().cpu()
        batch_size = logits_batch(batch_size, seq_len, model)
        wins, batches = _batches(tokens, seq_len, stride, batch_size)
        counts = torch.tensor([min(s, e - b - 1) for b, e, s in wins], dtype=torch.long)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
        total = int(offsets[-1])
        device = input_device(model)
        k_eff = None
        logp_k = idx_k = tail = nll_all = None
        mine = _share(len(batches), True)
        owned: list[int] = []
        with _EvalMode(model), progress(total=len(mine), desc=desc, unit="batch") as bar:
            for chunk, ids, ks in (batches[j] for j in mine):
                ids = ids.to(device)
                logp = F.log_softmax(model(input_ids=ids).logits.float()[:, :-1], dim=-1)
                if k_eff is None:
                    k_eff = min(top_k, logp.shape[-1])
                    logp_k = torch.empty(total, k_eff, dtype=torch.float32)
                    idx_k = torch.empty(total, k_eff, dtype=torch.long)
                    tail = torch.empty(total, dtype=torch.float32)
                    nll_all = torch.empty(total, dtype=torch.float32)
                for row, (w, k) in enumerate(zip(chunk, ks)):
                    lp = logp[row, -k:]  # [k, V]
                    top = lp.topk(k_eff, dim=-1)
                    sl = slice(int(offsets[w]), int(offsets[w + 1]))
                    logp_k[sl] = top.values.cpu()
                    idx_k[sl] = top.indices.cpu()
                    tail[sl] = _tail_logp(lp, top.indices).cpu()
                    nll_all[sl] = -lp.gather(-1, ids[row, -k:, None]).squeeze(-1).cpu()
                owned.extend(chunk)
                bar.update(1)
        if dist.world_size() > 1:  # a rank with no batch learns k from the others (all agree)
            k_eff = next(k for k in dist.all_gather_objects(k_eff) if k is not None)
        if logp_k is None:
            logp_k, idx_k = torch.empty(total, k_eff), torch.empty(total, k_eff, dtype=torch.long)
            tail, nll_all = torch.empty(total), torch.empty(total)
        sums = torch.zeros(len(wins), dtype=torch.float64)
        for w in owned:
            sums[w] = nll_all[offsets[w] : offsets[w + 1]].double().sum()
        sums = dist.fill_rows(sums, owned)
        cache = cls(tokens=tokens, seq_len=seq_len, stride=stride, batch_size=batch_size, top_k=k_eff,
                    topk_logp=logp_k, topk_idx=idx_k, tail_logp=tail, nll=nll_all, offsets=offsets, name=name,
                    window_nll=sums, shards=dist.world_size())
        cache.baseline = _perplexity(sums, counts.double(), seq_len, stride, name=name, kl=0.0, kl_se=0.0,
                                     top_k=k_eff, nll_delta_se=0.0, agreement=1.0, agreement_se=0.0)
        return cache

    @property
    def window_counts(self) -> torch.Tensor:
        """Scored tokens per window, of every window of the stream."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def windows(self) -> list[int]:
        """The windows this cache scores."""
        return list(range(self.offsets.numel() - 1)) if self.keep is None else list(self.keep)

    def teacher_sums(self) -> torch.Tensor:
        """The teacher's NLL sum per window, of every window of the stream."""
        if self.window_nll is not None:
            return self.window_nll
        off = self.offsets  # a cache assembled by hand
        return torch.stack([self.nll[off[w] : off[w + 1]].double().sum() for w in range(off.numel() - 1)])

    def subset(self, windows: list[int]) -> "TeacherCache":
        """The same cache scoring only ``windows`` (indices into all of the stream's, in order), its
        baseline theirs; no copy of the teacher's rows."""
        keep = sorted(windows)
        base = self.baseline
        sub = _perplexity(self.teacher_sums()[keep], self.window_counts[keep].double(), self.seq_len, self.stride,
                          name=self.name, kl=0.0, kl_se=0.0, top_k=self.top_k, nll_delta_se=0.0, agreement=1.0,
                          agreement_se=0.0) if base is not None else None
        return replace(self, keep=keep, baseline=sub)


def _tail_logp(logp: torch.Tensor, top_idx: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside ``top_idx`` (−inf when nothing is left)."""
    if top_idx.shape[-1] >= logp.shape[-1]:
        return torch.full(logp.shape[:-1], -math.inf, dtype=logp.dtype, device=logp.device)
    # logsumexp over the complement is exact; 1 − Σ top would cancel catastrophically.
    return logp.scatter(-1, top_idx, -math.inf).logsumexp(-1)


def _kl_terms(
    student_logp: torch.Tensor, t_logp: torch.Tensor, t_idx: torch.Tensor, t_tail: torch.Tensor
) -> torch.Tensor:
    """Per-token coarsened KL(teacher ‖ student) over (top-k, tail); see the module docstring."""
    q_k = student_logp.gather(-1, t_idx)
    kl = (t_logp.exp() * (t_logp - q_k)).sum(-1)
    q_tail = _tail_logp(student_logp, t_idx)
    p_tail = t_tail.exp()
    # 0 · log 0 = 0: with no teacher tail mass the term vanishes whatever q_tail is.
    tail_term = torch.where(p_tail > 0, p_tail * (t_tail - q_tail), torch.zeros_like(p_tail))
    return kl + tail_term


@torch.no_grad()
def complete_rows(teacher: TeacherCache) -> TeacherCache:
    """Every window's rows on every rank (a collective; nothing to do in one process): for a step rank 0 runs
    alone over all the windows, as the size stage's gate scoring a file in llama.cpp (:func:`kl_terms`). The
    cache stays split for :func:`evaluate`, which still scores each rank's own windows."""
    if teacher.shards == 1:
        return teacher
    _, batches = _batches(teacher.tokens, teacher.seq_len, teacher.stride, teacher.batch_size)
    owned = [w for j in _share(len(batches), True) for w in batches[j][0]]
    off = teacher.offsets
    rows = (teacher.topk_logp, teacher.topk_idx, teacher.tail_logp, teacher.nll)
    local = {w: tuple(t[int(off[w]):int(off[w + 1])].clone() for t in rows) for w in owned}
    for w, parts in enumerate(dist.gather_items(local, len(off) - 1)):
        for t, part in zip(rows, parts):
            t[int(off[w]):int(off[w + 1])] = part
    return teacher


def evaluate(model: nn.Module, teacher: TeacherCache, *, desc: str = "evaluate") -> Evaluation:
    """Perplexity (± SE) and mean KL from the teacher (± SE) of ``model`` on the teacher's windows
    (:attr:`TeacherCache.keep` of them, when it is a subset).

    Streams batch by batch; holds one batch of logits at a time. Under a process group, a
    collective: each rank scores the windows it scored for the teacher.
    """
    if teacher.shards != dist.world_size():
        raise ValueError(f"the teacher cache was built on {teacher.shards} rank(s), this run has "
                         f"{dist.world_size()}: build it in the same process group")
    kept = teacher.windows
    _, batches = _batches(teacher.tokens, teacher.seq_len, teacher.stride, teacher.batch_size, teacher.keep)
    device = input_device(model)
    at = {w: j for j, w in enumerate(kept)}  # window → row of the sums
    sums = torch.zeros(len(kept), 3, dtype=torch.float64)  # NLL, KL, agreeing tokens
    off = teacher.offsets
    mine = [j for j in _share(len(batches), True) if batches[j][0]]
    owned: list[int] = []
    with _EvalMode(model), progress(total=len(mine), desc=desc, unit="batch") as bar:
        for chunk, ids, ks in (batches[j] for j in mine):
            ids = ids.to(device)
            logp = F.log_softmax(model(input_ids=ids).logits.float()[:, :-1], dim=-1)
            for row, (w, k) in enumerate(zip(chunk, ks)):
                lp = logp[row, -k:]
                sl = slice(int(off[w]), int(off[w + 1]))
                sums[at[w], 0] = -lp.gather(-1, ids[row, -k:, None]).double().sum()
                kl = _kl_terms(lp, teacher.topk_logp[sl].to(device), teacher.topk_idx[sl].to(device),
                               teacher.tail_logp[sl].to(device))
                sums[at[w], 1] = kl.double().sum()
                # the teacher's top-1 is its greedy choice: agreement costs one argmax
                sums[at[w], 2] = (lp.argmax(-1) == teacher.topk_idx[sl, 0].to(device)).double().sum()
            owned.extend(at[w] for w in chunk)
            bar.update(1)
    sums = dist.fill_rows(sums, owned)
    scores = torch.cat([sums, teacher.window_counts[kept].double()[:, None],
                        teacher.teacher_sums()[kept].double()[:, None]], dim=1)
    return _summary(scores, teacher.seq_len, teacher.stride, teacher.name, teacher.top_k)


def kl_terms(student_logp: torch.Tensor, teacher: "TeacherCache", window: int, rows: slice | None = None
             ) -> torch.Tensor:
    """Per scored token of ``window`` (of its scored tokens at ``rows``, when given), KL(teacher ‖ student)
    coarsened to the teacher's top-k and tail, from the student's log-probabilities at those tokens
    (``[scored, vocab]``)."""
    first, end = int(teacher.offsets[window]), int(teacher.offsets[window + 1])
    if rows is not None:
        first, end = first + rows.start, min(end, first + rows.stop)
    sl = slice(first, end)
    return _kl_terms(student_logp, teacher.topk_logp[sl], teacher.topk_idx[sl], teacher.tail_logp[sl])


register_record(TeacherCache)
