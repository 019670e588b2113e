"""The ``README.md`` model card: Hub metadata, what was done and measured, how to load the result.

A compressed model's card (blocks replaced, perplexity before and after, the
gate's measurements) or a size-planned file's (types chosen, bytes, its change
where it runs beside the preset's): :func:`model_card` picks by
:func:`planned_check`. The Markdown sections come from
:mod:`compressor.reports.markdown`.
"""

from __future__ import annotations

from compressor.reports.markdown import (
    agreement_line, decisions_table, evaluation_section, public_name, scrub_paths, tasks_section,
)


def card_metadata(r: dict) -> str:
    """The card's YAML front matter, written by ``huggingface_hub.ModelCardData`` (so the Hub and
    ``huggingface_hub.ModelCard`` parse it): library, pipeline tag, tags, ``base_model`` only when the
    source is a Hub id (or a GGUF names its origin), ``license`` when the source states one, and the
    evaluation results (perplexity per domain, task scores) as ``model-index``."""
    from huggingface_hub import EvalResult, ModelCardData

    m = r["model"]
    name = public_name(r.get("output") or "model")
    results = []
    ev = r.get("evaluation") or {}
    fmt, planned = planned_check(r)
    domains = ev.get("domains") or [{"name": public_name(r["perplexity"]["data"]), "dataset": r["perplexity"]["data"],
                                     "final": r["perplexity"]["final"]}]
    if planned:  # a size plan's card: the file's perplexity in llama.cpp, not the unchanged model's
        by_name = {d["name"]: d for d in planned.get("domains", [])}
        domains = [{**d, "final": {"ppl": by_name[d["name"]]["perplexity"]}} for d in domains if d["name"] in by_name]
    for d in domains:
        results.append(EvalResult(task_type="text-generation", task_name="Language modelling",
                                  dataset_type=public_name(d["dataset"]), dataset_name=public_name(d["name"]),
                                  metric_type="perplexity", metric_name="perplexity",
                                  metric_value=round(float(d["final"]["ppl"]), 4)))
    for row in (r.get("tasks") or {}).get("tasks", []):
        if row.get("compressed") is None:
            continue
        results.append(EvalResult(task_type="text-generation", task_name=row["task"], dataset_type=row["task"],
                                  dataset_name=row["task"], metric_type=row["metric"], metric_name=row["metric"],
                                  metric_value=round(float(row["compressed"]), 4)))
    data = ModelCardData(library_name="gguf" if fmt == "gguf" else "transformers", pipeline_tag="text-generation",
                         tags=["compressor", fmt, "size-planned"] if planned else
                         ["compressor", "ffn-compression", "compressed"], license=m.get("license"),
                         base_model=m.get("base_model"), model_name=name, eval_results=results or None)
    return data.to_yaml()


def _license_line(m: dict) -> str:
    if m.get("license"):
        return f"License: `{m['license']}`, as the source states it."
    return ("License: unknown — the source states none (no `general.license` in a GGUF, no `license` in its "
            "model card). The weights are the source's: check its terms before publishing.")


def model_card(report: dict) -> str:
    """The ``README.md`` model card: Hub metadata (:func:`card_metadata`), what was done and measured,
    how to load it — for a size plan, the file's types and bytes and its change in llama.cpp beside the
    preset's. Names no local path and no ``pkg:`` source."""
    return scrub_paths(_size_card(report) if planned_check(report)[0] else _model_card(report))


def _kl_cell(d: dict, prefix: str) -> str:
    kl = d.get(f"{prefix}kl_mean")
    return "n/a" if kl is None else f"{kl:.4f}"


def planned_check(r: dict) -> tuple[str | None, dict]:
    """The size-planned file's verification entry (``quant: plan``) and its format; (None, {}) without one."""
    for fmt, check in ((r.get("verification") or {}) if r.get("size_plan") else {}).items():
        if isinstance(check, dict) and check.get("quant") == "plan":
            return fmt, check
    return None, {}


#: What a size card says of each format a size plans: the file, where it was measured, the anchor beside it,
#: and how to load it.
_SIZE_CARD = {
    "gguf": {
        "file": "one GGUF file, `model.gguf`, of {bytes:,} bytes",
        "choice": "every weight matrix's GGML type",
        "types": "Tensor types",
        "where": "in llama.cpp",
        "anchor": "llama.cpp's {name} + imatrix",
        "anchor_line": (
            "llama.cpp's own {name} of the same F16 with an "
            "importance matrix ({bytes:,} bytes; the matrix, from the same calibration text, is `model.imatrix`: "
            "`llama-quantize --imatrix model.imatrix` takes it)"
        ),
        "unchanged": "the GGUF's tensor types",
        "best_line": (
            "{called} is of no more bytes ({bytes:,}) and better on the gate's text; the file against it: "
            '{rows}. The gate\'s "at least as good as the preset" compares with it.\n'
        ),
        "load": (
            '```bash\nllama-cli -m model.gguf -p "Once upon a time"\n```\n\n```python\nfrom llama_cpp import Llama\n'
            'llm = Llama(model_path="model.gguf")\n```'
        ),
    },
    "compressed-tensors": {
        "file": "a compressed-tensors checkpoint (`pack-quantized`) of {bytes:,} bytes of tensors",
        "choice": "every linear layer's integer scheme (fused q/k/v and gate/up together)",
        "types": "Layer schemes",
        "where": "in plain transformers after reloading the folder",
        "anchor": "uniform {name}",
        "anchor_line": (
            "the uniform {name} checkpoint of the same model ({bytes:,} bytes of tensors; every linear layer "
            "in {name}, rounded the same way — what llm-compressor's GPTQModifier writes for that scheme)"
        ),
        "unchanged": "the checkpoint's layer schemes",
        "load": (
            "```python\n# pip install compressed-tensors\nfrom transformers import AutoModelForCausalLM\n"
            'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n```\n\n'
            "```bash\nvllm serve path/to/this/folder\n```"
        ),
    },
}


def _size_card(r: dict) -> str:
    """The card of a size-planned file: what was planned, the types chosen, what was measured where it runs."""
    fmt, check = planned_check(r)
    text = _SIZE_CARD[fmt]
    plan = r["size_plan"]
    m = r["model"]
    source = m.get("hub_id") or m.get("base_model") or m.get("base_model_name") or public_name(m["resolved"])
    types = ", ".join(f"{t} ×{n}" for t, n in sorted((plan.get("types_used") or {}).items(),
                                                      key=lambda kv: -kv[1]))
    preset = check.get("preset")
    rows = "\n".join(
        f"| {d['name']} | {d['perplexity']:.4f} | {100 * d['relative_change']:+.2f} % | "
        f"{100 * d['relative_delta_upper']:+.2f} % | {_kl_cell(d, '')} |"
        + (f" {100 * d['preset_relative_change']:+.2f} % | {_kl_cell(d, 'preset_')} |" if preset else "")
        for d in check.get("domains", []) if d.get("relative_delta_upper") is not None)
    head = "| domain | perplexity | change | bound | mean KL |" + (
        f" {text['anchor'].format(name=preset['name'])} | its KL |" if preset else "")
    rule = "|---|---:|---:|---:|---:|" + ("---:|---:|" if preset else "")
    preset_line = (f"Beside it, {text['anchor_line'].format(name=preset['name'], bytes=preset['file_bytes'])}, "
                   "measured on the same windows.\n" if preset else "")
    best = check.get("best_preset")
    if best and text.get("best_line"):
        cells = "; ".join(f"{d['name']} {100 * d['best_preset_relative_change']:+.2f} %, KL "
                          f"{_kl_cell(d, 'best_preset_')} (the file: {100 * d['relative_change']:+.2f} %, KL "
                          f"{_kl_cell(d, '')})" for d in check.get("domains", [])
                          if d.get("best_preset_relative_change") is not None)
        preset_line += text["best_line"].format(called=best["called"], bytes=best["file_bytes"], rows=cells)
    if check.get("gate_rule") == "preset":
        preset_line += ("The file is over the default budget and was written because it is at least as good as that "
                        "anchor on every domain (paired by window, at the gate's confidence).\n")
    hf = (f"\nThe Hugging Face folder beside it holds the original weights, unchanged (a size plan changes only "
          f"{text['unchanged']}).\n" if "hf" in ((r.get("recipe") or {}).get("output") or {}).get("formats", [])
          else "")
    return f"""---
{card_metadata(r).strip()}
---

# {public_name(r['output'] or 'model')}

`{source}` as {text['file'].format(bytes=check.get('file_bytes', 0))}, planned to
`output.size: {plan['size']}` (budget {plan['budget_bytes']:,} bytes) by compressor {r['tool_version']}:
{text['choice']} chosen for the least predicted loss, from one backward pass over the calibration text.

{text['types']}: {types}. Predicted perplexity change {100 * plan.get('predicted_ppl_change', 0.0):+.2f} %.

Measured {text['where']} against the original model's perplexity ({check.get('confidence', 0.9):.0%} upper
bound, paired by window) and its next-token distributions (mean KL divergence per token, nats):

{head}
{rule}
{rows}

{preset_line}{hf}
## Load

{text['load']}

Every tensor, its type, bytes and predicted cost: `report.json` (`size_plan.tensors`).
Recipe: `recipe.yaml` (sha256 `{r['recipe_sha256'][:16]}…`).
"""


def _model_card(report: dict) -> str:
    r = report
    kept = [d for d in r["blocks"] if d["decision"] == "kept"]
    m = r["model"]
    source = m.get("hub_id") or m.get("base_model") or m.get("base_model_name") or public_name(m["resolved"])
    return f"""---
{card_metadata(r).strip()}
---

# {public_name(r['output'] or 'model')}

`{source}` with {len(kept)} of {len(r['blocks'])} FFN blocks replaced by closed-form
fitted layers (kind `{r['recipe']['replacement']['kind']}`) by compressor {r['tool_version']}.

| | parameters | perplexity |
|---|---:|---:|
| original | {r['params']['before']:,} | {r['perplexity']['baseline']['ppl']:.4f} |
| compressed | {r['params']['after']:,} | {r['perplexity']['final']['ppl']:.4f} |

Perplexity: {r['perplexity']['final']['tokens']} scored tokens of `{public_name(r['perplexity']['data'])}`, windows of
{r['perplexity']['final']['seq_len']} tokens, stride {r['perplexity']['final']['stride']}
(budget {r['perplexity']['budget']:.4f}).
{agreement_line(r)}
{_license_line(m)}
{tasks_section(r)}{evaluation_section(r.get('evaluation'), r.get('calibration'))}
## Load

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("path/to/this/folder", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder", trust_remote_code=False)  # no custom code needed
# or, with compressor installed: `import compressor` after transformers and drop both flags
```

## Blocks

{decisions_table(r['blocks'])}
Recipe: `recipe.yaml` (sha256 `{r['recipe_sha256'][:16]}…`). Full report: `report.json`.
"""
