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
    source = cal.get("data", "?")
    if cal.get("self_tokens"):
        source += f" ({cal.get('text_tokens', 0):,} text + {cal['self_tokens']:,} self-generated tokens)"
    if ev["metric"] == "kl":
        rule = f"mean KL(original ‖ compressed) ≤ {ev['kl_budget']} nats/token on every domain"
    else:
        kind = "×(1 + budget)" if ev["budget_mode"] == "relative" else "+ budget"
        rule = f"perplexity ≤ baseline {kind}, budget {ev['ppl_budget']}, on every domain"
    conf = ev.get("confidence")
    if conf is not None:
        rule += (f", decided on the {conf:.0%} upper confidence bound of the change (paired by window): the "
                 "change is within budget with that confidence, on the gate's text")
    rows = "\n".join(
        f"| {d['name']} | `{d['dataset']}` | {d['scored_tokens']:,} / {d['windows']} | "
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
{warn}"""


def model_card(report: dict) -> str:
    r = report
    kept = [d for d in r["blocks"] if d["decision"] == "kept"]
    return f"""---
library_name: transformers
tags: [compressor, ffn-compression, compressed]
base_model: {r['model']['source']}
---

# {Path(r['output'] or 'model').name}

`{r['model']['source']}` with {len(kept)} of {len(r['blocks'])} FFN blocks replaced by closed-form
fitted layers (kind `{r['recipe']['replacement']['kind']}`) by [compressor](https://pypi.org/project/compressor/) {r['tool_version']}.

| | parameters | perplexity |
|---|---:|---:|
| original | {r['params']['before']:,} | {r['perplexity']['baseline']['ppl']:.4f} |
| compressed | {r['params']['after']:,} | {r['perplexity']['final']['ppl']:.4f} |

Perplexity: {r['perplexity']['final']['tokens']} scored tokens of `{r['perplexity']['data']}`, windows of
{r['perplexity']['final']['seq_len']} tokens, stride {r['perplexity']['final']['stride']}
(budget {r['perplexity']['budget']:.4f}).
{evaluation_section(r.get('evaluation'), r.get('calibration'))}
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
