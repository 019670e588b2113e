"""The size gate: the written file, measured by its writer where it runs, judged by the gate's rule.

The writer measures (:meth:`compressor.output.base.Writer.verify`: per window of every gate domain, the
summed NLL where the file runs — llama.cpp, or plain transformers — and the KL from the original's teacher);
this module decides, once, through
:func:`compressor.evaluation.gate.gate_check` — the upper confidence bound of the change against the
original (transformers; paired by window) within ``policy.ppl_budget`` (``policy.metric: kl``:
``policy.kl_budget``) less ``policy.headroom`` on every domain.

The size target's anchor (llama.cpp's preset of the size for a GGUF, the uniform scheme's checkpoint for
compressed-tensors; named, or the largest that fits a size in bytes or bits per weight) is measured on the same
windows and reported beside the file. **A size run delivers:** when the recipe does not
set the budget itself, a file over the default budget still passes when it is at least as good as that preset
on every domain, at the gate's confidence (the upper bound of the paired per-window difference, file minus
preset, in the gate's metric, is at most 0) — the user asked for a size, and gets a file no worse than what
they would otherwise ship. A budget the recipe sets is held. Where the target measures other anchors of no more
bytes beside it (a GGUF's smaller presets, :func:`best_anchor`), "that preset" is the best of them on the gate's
text, and the report names it.
"""

from __future__ import annotations

import math
from compressor.evaluation.external import scored_evaluation, window_evaluation
from compressor.evaluation.gate import gate_check, upper_quantile
from compressor.evaluation.perplexity import ratio_mean_se
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import PolicyConfig


def explicit_budget(pol: PolicyConfig) -> bool:
    """Whether the recipe set the gate's budget itself (held as it is), or left the default (a size run then
    also passes a file at least as good as the anchor beside it)."""
    return ("kl_budget" if pol.metric == "kl" else "ppl_budget") in pol.model_fields_set


def judge(check: dict, result: CompressionResult, pol: PolicyConfig, preset: dict | None = None) -> tuple[bool, str]:
    """The gate on the file ``check`` measured (its ``domains`` carry each window's scores): every domain's
    row gets its bound, limit and verdict; ``preset``: the preset's scores per domain (:func:`measure_preset`)
    for the comparison a default budget also accepts. Returns (passed, the gate's words)."""
    base = getattr(result.baseline, "domains", None) or {}
    candidates = {d["name"]: _evaluation(d, result.teachers.get(d["name"]), base[d["name"]]) for d in check["domains"]}
    ok, why, per = gate_check({n: base[n] for n in candidates}, candidates, pol)
    for d in check["domains"]:
        d.update({k: per[d["name"]][k] for k in ("relative_delta_upper", "limit", "passed", "paired", "quantile",
                                                  "confidence", "metric")})
        if d.get("kl_mean") is not None:
            d["kl_upper"] = candidates[d["name"]].kl + per[d["name"]]["quantile"] * (candidates[d["name"]].kl_se or 0)
    check["gate_rule"] = "budget"
    if not ok and preset and not explicit_budget(pol):
        better = [_against(d, preset[d["name"]], pol) for d in check["domains"]]
        if all(better):
            ok, check["gate_rule"] = True, "preset"
            why = (f"over the default budget ({why}), but at least as good as {_best(check)['called']} on every "
                   "domain; set the budget in the recipe to hold the file to it")
    for d in check["domains"]:
        d.pop("scores", None)
    check["gate_passed"] = ok or not pol.gate
    return check["gate_passed"], why


def _evaluation(d: dict, teacher, base):
    """The file's :class:`Evaluation` on one domain: with the original's teacher, its KL and the change paired
    by window; else the NLL alone (paired with the baseline's windows where they line up)."""
    s = d["scores"]
    if teacher is not None and s.kl is not None:
        return scored_evaluation(s.nll, s.kl, s.agree, s.tokens, teacher)
    paired = (teacher.window_nll, teacher.window_counts) if teacher is not None else None
    return window_evaluation(s.nll, s.tokens, name=d["name"], seq_len=base.seq_len, stride=base.stride,
                             teacher=paired)


def _against(d: dict, preset, pol: PolicyConfig) -> bool:
    """The file against the preset on one domain, paired by window in the gate's metric: the difference
    (file − preset, nats per token) and its upper bound at the gate's confidence go into the row."""
    import torch

    s = d["scores"]
    kl = pol.metric == "kl" and s.kl is not None and preset.kl is not None
    mine, theirs = (s.kl, preset.kl) if kl else (s.nll, preset.nll)
    diff = torch.tensor(mine, dtype=torch.float64) - torch.tensor(theirs, dtype=torch.float64)
    mean, se = ratio_mean_se(diff, torch.tensor(s.tokens, dtype=torch.float64))
    upper = mean + upper_quantile(pol.confidence, len(s.tokens)) * (se or 0.0)
    d["against_preset"] = {"metric": "kl" if kl else "nll", "difference": mean, "upper_bound": upper,
                           "at_least_as_good": upper <= 0.0}
    return upper <= 0.0


def preset_rows(check: dict, preset: dict, scores: dict, called: str) -> None:
    """The preset's perplexity, change and KL beside the file's, per domain and (the first domain) in
    ``check['preset']``."""
    for d in check["domains"]:
        s = scores[d["name"]]
        ref = d.get("reference_perplexity")
        ppl = math.exp(sum(s.nll) / sum(s.tokens))
        d["preset_perplexity"] = ppl
        d["preset_relative_change"] = ppl / ref - 1.0 if ref else None
        d.update({f"preset_{k}": v for k, v in s.kl_summary().items()})
    first = check["domains"][0]
    check["preset"] = {"name": preset["name"], "file_bytes": preset["file_bytes"],
                       "perplexity": first["preset_perplexity"], "relative_change": first["preset_relative_change"],
                       "kl_mean": first.get("preset_kl_mean"), "called": called, "made_by": preset.get("made_by")}


def _best(check: dict) -> dict:
    """The anchor the gate's preset rule compares with: the best of no more bytes, else the size's own."""
    return check.get("best_preset") or check["preset"]


def _metric(scores: dict, pol: PolicyConfig) -> float:
    """An anchor's score on the gate's text: its mean per token, summed over the domains, in the gate's metric
    (KL from the original under ``policy.metric: kl`` where measured, else the NLL); lower is better."""
    total = 0.0
    for s in scores.values():
        kl = pol.metric == "kl" and s.kl is not None
        total += sum(s.kl if kl else s.nll) / max(sum(s.tokens), 1)
    return total


def best_anchor(check: dict, preset: dict, scores: dict, rivals: list[tuple[dict, dict]],
                pol: PolicyConfig, called) -> dict:
    """The size's anchor (``preset``, its ``scores``) and the ``rivals`` of no more bytes (each (preset, scores)),
    each one's change and KL per domain in ``check['rivals']``; when a rival is better on the gate's text
    (:func:`_metric`), it is ``check['best_preset']`` and its rows are beside the file's
    (``best_preset_relative_change``, …). Returns the scores the gate's preset rule compares with."""
    if not rivals:
        return scores
    check["rivals"] = []
    for r, sc in rivals:
        rows = {d["name"]: _anchor_row(d, sc[d["name"]]) for d in check["domains"]}
        check["rivals"].append({"name": r["name"], "file_bytes": r["file_bytes"], "called": called(r["name"]),
                                "made_by": r.get("made_by"), "gate_metric": _metric(sc, pol), "domains": rows})
    best, best_scores = min(((preset, scores), *rivals), key=lambda ps: _metric(ps[1], pol))
    if best is preset:
        return scores
    for d in check["domains"]:
        d.update({f"best_preset_{k}": v for k, v in _anchor_row(d, best_scores[d["name"]]).items()})
    first = check["domains"][0]
    check["best_preset"] = {"name": best["name"], "file_bytes": best["file_bytes"], "called": called(best["name"]),
                            "perplexity": first["best_preset_perplexity"],
                            "relative_change": first["best_preset_relative_change"],
                            "kl_mean": first.get("best_preset_kl_mean"), "made_by": best.get("made_by"),
                            "why": f"of no more bytes than {called(preset['name'])}, and better on the gate's text"}
    return best_scores


def _anchor_row(d: dict, s) -> dict:
    ref = d.get("reference_perplexity")
    ppl = math.exp(sum(s.nll) / sum(s.tokens))
    return {"perplexity": ppl, "relative_change": ppl / ref - 1.0 if ref else None, **s.kl_summary()}


def message(check: dict, pol: PolicyConfig) -> str:
    """One line: the file's bytes against the budget, each domain's change with its bound (and KL), the
    preset's beside it, and the rule the file passed by."""
    preset, best = check.get("preset"), check.get("best_preset")
    also = (lambda d: f"; {best['called']}, {best['file_bytes']:,} bytes: {_shown(d, 'best_preset_')}") if best else (
        lambda d: "")
    changes = "; ".join(f"{d['name']} {_shown(d, '')} ({pol.confidence:.0%} bound "
                        f"{_bound(d, pol)}" + (f"; {preset['called']}: {_shown(d, 'preset_')}{also(d)})"
                                               if preset else ")") for d in check["domains"])
    if pol.metric == "kl":
        rule = f"KL budget {pol.kl_budget:.4f} nats/token"
    else:
        rule = f"budget {pol.ppl_budget:+.0%} ({pol.budget_mode}"
        rule += f"{f', the bound held to {1 - pol.headroom:.0%} of it' if pol.headroom else ''})"
    if check.get("gate_rule") == "preset":
        rule += (f" — over it, passed as at least as good as {_best(check)['called']} on every domain "
                 "(the budget is the default; set it in the recipe to hold the file to it)")
    return (
        f"{check.get('planned_format', 'the file')} of {check['file_bytes']:,} bytes "
        f"(budget {check['budget_bytes']:,}); "
        f"in {check.get('runtime', 'llama.cpp')} against the original: {changes}; {rule}"
    )


def _shown(d: dict, prefix: str) -> str:
    change = d.get(f"{prefix}relative_change")
    out = f"{100 * change:+.2f} %" if change is not None else "n/a"
    kl = d.get(f"{prefix}kl_mean")
    return out + (f", KL {kl:.4f}" if kl is not None else "")


def _bound(d: dict, pol: PolicyConfig) -> str:
    if pol.metric == "kl" and d.get("kl_upper") is not None:
        return f"KL {d['kl_upper']:.4f}"
    return f"{100 * d['relative_delta_upper']:+.2f} %"
