"""Evaluations of scores measured outside :func:`~compressor.evaluation.teacher.evaluate`.

A written file is measured where it runs (llama.cpp's logits) or after it is
reloaded (a transformers checkpoint); what comes back are per-window sums,
which these functions turn into the same :class:`~compressor.evaluation.perplexity.Evaluation`
the gate reads, paired by window with the original where the windows line up:
:func:`window_evaluation` (NLL sums alone), :func:`scored_evaluation` (NLL, KL
and agreement against a teacher cache), :class:`WindowScores` with
:func:`window_scores` and :func:`model_scores` (scoring a model window by
window from its logits).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from compressor.core.onload import input_device
from compressor.evaluation.perplexity import Evaluation, _EvalMode, _summary, ratio_mean_se, windows
from compressor.evaluation.teacher import TeacherCache, kl_terms


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
    """Every scored token's KL (numpy), in window order: the median and the 99th and 99.9th percentiles."""

    def row(self, name: str, reference_ppl: float | None) -> dict:
        """A gate domain's row of a measured file: its perplexity against the original's, the KL figures, and
        these scores (``scores``: the size gate pairs them by window, then drops them)."""
        ppl = math.exp(sum(self.nll) / sum(self.tokens))
        return {"name": name, "perplexity": ppl, "scored_tokens": int(sum(self.tokens)),
                "reference_perplexity": reference_ppl,
                "relative_change": ppl / reference_ppl - 1.0 if reference_ppl else None, **self.kl_summary(),
                "scores": self}

    def kl_summary(self) -> dict:
        """Mean, median, 99th- and 99.9th-percentile KL per token and the same-top-token rate
        (``llama-perplexity --kl-divergence``'s figures); {} without a teacher. The 99.9th percentile is the
        tail a mean hides: a file that wrecks one token in a thousand (a broken tensor, a code token the
        calibration never saw) moves it by orders of magnitude and the mean barely."""
        import numpy as np

        if self.kl is None:
            return {}
        n = sum(self.tokens)
        p99, p999 = (float(q) for q in np.quantile(self.token_kl, (0.99, 0.999)))
        return {"kl_mean": sum(self.kl) / n, "kl_median": float(np.median(self.token_kl)),
                "kl_p99": p99, "kl_p999": p999, "same_top_token": sum(self.agree) / n}


#: Rows of a window's logits scored at once (:func:`window_scores`).
SCORE_ROWS = 64


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
        raw = logits(ids, k)
        target = torch.tensor(ids[len(ids) - k:])
        nll, kl, agree = [], [], []
        # a few rows at a time (each row's numbers are its own): a window's logits in float64 are 8 · k · vocab
        # bytes, twice over (0.4 GB at 512 × 49,152, 2.1 GB at Gemma's 262,144)
        for a in range(0, k, SCORE_ROWS):
            logp = torch.log_softmax(raw[a:a + SCORE_ROWS].double(), dim=-1)
            nll.append(-logp.gather(-1, target[a:a + SCORE_ROWS, None]))
            if teacher is not None:
                kl.append(kl_terms(logp.float(), teacher, w, rows=slice(a, a + SCORE_ROWS)).double())
                top1 = teacher.topk_idx[
                    int(teacher.offsets[w]) + a : int(teacher.offsets[w]) + min(a + SCORE_ROWS, k), 0
                ]
                agree.append(logp.argmax(-1) == top1)
            del logp
        out.nll.append(float(torch.cat(nll).sum()))
        out.tokens.append(k)
        if teacher is not None:
            kl = torch.cat(kl)
            out.kl.append(float(kl.sum()))
            out.agree.append(float(torch.cat(agree).double().sum()))
            out.token_kl.append(kl.numpy())
    if teacher is not None:
        out.token_kl = np.concatenate(out.token_kl)
    return out


@torch.no_grad()
def model_scores(model: nn.Module, tokens: torch.Tensor, seq_len: int, stride: int,
                 teacher: "TeacherCache | None" = None) -> WindowScores:
    """:func:`window_scores` of a transformers model (a reloaded checkpoint), one window at a time."""
    device = input_device(model)

    def logits(ids: list[int], k: int) -> torch.Tensor:
        out = model(input_ids=torch.tensor([ids], device=device)).logits[0, len(ids) - 1 - k: len(ids) - 1]
        return out.float().cpu()
    with _EvalMode(model):
        return window_scores(logits, tokens, seq_len, stride, teacher)
