"""The run report (``report.json``): what was done, measured and decided, for people and pipelines."""

from __future__ import annotations

from pathlib import Path

import torch

from compressor.core.errors import EXIT_GATE, EXIT_OK
from compressor.core.version import __version__
from compressor.evaluation.gate import gate_budget, gate_check
from compressor.inputs.calibration import calibration_texts, source_text
from compressor.inputs.data import CalibrationSet, TextSource
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe
from compressor.reports.sections import REPORT_SCHEMA, SCHEMA_VERSION


def build_report(
    recipe: Recipe, src, model_type: str, r: CompressionResult, cal: CalibrationSet, cache_info: dict, out: Path
) -> dict:
    e = recipe.evaluation_domains()[0]
    return {
        "schema_version": SCHEMA_VERSION,  # what the keys mean: compressor.reports.schema.Report
        "schema": REPORT_SCHEMA,
        "tool_version": __version__,
        "status": "success" if r.gate_passed else "rejected",
        "exit_code": EXIT_OK if r.gate_passed else EXIT_GATE,
        "message": r.gate_message,
        "output": str(out),
        "model": {"source": recipe.model.source, "resolved": src.describe(), "model_type": model_type,
                  "dtype": recipe.model.dtype, "device": recipe.model.device},
        "recipe_sha256": recipe.sha256(),
        "recipe": recipe.to_dict(),
        "calibration": {"data": recipe.calibration.describe(), "seq_len": cal.seq_len,
                        "fit_windows": int(cal.fit.shape[0]), "heldout_windows": int(cal.heldout.shape[0]),
                        "tokens": int(cal.fit.numel() + cal.heldout.numel())},
        "cache": cache_info,
        "perplexity": {
            "data": e.dataset, "baseline": r.baseline.to_json(), "final": r.final.to_json(),
            "budget": r.budget_ppl, "ppl_budget": recipe.policy.ppl_budget, "budget_mode": recipe.policy.budget_mode,
            "delta": r.final.ppl - r.baseline.ppl, "relative_delta": r.final.ppl / r.baseline.ppl - 1,
        },
        "params": {"before": r.params_before, "after": r.params_after, "removed": r.params_before - r.params_after,
                   "ratio": r.params_after / r.params_before},
        "strategy": r.strategy,
        "allocation_attempts": r.attempts,
        "blocks": r.decisions_json(),
        "profile": [p.to_json() for p in r.profiles],
        "timings": dict(r.timings),
    }


#: The report warns when a domain's confidence bound sits more than this share of the gate's budget above
#: the measured change: the gate is then deciding mostly on noise.
POOR_BOUND_SHARE = 0.5


def source_id(source: TextSource) -> str:
    kind = source.kind()
    if kind in ("file", "disk"):
        return str(Path(source.dataset).expanduser().resolve())
    return source.dataset if kind != "hub" else f"{source.dataset}:{source.config}"


def evaluation_report(recipe: Recipe, r: CompressionResult, streams: dict[str, torch.Tensor], overlap: dict) -> dict:
    """What the gate was measured on, per domain, and the warnings a reader needs."""
    pol = recipe.policy
    passed, message, per = gate_check(r.baseline, r.final, pol)
    halves = _split_rows(r, pol)
    if halves is not None:
        passed, message = halves["passed"], halves["message"]
    first = recipe.evaluation_domains()[0].domain_name()
    base_d = getattr(r.baseline, "domains", None) or {first: r.baseline}
    final_d = getattr(r.final, "domains", None) or {first: r.final}
    warnings, domains = [], []
    for cfg in recipe.evaluation_domains():
        name = cfg.domain_name()
        b, f = base_d[name], final_d[name]
        delta_se = getattr(f, "nll_delta_se", None)
        domains.append({
            "name": name, "dataset": cfg.dataset, "split": cfg.split, "tokens": int(streams[name].numel()),
            "scored_tokens": f.tokens, "windows": f.windows, "seq_len": f.seq_len, "stride": f.stride,
            "baseline": b.to_json(), "final": f.to_json(), **per[name],
            # paired by window: the noise of the change itself, by the delta method
            "relative_delta_se": None if delta_se is None else delta_se * f.ppl / b.ppl,
            "overlap": overlap.get(name),
        })
        if halves is not None:  # the decision: the search's windows and the held-out ones, both within budget
            search, confirmation = halves["search"][name], halves["confirmation"][name]
            domains[-1].update(search=search, confirmation=confirmation,
                               passed=search["passed"] and confirmation["passed"])
        if (why := loose_bound(per[name], pol, changed=f is not b)) is not None:
            warnings.append(f"evaluation domain {name!r}: {why} over {f.windows} windows; give more evaluation "
                            "text (evaluation.max_tokens) for a tighter gate")
    cal = recipe.calibration
    # the model's own writing is one domain whatever its seed: a self calibration and a self evaluation share it
    cal_ids = {source_id(t) for t in calibration_texts(recipe)} | ({"self"} if cal.writes_self() else set())
    ev_ids = {"self" if c.self_written() else source_id(source_text(c)) for c in recipe.evaluation_domains()}
    one_domain = bool(ev_ids) and ev_ids <= cal_ids
    notes = []
    if one_domain and isinstance(cal.dataset, list):
        # a weighted mix of kinds (a size run's default): the gate's windows are ones calibration never read, but
        # it measured no kind of text calibration did not also draw from; said, not warned, for every run
        notes.append("every evaluation domain is a kind of text calibration also drew from (on other windows): "
                     "add an evaluation domain calibration never saw to measure text of another kind")
    elif one_domain:
        what = ("the model's own writing" if ev_ids == {"self"} else "the embedded Python reference text"
                if ev_ids == {"embedded"} else sorted(ev_ids - {"self"})[0])
        also = " (which calibration also used)" if cal.dataset == "mix" else ""
        warnings.append(
            f"calibration and evaluation come from one domain: the gate was measured only on {what}{also}; its "
            "promise holds on this kind of text, and on other text the compressed model may be much worse "
            "(measured on SmolLM2: 3-12x the gated change). Calibrate on other text (calibration.dataset: self) "
            "or add evaluation domains like your use."
        )
    confirmation = None if halves is None else {
        "fraction": r.splits.fraction, "confirmations": r.splits.confirmations, "stepped_back": r.splits.notes,
        "windows": {n: row["windows"] for n, row in halves["confirmation"].items()},
        "search_windows": {n: row["windows"] for n, row in halves["search"].items()}}
    return {
        "confirm_fraction": pol.confirm_fraction,
        "confirmation": confirmation,
        "metric": pol.metric,
        "confidence": pol.confidence,
        "ppl_budget": pol.ppl_budget,
        "budget_mode": pol.budget_mode,
        "kl_budget": pol.kl_budget,
        "headroom": pol.headroom,
        "passed": passed,
        "message": message,
        "domains": domains,
        "one_domain": one_domain,
        "notes": notes,
        "warnings": warnings,
    }


def loose_bound(row: dict, pol, *, changed: bool) -> str | None:
    """Why the gate's decision on one domain is loose (None when it is not): the confidence bound sits more
    than :data:`POOR_BOUND_SHARE` of the budget above the measured change. The gate decides on the paired
    change, so its noise is what matters — not the perplexity's own spread across windows, which pairing
    cancels. Nothing is said of a model that was not changed (nothing was decided on it)."""
    if not changed:
        return None
    kl = row.get("metric") == "kl" and row.get("kl_upper") is not None
    margin = row["kl_upper"] - row["kl"] if kl else row["relative_delta_upper"] - row["relative_delta"]
    budget = gate_budget(pol)
    if budget <= 0 or margin <= POOR_BOUND_SHARE * budget:
        return None
    unit = f"{margin:.4f} nats" if kl else f"{100 * margin:.2f} %"
    return (f"the gate's {row['confidence']:.0%} bound is {unit} above the measured change, over "
            f"{POOR_BOUND_SHARE:.0%} of the budget")


#: What a split's row keeps of :func:`gate_check`'s row (the rest is in the domain's row).
SPLIT_FIELDS = ("windows", "baseline_ppl", "ppl", "relative_delta", "relative_delta_upper", "ppl_upper", "kl",
                "kl_upper", "limit", "quantile", "passed", "summary")


def _split_rows(r: CompressionResult, pol) -> dict | None:
    """Per domain, the search windows' and the confirmation windows' change, bound and verdict (None
    without a confirmation split); with the decision (both within budget) and its message."""
    if r.splits is None:
        return None
    out, ok, words = {}, True, []
    for label, base, final in (("search", r.splits.search_baseline, r.splits.search_final),
                               ("confirmation", r.splits.baseline, r.splits.final)):
        passed, message, per = gate_check(base, final, pol)
        out[label] = {n: {"windows": final.domains[n].windows, **{k: row.get(k) for k in SPLIT_FIELDS[1:]}}
                      for n, row in per.items()}
        ok, words = ok and passed, words + [f"{label}: {message}"]
    return {**out, "passed": ok, "message": "; ".join(words)}
