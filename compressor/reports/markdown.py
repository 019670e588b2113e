"""Markdown views: the linearity profile and decision tables, and the sections a model card is made of.

The profile (:func:`profile_table`, :func:`profile_markdown`), the per-block
decisions (:func:`decisions_table`), what the gate measured
(:func:`evaluation_section`, :func:`confirmation_section`), greedy agreement
and task scores (:func:`agreement_line`, :func:`tasks_section`), and the
names a published card may show (:func:`public_name`, :func:`scrub_paths`).
The card itself is assembled in :mod:`compressor.reports.card`.
"""

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
        f"# Linearity profile: {profile.model}\n\nModel type `{profile.model_type}`; {s.get('fit_rows', '?')} fit rows,"
        f" {s.get('heldout_rows', '?')} held-out rows (windows of {s.get('seq_len', '?')} tokens from"
        f" {s.get('data', '?')}).\nR²_lin = 1 − SSE/SST of the closed-form affine fit on held-out rows, pooled over"
        f" output features. Blocks marked {FLAG} have most of their held-out variance in a few sink/spike rows: a high"
        " R²_lin there does not mean the swap is safe.\n\n"
        + profile_table(profile.blocks)
    )


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
            rep = (d.get("kind") or "?") + (
                f" ({unit} {size})" if size is not None and d.get("kind") != "affine" else ""
            )
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
        f"| {d['name']} | `{public_name(d['dataset'])}` | {d['scored_tokens']:,} / {d['windows']} |"
        f" {_pm(d['baseline']['ppl'], d['baseline'].get('ppl_se'))} |"
        f" {_pm(d['final']['ppl'], d['final'].get('ppl_se'))} | {d['relative_delta']:+.2%} | {_bound(d)} |"
        f" {_pm(d['final'].get('kl'), d['final'].get('kl_se'), '.3g')} | {'✓' if d['passed'] else '✗'} |"
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

    rows = "\n".join(
        f"| {d['name']} | {side(d, 'search')} | {side(d, 'confirmation')} | {'✓' if d['passed'] else '✗'} |"
        for d in ev["domains"]
        if d.get("confirmation")
    )
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
