"""The ``README.md`` model card: Hub metadata, what was done and measured, how to load the result.

A compressed model's card (blocks replaced, perplexity before and after, the
gate's measurements) or a size-planned file's (types chosen, bytes, its change
where it runs beside the anchor's, in the format's words:
:mod:`compressor.reports.wording`): :func:`model_card` picks by
:meth:`~compressor.reports.sections.ReportFields.planned`. The Markdown sections
come from :mod:`compressor.reports.markdown`.
"""

from __future__ import annotations

from compressor.reports.markdown import (
    agreement_line, decisions_table, evaluation_section, public_name, scrub_paths, tasks_section,
)
from compressor.reports.sections import ModelInfo, PlannedDomain, ReportFields
from compressor.reports.wording import CardWords, planned_words


def card_metadata(r: ReportFields) -> str:
    """The card's YAML front matter, written by ``huggingface_hub.ModelCardData`` (so the Hub and
    ``huggingface_hub.ModelCard`` parse it): library, pipeline tag, tags, ``base_model`` only when the
    source is a Hub id (or a GGUF names its origin), ``license`` when the source states one, and the
    evaluation results (perplexity per domain, task scores) as ``model-index``."""
    from huggingface_hub import EvalResult, ModelCardData

    m = r.model
    name = public_name(r.output or "model")
    results = []
    planned = r.planned()
    domains = [{"name": d.name, "dataset": d.dataset, "ppl": d.final.ppl} for d in r.evaluation.domains] or [
        {"name": public_name(r.perplexity.data), "dataset": r.perplexity.data, "ppl": r.perplexity.final.ppl}]
    if planned:  # a size plan's card: the file's perplexity where it runs, not the unchanged model's
        by_name = {d.name: d for d in planned[1].domains}
        domains = [{**d, "ppl": by_name[d["name"]].perplexity} for d in domains if d["name"] in by_name]
    for d in domains:
        results.append(EvalResult(task_type="text-generation", task_name="Language modelling",
                                  dataset_type=public_name(d["dataset"]), dataset_name=public_name(d["name"]),
                                  metric_type="perplexity", metric_name="perplexity",
                                  metric_value=round(float(d["ppl"]), 4)))
    for row in r.tasks.tasks if r.tasks else []:
        if row.compressed is None:
            continue
        results.append(EvalResult(task_type="text-generation", task_name=row.task, dataset_type=row.task,
                                  dataset_name=row.task, metric_type=row.metric, metric_name=row.metric,
                                  metric_value=round(float(row.compressed), 4)))
    library = CardWords(**planned_words(planned[0]).card_words()).library if planned else "transformers"
    data = ModelCardData(library_name=library, pipeline_tag="text-generation",
                         tags=["compressor", planned[0], "size-planned"] if planned else
                         ["compressor", "ffn-compression", "compressed"], license=m.license,
                         base_model=m.base_model, model_name=name, eval_results=results or None)
    return data.to_yaml()


def _license_line(m: ModelInfo) -> str:
    if m.license:
        return f"License: `{m.license}`, as the source states it."
    return ("License: unknown — the source states none (no `general.license` in a GGUF, no `license` in its "
            "model card). The weights are the source's: check its terms before publishing.")


def model_card(report: dict | ReportFields) -> str:
    """The ``README.md`` model card of a report (its dict is validated first): Hub metadata
    (:func:`card_metadata`), what was done and measured, how to load it — for a size plan, the file's types
    and bytes and its change where it runs beside the anchor's. Names no local path and no ``pkg:`` source."""
    r = report if isinstance(report, ReportFields) else ReportFields.model_validate(report)
    return scrub_paths(_size_card(r) if r.planned() else _model_card(r))


def _kl_cell(d: PlannedDomain, prefix: str) -> str:
    kl = getattr(d, f"{prefix}kl_mean")
    return "n/a" if kl is None else f"{kl:.4f}"


def _source(m: ModelInfo) -> str:
    return m.hub_id or m.base_model or m.base_model_name or public_name(m.resolved)


def _size_card(r: ReportFields) -> str:
    """The card of a size-planned file: what was planned, the types chosen, what was measured where it runs."""
    fmt, check = r.planned()
    words = planned_words(fmt)
    text = CardWords(**words.card_words())
    plan = r.size_plan
    preset = check.preset
    rows = "\n".join(
        f"| {d.name} | {d.perplexity:.4f} | {100 * d.relative_change:+.2f} % | "
        f"{100 * d.relative_delta_upper:+.2f} % | {_kl_cell(d, '')} |"
        + (f" {100 * d.preset_relative_change:+.2f} % | {_kl_cell(d, 'preset_')} |" if preset else "")
        for d in check.domains if d.relative_delta_upper is not None)
    head = "| domain | perplexity | change | bound | mean KL |" + (
        f" {text.anchor.format(name=preset.name)} | its KL |" if preset else "")
    rule = "|---|---:|---:|---:|---:|" + ("---:|---:|" if preset else "")
    preset_line = (f"Beside it, {text.anchor_line.format(name=preset.name, bytes=preset.file_bytes)}, "
                   "measured on the same windows.\n" if preset else "")
    best = check.best_preset
    if best and text.best_line:
        cells = "; ".join(f"{d.name} {100 * d.best_preset_relative_change:+.2f} %, KL "
                          f"{_kl_cell(d, 'best_preset_')} (the file: {100 * d.relative_change:+.2f} %, KL "
                          f"{_kl_cell(d, '')})" for d in check.domains if d.best_preset_relative_change is not None)
        preset_line += text.best_line.format(called=best.called, bytes=best.file_bytes, rows=cells)
    if check.gate_rule == "preset":
        preset_line += ("The file is over the default budget and was written because it is at least as good as that "
                        "anchor on every domain (paired by window, at the gate's confidence).\n")
    predicted = 100 * (plan.predicted_ppl_change or 0.0)
    hf = (f"\nThe Hugging Face folder beside it holds the original weights, unchanged (a size plan changes only "
          f"{text.unchanged}).\n" if "hf" in (r.recipe.get("output") or {}).get("formats", []) else "")
    return f"""---
{card_metadata(r).strip()}
---

# {public_name(r.output or 'model')}

`{_source(r.model)}` as {text.file.format(bytes=check.file_bytes)}, planned to
`output.size: {plan.size}` (budget {plan.budget_bytes:,} bytes) by compressor {r.tool_version}:
{text.choice} chosen for the least predicted loss, from one backward pass over the calibration text.

{words.choices.capitalize()}: {plan.types_line()}. Predicted perplexity change {predicted:+.2f} %.

Measured {text.where} against the original model's perplexity ({check.confidence or 0.9:.0%} upper
bound, paired by window) and its next-token distributions (mean KL divergence per token, nats):

{head}
{rule}
{rows}

{preset_line}{hf}
## Load

{text.load}

Every tensor, its type, bytes and predicted cost: `report.json` (`size_plan.tensors`).
Recipe: `recipe.yaml` (sha256 `{r.recipe_sha256[:16]}…`).
"""


def _model_card(r: ReportFields) -> str:
    kept = len(r.kept())
    ppl, params = r.perplexity, r.params
    raw = r.model_dump(include={"agreement", "tasks", "evaluation", "calibration"}, exclude_unset=True)
    return f"""---
{card_metadata(r).strip()}
---

# {public_name(r.output or 'model')}

`{_source(r.model)}` with {kept} of {len(r.blocks)} FFN blocks replaced by closed-form
fitted layers (kind `{r.recipe['replacement']['kind']}`) by compressor {r.tool_version}.

| | parameters | perplexity |
|---|---:|---:|
| original | {params.before:,} | {ppl.baseline.ppl:.4f} |
| compressed | {params.after:,} | {ppl.final.ppl:.4f} |

Perplexity: {ppl.final.tokens} scored tokens of `{public_name(ppl.data)}`, windows of
{ppl.final.seq_len} tokens, stride {ppl.final.stride}
(budget {ppl.budget:.4f}).
{agreement_line(raw)}
{_license_line(r.model)}
{tasks_section(raw)}{evaluation_section(raw.get('evaluation'), raw.get('calibration'))}
## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder", trust_remote_code=False)  # no custom code needed
# or, with compressor installed: `import compressor` after transformers and drop both flags
```

## Blocks

{decisions_table([b.model_dump(exclude_unset=True) for b in r.blocks])}
Recipe: `recipe.yaml` (sha256 `{r.recipe_sha256[:16]}…`). Full report: `report.json`.
"""
