"""Evaluate: perplexity (with a standard error) and KL fidelity to the original model.

Windows of ``seq_len`` tokens advance by ``stride``; in each window only the
tokens not already scored by the previous window count (the rest is context),
exactly as in the transformers perplexity guide. The same windows are used
before and after a swap, so deltas compare like with like.

Two measurements per evaluation text (a *domain*):

* **perplexity** ``exp(mean NLL)`` with its standard error. The sampling unit is
  the window (tokens inside a window are strongly correlated, windows much
  less so): the mean NLL is the ratio estimator ``Σ S_w / Σ n_w`` of per-window
  NLL sums ``S_w`` over scored-token counts ``n_w``, its standard error the usual
  ratio-estimator one, and the perplexity's by the delta method
  (``se_ppl = ppl · se_nll``).
* **greedy agreement**: the share of scored tokens where the model's most likely
  next token is the teacher's (the teacher's top-1, already cached: no extra pass).
* **KL fidelity** ``KL(teacher ‖ student)`` per scored token, where the teacher
  is the original model. A :class:`TeacherCache` is built once, before anything
  is replaced, and keeps per scored token only the teacher's top-k log-probs,
  their token ids and the log of the remaining (tail) mass; no second model is
  held. With ``p`` the teacher and ``q`` the student::

      KL ≈ Σ_{i ∈ topk} p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail)

  which is the KL between the two distributions coarsened to k + 1 outcomes
  (the top-k tokens and "anything else"). It is exact when ``k ≥ vocab`` and
  otherwise a lower bound of the full KL (coarsening never increases a KL, by
  the log-sum inequality); with k = 64 the tail carries little teacher mass, so
  the bound is tight in practice. The cache also keeps the teacher's own NLL
  per token, so the baseline perplexity needs no second pass.

>>> teacher = TeacherCache.build(model, tokens, seq_len=256, stride=128)   # doctest: +SKIP
>>> ev = evaluate(model_after_swap, teacher)                                # doctest: +SKIP
>>> ev.ppl, ev.ppl_se, ev.kl                                                # doctest: +SKIP

Under ``torch.distributed`` (see :mod:`compressor.core.distributed`) each rank
scores a contiguous share of the batches; the per-window sums are gathered
in window order, so every rank computes the same numbers as one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import distributed as dist
from compressor.core.progress import progress
from compressor.engine.resume import register_record

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


def window_evaluation(sums, counts, *, name: str, seq_len: int, stride: int,
                      teacher: tuple | None = None) -> Evaluation:
    """An :class:`Evaluation` from per-window NLL sums and scored tokens measured elsewhere (llama.cpp), its
    change's standard error paired by window with ``teacher`` (the original's ``(NLL sums, scored tokens)``
    per window) when the windows line up.

    >>> e = window_evaluation([20.0, 22.0], [10, 10], name="prose", seq_len=11, stride=11)
    >>> round(e.nll, 2), e.windows
    (2.1, 2)
    """
    sums = torch.as_tensor(sums, dtype=torch.float64)
    counts = torch.as_tensor(counts, dtype=torch.float64)
    nll, nll_se = ratio_mean_se(sums, counts)
    delta_se = None
    if teacher is not None:
        t_sums, t_counts = (torch.as_tensor(x, dtype=torch.float64).cpu() for x in teacher)
        if len(t_sums) == len(sums) and torch.equal(t_counts.long(), counts.long()):
            _, delta_se = ratio_mean_se(sums - t_sums, counts)
    return Evaluation(ppl=math.exp(nll), nll=nll, tokens=int(counts.sum()), seq_len=seq_len, stride=stride,
                      windows=len(sums), nll_se=nll_se, ppl_se=None if nll_se is None else math.exp(nll) * nll_se,
                      name=name, nll_delta_se=delta_se)


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
    device = model.get_input_embeddings().weight.device
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
        device = model.get_input_embeddings().weight.device
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


def _kl_terms(student_logp: torch.Tensor, t_logp: torch.Tensor, t_idx: torch.Tensor, t_tail: torch.Tensor) -> torch.Tensor:
    """Per-token coarsened KL(teacher ‖ student) over (top-k, tail); see the module docstring."""
    q_k = student_logp.gather(-1, t_idx)
    kl = (t_logp.exp() * (t_logp - q_k)).sum(-1)
    q_tail = _tail_logp(student_logp, t_idx)
    p_tail = t_tail.exp()
    # 0 · log 0 = 0: with no teacher tail mass the term vanishes whatever q_tail is.
    tail_term = torch.where(p_tail > 0, p_tail * (t_tail - q_tail), torch.zeros_like(p_tail))
    return kl + tail_term


@torch.no_grad()
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
    device = model.get_input_embeddings().weight.device
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


def scored_evaluation(nll, kl, agree, counts, teacher: "TeacherCache", windows: list[int] | None = None) -> Evaluation:
    """The :class:`Evaluation` of per-window sums measured elsewhere (llama.cpp's logits against ``teacher``'s
    distributions): NLL, coarsened KL and agreeing tokens per window, ``counts`` scored tokens; ``windows``:
    which of the teacher's windows they are (default: every one, in order). KL, agreement and the change's
    standard error paired by window, exactly as :func:`evaluate` gives them."""
    kept = teacher.windows if windows is None else list(windows)
    scores = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x in (nll, kl, agree, counts)]
                         + [teacher.teacher_sums()[kept].double()], dim=1)
    return _summary(scores, teacher.seq_len, teacher.stride, teacher.name, teacher.top_k)


@dataclass
class WindowScores:
    """A model's per-window scores measured outside :func:`evaluate` (llama.cpp; a reloaded checkpoint): what
    the size gate pairs, window by window, with the original."""

    nll: list[float]
    """Summed NLL of each window's scored tokens."""
    tokens: list[int]
    """Scored tokens per window."""
    kl: list[float] | None = None
    """Summed KL(original ‖ model) per window (the teacher's top-k and tail, as the gate's KL), with a teacher."""
    agree: list[float] | None = None
    """Tokens per window whose most likely next token is the original's."""
    token_kl: object = field(default=None, repr=False)
    """Every scored token's KL (numpy), in window order: the median and the 99th percentile."""

    def row(self, name: str, reference_ppl: float | None) -> dict:
        """A gate domain's row of a measured file: its perplexity against the original's, the KL figures, and
        these scores (``scores``: the size gate pairs them by window, then drops them)."""
        ppl = math.exp(sum(self.nll) / sum(self.tokens))
        return {"name": name, "perplexity": ppl, "scored_tokens": int(sum(self.tokens)),
                "reference_perplexity": reference_ppl,
                "relative_change": ppl / reference_ppl - 1.0 if reference_ppl else None, **self.kl_summary(),
                "scores": self}

    def kl_summary(self) -> dict:
        """Mean, median and 99th-percentile KL per token and the same-top-token rate (``llama-perplexity
        --kl-divergence``'s figures); {} without a teacher."""
        import numpy as np

        if self.kl is None:
            return {}
        n = sum(self.tokens)
        return {"kl_mean": sum(self.kl) / n, "kl_median": float(np.median(self.token_kl)),
                "kl_p99": float(np.quantile(self.token_kl, 0.99)), "same_top_token": sum(self.agree) / n}


def window_scores(logits, tokens: torch.Tensor, seq_len: int, stride: int, teacher: "TeacherCache | None" = None
                  ) -> WindowScores:
    """Per window of ``tokens`` (:func:`windows`), the NLL of its scored tokens and, with ``teacher`` (the
    original's cache on the same tokens and windows), their KL from the original and agreeing tokens.
    ``logits(ids, k)``: the model's logits ``[k, vocab]`` predicting the last ``k`` tokens of ``ids``."""
    import numpy as np

    ids_all = tokens.flatten().tolist()
    out = WindowScores([], [], *(([], [], []) if teacher is not None else ()))
    for w, (begin, end, scored) in enumerate(windows(len(ids_all), seq_len, stride)):
        ids = ids_all[begin:end]
        k = min(scored, len(ids) - 1)
        logp = torch.log_softmax(logits(ids, k).double(), dim=-1)
        target = torch.tensor(ids[len(ids) - k:])
        out.nll.append(float(-logp.gather(-1, target[:, None]).sum()))
        out.tokens.append(k)
        if teacher is not None:
            kl = kl_terms(logp.float(), teacher, w).double()
            top1 = teacher.topk_idx[int(teacher.offsets[w]): int(teacher.offsets[w + 1]), 0]
            out.kl.append(float(kl.sum()))
            out.agree.append(float((logp.argmax(-1) == top1).sum()))
            out.token_kl.append(kl.numpy())
    if teacher is not None:
        out.token_kl = np.concatenate(out.token_kl)
    return out


@torch.no_grad()
def model_scores(model: nn.Module, tokens: torch.Tensor, seq_len: int, stride: int,
                 teacher: "TeacherCache | None" = None) -> WindowScores:
    """:func:`window_scores` of a transformers model (a reloaded checkpoint), one window at a time."""
    device = model.get_input_embeddings().weight.device

    def logits(ids: list[int], k: int) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids], device=device)).logits[0, len(ids) - 1 - k: len(ids) - 1]
        return out.float().cpu()
    with _EvalMode(model):
        return window_scores(logits, tokens, seq_len, stride, teacher)


def kl_terms(student_logp: torch.Tensor, teacher: "TeacherCache", window: int) -> torch.Tensor:
    """Per scored token of ``window``, KL(teacher ‖ student) coarsened to the teacher's top-k and tail, from
    the student's log-probabilities at those tokens (``[scored, vocab]``)."""
    sl = slice(int(teacher.offsets[window]), int(teacher.offsets[window + 1]))
    return _kl_terms(student_logp, teacher.topk_logp[sl], teacher.topk_idx[sl], teacher.tail_logp[sl])


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


@dataclass(frozen=True)
class DomainEvaluations:
    """One :class:`Evaluation` per domain; attribute access reads the first (primary) domain.

    The primary-domain attributes (``ppl``, ``tokens``…) keep single-domain code
    working; the gate itself looks at every domain through :func:`gate_check`.
    """

    domains: dict[str, Evaluation]

    @property
    def primary(self) -> Evaluation:
        return next(iter(self.domains.values()))

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "domains":
            raise AttributeError(name)
        return getattr(self.primary, name)

    def to_json(self) -> dict:
        return dict(self.primary.to_json(), domains={k: v.to_json() for k, v in self.domains.items()})

    def pooled(self, other: "DomainEvaluations") -> "DomainEvaluations":
        """Each domain's evaluation over this one's windows and ``other``'s together (:func:`pool`)."""
        return DomainEvaluations({n: pool(ev, other.domains[n]) for n, ev in self.domains.items()})


def confirmation_windows(windows: int, fraction: float) -> list[int]:
    """The windows (of ``windows``, in order) held out for confirmation: a share ``fraction`` of them,
    spread evenly and chosen by position alone (window ``i`` when ``⌊(i+1)·f⌋ > ⌊i·f⌋``; every 4th at
    0.25, every other at 0.5), so the split needs no random seed and no second baseline pass.

    >>> confirmation_windows(8, 0.25), confirmation_windows(5, 0.5), confirmation_windows(8, 0)
    ([3, 7], [1, 3], [])
    """
    eps = 1e-9  # 10 · 0.1 is not always 1.0 in floating point
    return [i for i in range(windows) if math.floor((i + 1) * fraction + eps) > math.floor(i * fraction + eps)]


class Evaluator:
    """Teacher caches for every evaluation domain, built once from the original model.

    >>> ev = Evaluator.build(model, {"wiki": wiki_ids, "code": code_ids}, seq_len=256, stride=128)  # doctest: +SKIP
    >>> baseline = ev.baseline                      # no extra pass: the teacher's own NLL
    >>> after = ev(model)                           # after a swap
    >>> gate_check(baseline, after, recipe.policy)  # doctest: +SKIP
    """

    def __init__(self, teachers: list[TeacherCache]):
        names = [t.name for t in teachers]
        if len(set(names)) != len(names) or not teachers:
            raise ValueError(f"evaluation domains need distinct names, got {names}")
        self.teachers = teachers

    @classmethod
    def build(
        cls, model: nn.Module, domains: dict[str, torch.Tensor], *, seq_len: int | dict[str, int] = 256,
        stride: int | dict[str, int] = 128, batch_size: int | dict[str, int] = 8, top_k: int = 64,
    ) -> "Evaluator":
        """``seq_len`` / ``stride`` / ``batch_size`` are one value or one per domain name."""
        def get(v, name):
            return v[name] if isinstance(v, dict) else v

        return cls([
            TeacherCache.build(model, ids, seq_len=get(seq_len, n), stride=get(stride, n),
                               batch_size=get(batch_size, n), top_k=top_k, name=n, desc=f"teacher: {n}")
            for n, ids in domains.items()
        ])

    @property
    def baseline(self) -> DomainEvaluations:
        return DomainEvaluations({t.name: t.baseline for t in self.teachers})

    def split(self, fraction: float) -> tuple["Evaluator", "Evaluator | None"]:
        """(search, confirmation): every domain's windows split by :func:`confirmation_windows`, as two
        evaluators sharing these teacher caches (no pass of the model); ``fraction`` 0: (self, None).

        >>> search, confirm = ev.split(0.25)   # doctest: +SKIP
        >>> len(confirm.teachers[0].windows)   # 8 of 32 windows                 # doctest: +SKIP
        """
        if not fraction:
            return self, None
        search, confirm = [], []
        for t in self.teachers:
            every = t.windows
            held = {every[j] for j in confirmation_windows(len(every), fraction)}
            search.append(t.subset([w for w in every if w not in held]))
            confirm.append(t.subset(sorted(held)))
        return Evaluator(search), Evaluator(confirm)

    def __call__(self, model: nn.Module, desc: str = "evaluate") -> DomainEvaluations:
        many = len(self.teachers) > 1
        return DomainEvaluations({
            t.name: evaluate(model, t, desc=f"{desc} [{t.name}]" if many else desc) for t in self.teachers
        })


def _as_domains(x) -> dict[str, Perplexity]:
    if isinstance(x, DomainEvaluations):
        return x.domains
    if isinstance(x, dict):
        return x
    return {getattr(x, "name", "") or "evaluation": x}


def ppl_limit(base: float, budget: float, mode: str) -> float:
    return base * (1.0 + budget) if mode == "relative" else base + budget


#: One-sided confidence of the gate's upper bound when the policy does not say (``policy.confidence``).
DEFAULT_CONFIDENCE = 0.9


def upper_quantile(confidence: float, windows: int | None) -> float:
    """The one-sided Student-t quantile for ``windows − 1`` degrees of freedom (windows are the sampling
    unit), by the Cornish-Fisher expansion around the normal quantile (within 0.5 % of the exact value
    from 10 degrees of freedom on); the normal quantile when the window count is unknown. 0 at 0.5.

    >>> round(upper_quantile(0.9, 32), 3), round(upper_quantile(0.5, 32), 3)
    (1.309, 0.0)
    """
    from statistics import NormalDist

    z = NormalDist().inv_cdf(confidence)
    if not windows or windows < 3:
        return z
    v = windows - 1
    return z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)


def _change_se(b, c) -> tuple[float | None, bool]:
    """Standard error of the candidate's mean NLL minus the baseline's, and whether it is paired.

    Paired by window (the same windows scored by both models, :attr:`Evaluation.nll_delta_se`) when the
    candidate came from :func:`evaluate`; else the two perplexities' own errors taken as independent,
    which overstates the noise of a difference (conservative); None with one window."""
    paired = getattr(c, "nll_delta_se", None)
    if paired is not None:
        return paired, True
    if getattr(c, "nll_se", None) is None:
        return None, False
    return math.sqrt(c.nll_se**2 + (getattr(b, "nll_se", None) or 0.0) ** 2), False


def gate_budget(policy, metric: str | None = None) -> float:
    """The budget the gate's bound is held to: the policy's ``kl_budget`` (``metric`` kl; default: the
    policy's metric) or ``ppl_budget``, less its ``headroom`` (the share kept for text unlike the gate's;
    0 where the policy has none)."""
    metric = metric or getattr(policy, "metric", "ppl")
    budget = policy.kl_budget if metric == "kl" else policy.ppl_budget
    return budget * (1.0 - getattr(policy, "headroom", 0.0))


def headroom_note(headroom: float) -> str:
    """What the limit is, in words, when ``policy.headroom`` lowers it ('' without headroom)."""
    return f" (the budget less policy.headroom {headroom:.0%})" if headroom else ""


def gate_ppl_limit(base: float, policy) -> float:
    """The perplexity the gate's bound must stay under: :func:`ppl_limit` at :func:`gate_budget`."""
    return ppl_limit(base, gate_budget(policy, "ppl"), policy.budget_mode)


def gate_check(baseline, candidate, policy) -> tuple[bool, str, dict[str, dict]]:
    """Does ``candidate`` stay within ``policy``'s budget on *every* domain, with confidence?

    ``baseline`` / ``candidate``: a :class:`DomainEvaluations`, a ``{name:
    Evaluation}`` dict, or one :class:`Perplexity`. The decision is on the **upper confidence
    bound** of the change (one-sided, ``policy.confidence``, default 0.9), not on the measured
    change alone: with windows as the sampling unit, the paired per-window differences give the
    change and its standard error ``se``, and the bound is the change plus ``t · se`` (``t``:
    :func:`upper_quantile` for the domain's window count).

    * ``ppl``: the bound of the perplexity, ``ppl · exp(t · se_ΔNLL)``, must be ≤
      ``limit(baseline ppl, gate_budget(policy), policy.budget_mode)``;
    * ``kl``: the bound of the mean KL from the original model, ``kl + t · se_KL``, must be ≤
      ``gate_budget(policy)`` nats/token.

    :func:`gate_budget` is the budget less ``policy.headroom`` (default 0.2: a +5 % budget is held at +4 %),
    the share kept for text unlike the gate's.

    ``policy.confidence: 0.5`` is the bare point test. Returns ``(passed, message, per_domain)``;
    each row holds the measured change, its standard error, the bound and the limit, and the
    message names every domain over budget.
    """
    metric = getattr(policy, "metric", "ppl")
    confidence = getattr(policy, "confidence", DEFAULT_CONFIDENCE)
    base, cand = _as_domains(baseline), _as_domains(candidate)
    if set(base) != set(cand):
        raise ValueError(f"baseline domains {sorted(base)} differ from candidate domains {sorted(cand)}")
    per, failed = {}, []
    level = f"{confidence:.0%} bound"
    budget = gate_budget(policy)
    for name, b in base.items():
        c = cand[name]
        q = upper_quantile(confidence, getattr(c, "windows", None))
        se, paired = _change_se(b, c)
        row = {"metric": metric, "confidence": confidence, "quantile": q, "paired": paired,
               "baseline_ppl": b.ppl, "ppl": c.ppl, "ppl_se": c.ppl_se, "relative_delta": c.ppl / b.ppl - 1,
               "kl": getattr(c, "kl", None), "kl_se": getattr(c, "kl_se", None)}
        # the perplexity's upper bound, whatever the metric: reports show it next to the change
        row["ppl_upper"] = c.ppl * math.exp(q * se) if se is not None else c.ppl
        row["relative_delta_upper"] = row["ppl_upper"] / b.ppl - 1
        if metric == "kl":
            if row["kl"] is None:
                raise ValueError("policy.metric=kl needs evaluations with a teacher (Evaluator / evaluate)")
            row["limit"] = budget
            row["kl_upper"] = row["kl"] + q * (row["kl_se"] or 0.0)
            row["passed"] = row["kl_upper"] <= budget
            shown = (f"KL {row['kl']:.4f} ({level} {row['kl_upper']:.4f}) {'≤' if row['passed'] else '>'} "
                     f"{budget:.4f} nats/token")
        else:
            row["limit"] = gate_ppl_limit(b.ppl, policy)
            row["passed"] = row["ppl_upper"] <= row["limit"]
            shown = (f"perplexity {c.ppl:.4f} ({row['relative_delta']:+.2%}; {level} "
                     f"{row['relative_delta_upper']:+.2%}) {'≤' if row['passed'] else '>'} limit {row['limit']:.4f}")
        row["summary"] = shown
        per[name] = row
        if not row["passed"]:
            failed.append(f"{name}: {shown}")
    if failed:
        return False, "over budget on " + "; ".join(failed), per
    if len(per) == 1:
        return True, next(iter(per.values()))["summary"], per
    return True, "; ".join(f"{n}: {r['summary']}" for n, r in per.items()), per


register_record(DomainEvaluations, Evaluation, TeacherCache)
