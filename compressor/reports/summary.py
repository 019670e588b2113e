"""What ``compressor run`` prints when a run ends: the report's summary, line by line.

A compressed model's summary (the gate per domain, parameters, agreement, task scores, sizes) or a
size-planned file's (its types and bytes, and per domain its change where it runs beside the anchor's, in the
format's words: :mod:`compressor.reports.wording`). :meth:`compressor.reports.schema.Report.summary_lines` is
the entry point.
"""

from __future__ import annotations

from pathlib import Path

from compressor.engine.cache import human_bytes
from compressor.evaluation.gate import headroom_note
from compressor.reports.sections import GateDomain, PlannedCheck, PlannedDomain, ReportFields, Split, SizePlan
from compressor.reports.wording import FormatWords, planned_words, words_for


def summary_lines(r: ReportFields, output: Path | None) -> list[str]:
    """The summary of report ``r``; ``output``: the folder it was published in (None: nothing written)."""
    lines = [f"status: {r.status} — {r.message}"]
    planned = r.planned()
    if planned is not None:  # output.size: the file is what was gated, where it runs
        fmt, check = planned
        words = planned_words(fmt)
        lines += size_plan_lines(fmt, check, r.size_plan, words)
        if output is not None:
            lines += [f"model:  {words.shipped(output)}", f"report: {output / 'report.json'}"]
        return lines
    ppl, kept = r.perplexity, r.kept()
    if r.status == "rejected" and not kept:
        # nothing is replaced: the gate's lines would describe the original model ("+0.00 % — within
        # budget"); what was tried and what it cost is in the message above
        return lines + [f"perplexity: {ppl.baseline.ppl:.4f}, the original's: nothing replaced, no model written "
                        f"({ppl.final.tokens} tokens, window {ppl.final.seq_len})"]
    lines.append(f"perplexity: {ppl.baseline.ppl:.4f} → {ppl.final.ppl:.4f} (gate limit {ppl.budget:.4f}, "
                 f"{ppl.final.tokens} tokens, window {ppl.final.seq_len}, stride {ppl.final.stride})")
    ev = r.evaluation
    lines += [gate_line(d, ev.confidence, ev.headroom) for d in ev.domains if d.relative_delta_upper is not None]
    lines.append(f"parameters: {r.params.before:,} → {r.params.after:,} (blocks replaced: {kept})")
    agree = r.agreement
    if agree.next_token is not None:
        c = agree.continuations
        lines.append(f"greedy agreement with the original: {agree.next_token:.1%} of next tokens" + (
            f"; {c.identical:.0%} of {c.prompts} continuations of {c.tokens} tokens identical "
            f"({c.matching_prefix:.0%} of tokens before the first difference)" if c else ""))
    for row in r.tasks.tasks if r.tasks else []:
        lines.append(f"task {row.task}: {row.metric} {_num(row.original)} → {_num(row.compressed)}"
                     + (f" (±{row.stderr:.4f})" if row.stderr is not None else ""))
    if output is not None:
        lines += _size_lines(r) + [f"model:  {output}", f"report: {output / 'report.json'}"]
    return lines


def _size_lines(r: ReportFields) -> list[str]:
    """What was written, like with like first (the same quantization on both sides), then each format's own
    check in its words, then a Hugging Face folder of another dtype than the source's."""
    size, lines = r.size, []
    same = size.like_with_like
    if same:
        lines.append(f"size: {human_bytes(same.output_bytes)} against the source's {human_bytes(same.source_bytes)} "
                     f"({same.ratio:.3f}x; {same.what})")
    raw = size.model_dump(exclude_unset=True)
    for fmt, check in r.verification.items():
        words = words_for(fmt)
        line = words.check_line(check.model_dump(exclude_unset=True), raw) if words is not None else None
        if line is not None:
            lines.append(line)
    if size.output_bytes is not None and (not same or "Hugging Face" not in same.what):
        source = "GGUF file" if r.model.resolved.endswith(".gguf") else "weights"
        lines.append(f"Hugging Face folder: {human_bytes(size.output_bytes)} of {size.output_dtype} weights "
                     f"(source {source}: {human_bytes(size.source_bytes)}, another format)")
    return lines


def gate_line(d: GateDomain, confidence: float, headroom: float = 0.0) -> str:
    """One domain's gate: its change and bound, on the search's windows and on the held-out
    confirmation windows when the run kept some (``policy.confirm_fraction``), against the limit the
    bound is held to (the budget less ``headroom``)."""
    kl = d.metric == "kl"

    def bound(row: GateDomain | Split) -> str:
        if kl:
            return f"KL {row.kl:.4f}, {confidence:.0%} bound {row.kl_upper:.4f}"
        return f"{row.relative_delta:+.2%}, {confidence:.0%} bound {row.relative_delta_upper:+.2%}"

    limit = (f"{d.limit:.4f}" if kl else f"{d.limit / d.baseline_ppl - 1:+.2%}") + headroom_note(headroom)
    verdict = "within" if d.passed else "over"
    if d.confirmation is None:
        return f"gate [{d.name}]: {bound(d)} vs {limit} over {d.windows} windows — {verdict} budget"
    s, c = d.search, d.confirmation
    return (f"gate [{d.name}]: search {bound(s)} over {s.windows} windows; confirmation {bound(c)} over "
            f"{c.windows} held-out windows; vs {limit} — {verdict} budget")


def _num(v) -> str:
    return "—" if v is None else f"{v:.4f}"


def size_plan_lines(fmt: str, check: PlannedCheck, plan: SizePlan, words: FormatWords) -> list[str]:
    """``output.size``: the planned file beside the anchor of that size (the format's words name both), same
    windows, per domain."""
    lines = [f"{fmt}: {human_bytes(check.file_bytes)} (budget {human_bytes(check.budget_bytes)}, output.size "
             f"{plan.size}); {words.choices}: {plan.types_line()}"]
    if plan.search:  # output.size: smallest — the plans the gate measured, smallest first
        tried = ", ".join(f"{a.file_bytes / 1e6:.1f} MB {'passed' if a.passed else 'over'}"
                          for a in plan.search.attempts)
        lines.append(f"smallest within the budget: planned for a predicted "
                     f"{100 * plan.search.target_predicted_ppl_change:+.2f} %; files measured: {tried}")
    preset, best = check.preset, check.best_preset
    anchor = words.beside(preset.model_dump(exclude_unset=True)) if preset else ""
    lines.append(f"predicted: {100 * check.predicted_relative_change:+.2f} % perplexity"
                 + (f"; beside it: {anchor}, {human_bytes(preset.file_bytes)}" if preset else ""))
    lines += [_planned_domain_line(d, check, words) for d in check.domains]
    if best:
        lines.append(f"better of no more bytes: {best.called}, {human_bytes(best.file_bytes)}; the gate compares "
                     "with it")
    if check.gate_rule == "preset":
        lines.append(f"gate: over the default budget, written as at least as good as {best.called if best else anchor} "
                     "on every domain (set policy.ppl_budget in the recipe to hold the file to it)")
    return lines


def _planned_domain_line(d: PlannedDomain, check: PlannedCheck, words: FormatWords) -> str:
    preset, best = check.preset, check.best_preset
    bound = (f" ({d.confidence:.0%} bound {100 * d.relative_delta_upper:+.2f} %)"
             if d.relative_delta_upper is not None else "")
    tail = f", p99.9 {d.kl_p999:.3f}" if d.kl_p999 is not None else ""
    kl = (f"; KL {d.kl_mean:.4f} (p99 {d.kl_p99:.3f}{tail}), same top token {d.same_top_token:.1%}"
          if d.kl_mean is not None else "")
    beside = f" | {preset.name}: {100 * d.preset_relative_change:+.2f} %" if preset else ""
    if preset and d.preset_kl_mean is not None:
        beside += f", KL {d.preset_kl_mean:.4f}"
    if best and d.best_preset_relative_change is not None:  # a smaller preset that is better here
        beside += f" | {best.name}: {100 * d.best_preset_relative_change:+.2f} %"
        beside += f", KL {d.best_preset_kl_mean:.4f}" if d.best_preset_kl_mean is not None else ""
    return (f"{words.runs_in} [{d.name}]: perplexity {d.perplexity:.4f}, {100 * d.relative_change:+.2f} %{bound} "
            f"against the original's {d.reference_perplexity:.4f}{kl}{beside}")
