"""Task evaluation beside perplexity: lm-evaluation-harness tasks on the original and the compressed model.

``evaluation.tasks`` names lm-eval tasks (``evaluation.task_paths``: local task folders, lm-eval's
``include_path``); :func:`run_tasks` scores one model with them, :func:`compare_tasks` puts the two
models side by side and applies ``policy.task_budget`` (the largest accuracy drop allowed). lm-eval is
the optional extra ``compressor[eval]``; a recipe naming tasks without it is refused before loading
(:func:`compressor.core.extras.require`).

>>> before = run_tasks(model, tokenizer, recipe.task_section())           # doctest: +SKIP
>>> # … compress …
>>> after = run_tasks(model, tokenizer, recipe.task_section())            # doctest: +SKIP
>>> compare_tasks(before, after, budget=0.02)["passed"]                   # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math

from compressor.core.extras import require

logger = logging.getLogger(__name__)

#: The metric a task is judged by, first found first (lm-eval's names).
PRIMARY_METRICS = ("acc_norm", "acc", "exact_match", "f1", "mcc")


def run_tasks(model, tokenizer, cfg) -> dict[str, dict]:
    """``{task: {metric: value, metric_stderr: value, "primary": metric, "samples": n}}`` for one model.

    ``cfg``: the :class:`~compressor.recipe.schema.EvaluationConfig` naming ``tasks`` (its
    ``task_paths``, ``task_limit``, ``task_batch_size``). Runs lm-eval's ``simple_evaluate`` on the
    model object as it is (zero-shot, no chat template, fixed seeds: the same settings for both models)."""
    require("lm_eval", "evaluation.tasks")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=cfg.task_batch_size)
    manager = TaskManager(include_path=list(cfg.task_paths) or None)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(cfg.tasks), task_manager=manager, limit=cfg.task_limit,
                                  num_fewshot=0, log_samples=False, random_seed=0, numpy_random_seed=0,
                                  torch_random_seed=0, fewshot_random_seed=0)
    results = {}
    for task, row in (out.get("results") or {}).items():
        metrics = {}
        for key, value in row.items():
            name, _, filt = key.partition(",")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or name == "alias":
                continue
            metrics[name if filt in ("", "none") else f"{name},{filt}"] = float(value)
        primary = next((m for m in PRIMARY_METRICS if m in metrics), None)
        if primary is None:
            primary = next((m for m in metrics if not m.endswith("_stderr")), None)
        n = (out.get("n-samples") or {}).get(task, {})
        results[task] = {**metrics, "primary": primary, "samples": n.get("effective", n.get("original"))}
    return results


def compare_tasks(before: dict[str, dict], after: dict[str, dict], budget: float | None) -> dict:
    """Both models' scores side by side, each task's change in its primary metric, and the verdict of
    ``budget`` (the largest drop allowed; None: reported, not gated)."""
    rows, over = [], []
    for task in sorted(before):
        b, a = before[task], after.get(task, {})
        metric = b.get("primary")
        vb, va = b.get(metric), a.get(metric)
        delta = None if vb is None or va is None else va - vb
        se = _paired_se(b.get(f"{metric}_stderr"), a.get(f"{metric}_stderr"))
        passed = budget is None or (delta is not None and -delta <= budget + 1e-12)
        if not passed:
            over.append(f"{task}: {metric} {vb:.4f} → {va:.4f} (drop {-delta:.4f} > {budget:g})")
        rows.append({"task": task, "metric": metric, "original": vb, "compressed": va, "delta": delta,
                     "stderr": se, "samples": b.get("samples"), "passed": passed})
    return {"budget": budget, "passed": not over, "message": "; ".join(over) or None, "tasks": rows,
            "original": before, "compressed": after}


def _paired_se(a: float | None, b: float | None) -> float | None:
    """Standard error of a difference of two scores, as if independent (an upper bound for the same items)."""
    if a is None or b is None or a != a or b != b:
        return None
    return math.sqrt(a * a + b * b)
