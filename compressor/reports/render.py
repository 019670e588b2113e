"""Human-readable views: Markdown tables, the per-block plot, the model card."""

from __future__ import annotations

from pathlib import Path

from compressor.engine.profiling import BlockProfile, Profile

FLAG = "⚠ outlier-dominated"


def _f(v, spec: str = ".4f") -> str:
    return "—" if v is None or v != v else format(v, spec)


def profile_table(blocks: list[BlockProfile]) -> str:
    head = (
        "| block | R²_lin | median feature R² | bulk R² | outlier SST share | explained eff. rank "
        "| input cond. | input eff. rank | flags |\n|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for b in blocks:
        flags = [FLAG] if b.outlier_dominated else []
        if b.damping:
            flags.append(f"damped {b.damping:g}")
        if b.dead_inputs:
            flags.append(f"{b.dead_inputs} dead inputs")
        rows.append(
            f"| {b.index} | {_f(b.r2_lin)} | {_f(b.r2_median_feature)} | {_f(b.r2_bulk, '.3f')} "
            f"| {_f(b.outlier_sst_share, '.1%')} | {_f(b.explained_effective_rank, '.1f')} "
            f"| {_f(b.input_condition_number, '.3g')} | {_f(b.input_effective_rank, '.1f')} | {', '.join(flags)} |"
        )
    return head + "\n".join(rows) + "\n"


def profile_markdown(profile: Profile) -> str:
    s = profile.settings
    return (
        f"# Linearity profile: {profile.model}\n\n"
        f"Model type `{profile.model_type}`; {s.get('fit_rows', '?')} fit rows, {s.get('heldout_rows', '?')} held-out rows "
        f"(windows of {s.get('seq_len', '?')} tokens from {s.get('data', '?')}).\n"
        "R²_lin = 1 − SSE/SST of the closed-form affine fit on held-out rows, pooled over output features. "
        f"Blocks marked {FLAG} have most of their held-out variance in a few sink/spike rows: "
        "a high R²_lin there does not mean the swap is safe.\n\n" + profile_table(profile.blocks)
    )


BULK_FLOOR = -0.5  # bulk R² below this is drawn at the floor, with its value written next to it


def profile_figure(profile: Profile, threshold: float | None = None):
    """The per-block figure: R² panel (R²_lin bars, bulk R² dots, the candidate
    threshold) above an outlier-share panel (0–1, with the flag level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if threshold is None:
        from compressor.recipe.schema import PolicyConfig

        threshold = PolicyConfig.model_fields["threshold"].default
    flag = profile.settings.get("outlier_share_flag", 0.5)
    blocks = profile.blocks
    idx = [b.index for b in blocks]

    def val(v):
        return v if v is not None and v == v else 0.0

    fig, (ax, ax2) = plt.subplots(
        2, 1, sharex=True, figsize=(max(6, 0.28 * len(idx) + 2) + 2, 5.5), dpi=120, gridspec_kw={"height_ratios": [3, 1.3]}
    )
    colors = ["#d62728" if b.outlier_dominated else "#1f77b4" for b in blocks]
    ax.bar(idx, [max(val(b.r2_lin), BULK_FLOOR) for b in blocks], color=colors, label="R²_lin (held-out)")
    bulk = [val(b.r2_bulk) for b in blocks]
    ax.plot(idx, [max(v, BULK_FLOOR) for v in bulk], "k.", label="bulk R² (no sink/spike rows)")
    clipped = [(i, v) for i, v in zip(idx, bulk) if v < BULK_FLOOR]
    if clipped:
        ax.plot([i for i, _ in clipped], [BULK_FLOOR] * len(clipped), "kv", ms=5, label=f"bulk R² < {BULK_FLOOR} (value shown)")
        for i, v in clipped:
            ax.annotate(f"{v:.3g}", (i, BULK_FLOOR), xytext=(0, 6), textcoords="offset points", ha="center",
                        fontsize=6, rotation=90, va="bottom")
    ax.axhline(threshold, color="#2ca02c", ls="--", lw=1, label=f"threshold {threshold:g}")
    for b in blocks:
        if b.outlier_dominated:
            ax.annotate("⚠", (b.index, min(1.0, max(val(b.r2_lin), 0)) + 0.02), ha="center", color="#d62728")
    ax.set_ylabel("R²")
    ax.set_ylim(BULK_FLOOR - 0.08, 1.12)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_title(f"{profile.model}: per-block linearity (red = outlier-dominated)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # outside: no data hidden

    ax2.bar(idx, [val(b.outlier_sst_share) for b in blocks], color=colors)
    ax2.axhline(flag, color="#ff7f0e", ls="--", lw=1, label=f"flag at {flag:g}")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("outlier share\nof SST", fontsize=8)
    ax2.set_xlabel("block")
    ax2.set_xticks(idx)
    ax2.tick_params(axis="x", labelsize=7)
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    return fig


def profile_plot(profile: Profile, path: str | Path, threshold: float | None = None) -> Path:
    """Write :func:`profile_figure` as a PNG."""
    import matplotlib.pyplot as plt

    fig = profile_figure(profile, threshold)
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def decisions_table(decisions: list[dict]) -> str:
    head = (
        "| block | R²_lin | bulk R² | decision | replacement | params before → after | ppl when tried | reason |\n"
        "|---:|---:|---:|---|---|---|---:|---|\n"
    )
    rows = []
    for d in decisions:
        rep = "—"
        if d["decision"] in ("kept", "rejected"):
            size = d.get("size")
            unit = "rank" if d.get("kind") == "low_rank" else "units"
            rep = (d.get("kind") or "?") + (f" ({unit} {size})" if size is not None and d.get("kind") != "affine" else "")
        params = f"{d['ffn_params']:,} → {d['replacement_params']:,}" if d["decision"] == "kept" else "—"
        rows.append(
            f"| {d['index']} | {_f(d['r2_lin'])} | {_f(d['r2_bulk'], '.3f')} | {d['decision']} | {rep} | {params} "
            f"| {_f(d.get('ppl_when_tried'), '.3f')} | {d['reason']} |"
        )
    return head + "\n".join(rows) + "\n"


def _pm(v, se, spec: str = ".3f") -> str:
    return _f(v, spec) + ("" if se is None else f" ± {_f(se, spec)}")


def _bound(d: dict) -> str:
    """The upper confidence bound the gate decided on: of Δ perplexity, or of the KL."""
    if d.get("metric") == "kl" and d.get("kl_upper") is not None:
        return f"KL ≤ {d['kl_upper']:.3g}"
    up = d.get("relative_delta_upper")
    return "—" if up is None else f"{up:+.2%}"


def evaluation_section(ev: dict | None, cal: dict | None) -> str:
    """What the gate was measured on: per domain, before/after perplexity (± SE) and KL, and warnings."""
    if not ev:
        return ""
    cal = cal or {}
    source = public_name(cal.get("data", "?"))
    if cal.get("self_tokens"):
        source += f" ({cal.get('text_tokens', 0):,} text + {cal['self_tokens']:,} self-generated tokens)"
    if ev["metric"] == "kl":
        rule = f"mean KL(original ‖ compressed) ≤ {ev['kl_budget']} nats/token on every domain"
    else:
        kind = "×(1 + budget)" if ev["budget_mode"] == "relative" else "+ budget"
        rule = f"perplexity ≤ baseline {kind}, budget {ev['ppl_budget']}, on every domain"
    conf, headroom = ev.get("confidence"), ev.get("headroom") or 0.0
    if conf is not None:
        rule += (f", decided on the {conf:.0%} upper confidence bound of the change (paired by window): the "
                 "change is within budget with that confidence, on the gate's text")
    if headroom:
        rule += (f"; the bound is held to {1 - headroom:.0%} of the budget (policy.headroom {headroom:g}), the rest "
                 "kept for text unlike the gate's")
    rows = "\n".join(
        f"| {d['name']} | `{public_name(d['dataset'])}` | {d['scored_tokens']:,} / {d['windows']} | "
        f"{_pm(d['baseline']['ppl'], d['baseline'].get('ppl_se'))} | {_pm(d['final']['ppl'], d['final'].get('ppl_se'))} | "
        f"{d['relative_delta']:+.2%} | {_bound(d)} | {_pm(d['final'].get('kl'), d['final'].get('kl_se'), '.3g')} | "
        f"{'✓' if d['passed'] else '✗'} |"
        for d in ev["domains"]
    )
    warn = "".join(f"\n> ⚠ {w}\n" for w in ev.get("warnings", []))
    return f"""
## What the gate measured

Calibration (fits): `{source}`. Gate: {rule}.

| domain | data | scored tokens / windows | perplexity before | after | Δ | bound | KL (nats/token) | within budget |
|---|---|---:|---:|---:|---:|---:|---:|:-:|
{rows}

± is one standard error, windows as the sampling unit. KL is measured against the original model's top-k
next-token distribution (a lower bound of the full KL).
{confirmation_section(ev)}{warn}"""


def confirmation_section(ev: dict) -> str:
    """The decision's two numbers per domain: on the windows the search measured, and on the held-out
    windows its choice was confirmed on once (``policy.confirm_fraction``); '' without them."""
    c = ev.get("confirmation")
    if not c:
        return ""
    def side(d: dict, split: str) -> str:
        row = dict(d[split], metric=d.get("metric"))
        return f"{row['windows']} | {row['relative_delta']:+.2%} | {_bound(row)}"

    rows = "\n".join(f"| {d['name']} | {side(d, 'search')} | {side(d, 'confirmation')} | {'✓' if d['passed'] else '✗'} |"
                     for d in ev["domains"] if d.get("confirmation"))
    back = "".join(f"\n* {n}" for n in c.get("stepped_back") or [])
    return f"""
The search chose among cuts on {1 - c['fraction']:.0%} of each domain's windows; the other {c['fraction']:.0%},
held out, measured its choice once, with the same rule (the table above is every window together):

| domain | search windows | Δ | bound | held-out windows | Δ | bound | both within budget |
|---|---:|---:|---:|---:|---:|---:|:-:|
{rows}
{back}
"""


def public_name(value: str | None) -> str:
    """A name a published card may show: Hub ids and plain names as they are; a local path (or a
    ``pkg:`` source) by its last component only — a card never leaks a machine's paths."""
    import re

    if not value:
        return "—"
    value = str(value)
    if value.startswith("pkg:"):
        value = value[4:].partition("/")[2] or value[4:]
        return value
    if value.startswith(("/", "~", ".")) or "\\" in value or Path(value).expanduser().exists():
        return Path(value).name or "model"
    if re.fullmatch(r"[\w.-]+(/[\w.-]+)?(:[\w.-]+)?", value):
        return value
    return Path(value).name


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


def agreement_line(r: dict) -> str:
    a = r.get("agreement") or {}
    if a.get("next_token") is None:
        return ""
    c = a.get("continuations")
    return (f"Greedy agreement with the original on the gate's held-out windows: {a['next_token']:.1%} of next "
            "tokens" + (f"; {c['identical']:.0%} of {c['prompts']} greedy continuations of {c['tokens']} tokens "
                        "identical" if c else "") + ".\n")


def tasks_section(r: dict) -> str:
    t = r.get("tasks")
    if not t:
        return ""
    rows = "\n".join(f"| {row['task']} | {row['metric']} | {_f(row['original'])} | {_f(row['compressed'])} | "
                     f"{_f(row['delta'], '+.4f')} | {row['samples'] or '—'} |" for row in t["tasks"])
    gate = ("" if t.get("budget") is None else
            f"Gate: no task's score may drop by more than {t['budget']:g} ({'held' if t['passed'] else 'failed'}).\n")
    return f"""
## Tasks (lm-evaluation-harness, zero-shot, same settings for both models)

| task | metric | original | compressed | Δ | examples |
|---|---|---:|---:|---:|---:|
{rows}

{gate}"""


def scrub_paths(text: str) -> str:
    """Absolute paths in free text (warnings quote files) → their last component."""
    import re

    return re.sub(r"(?<![\w:/.])(/[^\s`'\"|),;]+)", lambda m: Path(m.group(1)).name or m.group(1), text)


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
        "choice": "every weight matrix's GGML type", "types": "Tensor types", "where": "in llama.cpp",
        "anchor": "llama.cpp's {name}", "anchor_line": "llama.cpp's own {name} of the same F16 ({bytes:,} bytes, no "
        "importance matrix)", "unchanged": "the GGUF's tensor types",
        "load": '```bash\nllama-cli -m model.gguf -p "Once upon a time"\n```\n\n```python\nfrom llama_cpp import Llama\n'
                'llm = Llama(model_path="model.gguf")\n```',
    },
    "compressed-tensors": {
        "file": "a compressed-tensors checkpoint (`pack-quantized`) of {bytes:,} bytes of tensors",
        "choice": "every linear layer's integer scheme (fused q/k/v and gate/up together)", "types": "Layer schemes",
        "where": "in plain transformers after reloading the folder", "anchor": "uniform {name}",
        "anchor_line": "the uniform {name} checkpoint of the same model ({bytes:,} bytes of tensors; every linear layer "
        "in {name}, rounded the same way — what llm-compressor's GPTQModifier writes for that scheme)",
        "unchanged": "the checkpoint's layer schemes",
        "load": "```python\n# pip install compressed-tensors\nfrom transformers import AutoModelForCausalLM\n"
                'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n```\n\n'
                "```bash\nvllm serve path/to/this/folder\n```",
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
