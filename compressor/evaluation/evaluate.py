"""Evaluate: perplexity (with a standard error) and KL fidelity to the original model.

Two measurements per evaluation text (a *domain*), on the same windows before
and after a swap, so deltas compare like with like: **perplexity** ``exp(mean
NLL)`` with its standard error, windows as the sampling unit; and **KL
fidelity** ``KL(teacher ‖ student)`` per scored token against the original
model's cached top-k distributions, with the **greedy agreement** that comes
free with them.

>>> teacher = TeacherCache.build(model, tokens, seq_len=256, stride=128)   # doctest: +SKIP
>>> ev = evaluate(model_after_swap, teacher)                                # doctest: +SKIP
>>> ev.ppl, ev.ppl_se, ev.kl                                                # doctest: +SKIP

Where things are (this module re-exports them all under their old names):

* :mod:`compressor.evaluation.perplexity`: the windows and their statistics
  (:func:`windows`, :func:`window_count`, :func:`ratio_mean_se`), the records
  :class:`Perplexity` and :class:`Evaluation`, :func:`perplexity`,
  :func:`logits_batch` with :data:`LOGITS_BUDGET_BYTES`, and :func:`pool`;
* :mod:`compressor.evaluation.teacher`: :class:`TeacherCache`, the coarsened
  KL (:func:`kl_terms`) and :func:`evaluate`;
* :mod:`compressor.evaluation.external`: evaluations of scores measured
  outside :func:`evaluate` (llama.cpp, a reloaded checkpoint):
  :func:`window_evaluation`, :func:`scored_evaluation`, :class:`WindowScores`,
  :func:`window_scores`, :func:`model_scores`;
* :mod:`compressor.evaluation.gate`: :class:`Evaluator` over every domain,
  :class:`DomainEvaluations`, :func:`confirmation_windows`, and the gate's
  rule: :func:`gate_check`, :func:`gate_budget`, :func:`gate_ppl_limit`,
  :func:`ppl_limit`, :func:`upper_quantile`, :func:`headroom_note`,
  :data:`DEFAULT_CONFIDENCE`.

A module attribute is read where it is defined: patch it there (e.g.
``compressor.evaluation.gate.evaluate``), not here.
"""

from __future__ import annotations

from compressor.evaluation.external import (
    WindowScores, model_scores, scored_evaluation, window_evaluation, window_scores,
)
from compressor.evaluation.gate import (
    DEFAULT_CONFIDENCE, DomainEvaluations, Evaluator, confirmation_windows, gate_budget, gate_check, gate_ppl_limit,
    headroom_note, ppl_limit, upper_quantile,
)
from compressor.evaluation.perplexity import (
    LOGITS_BUDGET_BYTES, Evaluation, Perplexity, _windows, logits_batch, perplexity, pool, ratio_mean_se,
    window_count, windows,
)
from compressor.evaluation.teacher import TeacherCache, evaluate, kl_terms

__all__ = [
    "DEFAULT_CONFIDENCE", "LOGITS_BUDGET_BYTES", "DomainEvaluations", "Evaluation", "Evaluator", "Perplexity",
    "TeacherCache", "WindowScores", "_windows", "confirmation_windows", "evaluate", "gate_budget", "gate_check",
    "gate_ppl_limit", "headroom_note", "kl_terms", "logits_batch", "model_scores", "perplexity", "pool",
    "ppl_limit", "ratio_mean_se", "scored_evaluation", "upper_quantile", "window_count", "window_evaluation",
    "window_scores", "windows",
]
