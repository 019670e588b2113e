"""``analysis.json`` (schema ``compressor.analysis/v1``), ``analysis.md`` and the table across checkpoints.

Everything here works from the JSON dict alone, so a report can be redrawn, and
analyses of several checkpoints merged, without loading a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from compressor.core.errors import InputError

SCHEMA = "compressor.analysis/v1"


def _f(v, spec: str = ".3f") -> str:
    return "—" if v is None or (isinstance(v, float) and v != v) else format(v, spec)


def clean(obj):
    """JSON-safe: non-finite floats → None, tuples → lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def load_analysis(path: str | Path) -> dict:
    """Read an ``analysis.json``; bad path or schema → :class:`InputError` (exit 2)."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "analysis.json"
    if not p.is_file():
        raise InputError(f"--compare: {str(path)!r} is not an analysis.json file (nor a folder holding one); "
                         "give files written by `compressor analyze`")
    try:
        data = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"--compare: {p} is not valid JSON ({e}); give files written by `compressor analyze`") from e
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise InputError(f"--compare: {p} has schema {got!r}, expected {SCHEMA!r}; give files written by "
                         "`compressor analyze`")
    return data


# -- the two-regimes reading (the profile itself is the engine's) ------------
def regimes_reading(profile: list[dict]) -> str:
    high = [b for b in profile if (b["r2_lin"] or -1) >= 0.5]
    narrow = [b["index"] for b in high
              if b["r2_median_feature"] is not None and b["r2_median_feature"] < b["r2_lin"] - 0.2]
    flagged = [b["index"] for b in profile if b["outlier_dominated"]]
    broad = [b["index"] for b in high if b["index"] not in narrow and b["index"] not in flagged]
    text = (f"{len(high)} of {len(profile)} blocks reach R²_lin ≥ 0.5. "
            f"{len(broad)} of them are linear across output features (per-feature median R² within 0.2 of R²_lin"
            f"{': blocks ' + ', '.join(map(str, broad)) if broad else ''}); {len(narrow)} are linear only in a few "
            f"high-variance output directions (median feature R² more than 0.2 below"
            f"{': blocks ' + ', '.join(map(str, narrow)) if narrow else ''}). ")
    text += (f"{len(flagged)} block(s) are outlier-dominated — most of their held-out variance sits in sink or spike "
             f"rows, so their R²_lin says little about the bulk of tokens: {', '.join(map(str, flagged))}."
             if flagged else "No block is outlier-dominated.")
    return text


def add_readings(a: dict) -> dict:
    """Set every part's plain-words ``reading`` from its numbers (in place; also for a loaded ``analysis.json``)."""
    from compressor.analysis import control, corpora, crossfeed, probe, trained

    a["regimes"] = dict(a.get("regimes") or {}, reading=regimes_reading(a["profile"]))
    readers = {"probe": probe.reading, "trained": trained.reading, "crossfeed": crossfeed.reading,
               "control": control.reading,
               "corpora": lambda c: corpora.reading(c["domains"], c, c["blocks"],
                                                    d_in=(a.get("profile") or [{}])[0].get("d_in"))}
    for part, read in readers.items():
        if a.get(part):
            a[part]["reading"] = read(a[part])
    return a


# -- the table across checkpoints ---------------------------------------------
def _median(v: list) -> float | None:
    v = sorted(x for x in v if x is not None)
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _corr(c: dict | None, name: str) -> str:
    if not c or c[name]["r"] is None:
        return "—"
    ci = c[name].get("ci")
    return f"{c[name]['r']:+.2f}" + (f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "")


def summary_row(a: dict) -> dict[str, str]:
    """One checkpoint's column of the table across checkpoints."""
    prof = a["profile"]
    r2 = [b["r2_lin"] for b in prof if b["r2_lin"] is not None]
    out = {
        "model type / blocks": f"{a['model_type']} / {len(prof)}",
        "rows (fit / held-out)": f"{a['settings']['fit_rows']:,} / {a['settings']['heldout_rows']:,}",
        "R²_lin mean [min, max]": f"{sum(r2) / len(r2):.3f} [{min(r2):.3f}, {max(r2):.3f}]" if r2 else "—",
        "blocks R²_lin ≥ 0.5 / outlier-dominated": f"{len(r2) and sum(v >= 0.5 for v in r2)} / "
                                                     f"{sum(b['outlier_dominated'] for b in prof)}",
    }
    p = a.get("probe")
    if p:
        out["probe: median gain (points)"] = _f(100 * (_median([b["gain"] for b in p["blocks"]]) or float("nan")),
            ".1f")
        out["probe: Pearson gain vs 1 − R²_lin"] = _corr(p["correlation"], "pearson")
        out["probe: Spearman gain vs 1 − R²_lin"] = _corr(p["correlation"], "spearman")
    t = a.get("trained")
    if t:
        out[f"trained: median gap, Adam / GD ({t['steps']} steps)"] = (
            f"{_f(_median([b['adam']['gap'] for b in t['blocks']]))} / "
            f"{_f(_median([b['gd']['gap'] for b in t['blocks']]))}")
        for key, label in (("gap_vs_condition", "condition"), ("gap_vs_ceiling", "closed-form R²")):
            c = t["correlation"][key]
            out[f"trained: Spearman gap vs {label} (Adam / GD)"] = (
                f"{_corr(c['adam'], 'spearman')} / {_corr(c['gd'], 'spearman')}")
    c = a.get("corpora")
    if c:
        rhos = [v for v in c["spearman"].values() if v is not None]
        out["corpora: min Spearman between domains"] = _f(min(rhos), "+.2f") if rhos else "—"
        out["corpora: median per-block spread"] = _f(c["median_spread"])
    x = a.get("crossfeed")
    if x:
        out["cross-feed: variance share FFN / inputs"] = f"{_f(x['row_share'], '.0%')} / {_f(x['column_share'], '.0%')}"
    k = a.get("control")
    if k:
        out["control: R²_lin mean trained / random"] = f"{_f(k['trained_mean'])} / {_f(k['random_mean'])}"
        out["control: R²_lin σ trained / random"] = f"{_f(k['trained_std'])} / {_f(k['random_std'])}"
        out["control: Spearman trained vs random"] = _f(k["spearman_trained_vs_random"], "+.2f")
    tm = a.get("timings", {})
    if tm.get("total_s") is not None:
        out["wall time (s): total / trained part"] = f"{tm['total_s']:.0f} / {_f(tm.get('trained_s'), '.0f')}"
    return out


def compare_table(analyses: list[dict]) -> str:
    """Markdown table, one column per checkpoint (a second model is one more column).

    >>> print(compare_table([load_analysis("a/analysis.json"), load_analysis("b/analysis.json")]))  # doctest: +SKIP
    """
    cols = [summary_row(a) for a in analyses]
    keys: list[str] = []
    for c in cols:
        keys += [k for k in c if k not in keys]
    head = "| | " + " | ".join(f"`{a['model']}`" for a in analyses) + " |\n|---|" + "---:|" * len(analyses) + "\n"
    return head + "\n".join(f"| {k} | " + " | ".join(c.get(k, "—") for c in cols) + " |" for k in keys) + "\n"


# -- analysis.md ----------------------------------------------------------------
def _per_block_table(a: dict) -> str:
    probe = {b["index"]: b for b in (a.get("probe") or {}).get("blocks", [])}
    trained = {b["index"]: b for b in (a.get("trained") or {}).get("blocks", [])}
    control = a.get("control") or {}
    random = dict(zip(control.get("blocks", []), control.get("random_r2_lin", [])))
    head = ("| block | R²_lin | median feature R² | explained eff. rank | outlier | R²_poly − R²_lin "
            "| Adam R² | GD R² | input cond. | random-weight R²_lin |\n"
            "|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|\n")
    rows = []
    for b in a["profile"]:
        i = b["index"]
        p, t = probe.get(i, {}), trained.get(i)
        rows.append(
            f"| {i} | {_f(b['r2_lin'], '.4f')} | {_f(b['r2_median_feature'])} | "
            f"{_f(b['explained_effective_rank'], '.1f')} "
            f"| {'⚠' if b['outlier_dominated'] else ''} | {_f(p.get('gain'), '+.4f')} "
            f"| {_f(t['adam']['r2']) if t else '—'} | {_f(t['gd']['r2']) if t else '—'} "
            f"| {_f(b['input_condition_number'], '.3g')} | {_f(random.get(i))} |")
    return head + "\n".join(rows) + "\n"


def markdown(a: dict, figures: dict[str, str], others: list[dict] = ()) -> str:
    """The report: every part's figure, its plain reading (generated from the numbers), the table across checkpoints."""
    s, tm = a["settings"], a.get("timings", {})
    out = [f"# What the paper claims, re-measured on `{a['model']}`\n",
           f"Model type `{a['model_type']}`, {len(a['profile'])} FFN blocks. Main text `{s['data']}`: "
           f"{s['fit_rows']:,} fit and {s['heldout_rows']:,} held-out rows (windows of {s['seq_len']} tokens). "
           f"R² is always held-out, 1 − SSE/SST pooled over output features; every fit is exact least squares "
           f"(compressor {a['tool_version']}, schema `{a['schema']}`).\n"]

    def fig(part: str) -> str:
        return f"\n![{part}]({figures[part]})\n" if part in figures else ""

    out.append("## Two regimes of high R²_lin (paper, Figure 4)\n" + fig("regimes") + "\n"
               + a["regimes"]["reading"] + "\n")
    p = a.get("probe")
    if p:
        out.append(f"## 1. Is the residual low-order multiplicative? A bilinear probe\n\n"
                   f"Per block, exact least squares on "
                   f"[x, products of the top {p['rank']} principal components of x] ({p['extra_features']} extra "
                   f"regressors; "
                   f"components from the first {p['pca_rows']:,} fit rows), scored on the same held-out rows as "
                   f"R²_lin. "
                   "No optimiser: a ceiling like R²_lin.\n" + fig("probe") + "\n" + p["reading"] + "\n")
    t = a.get("trained")
    if t:
        out.append(f"## 2. The trained-linear pitfall\n\n"
                   f"Per block, `nn.Linear` from zero, {t['steps']} full-batch steps on the "
                   f"fit rows' mean squared error — {t['optimizers']['adam']}; {t['optimizers']['gd']} — scored on the "
                   f"held-out rows against the closed-form ceiling. Budget: {t['steps']} steps per optimiser and "
                   f"block, "
                   f"{_f(t['seconds'], '.0f')} s in all here. Deterministic: zero start, full batch, no sampling.\n"
                   + fig("trained") + "\n" + t["reading"] + "\n")
    c = a.get("corpora")
    if c:
        doms = "; ".join(f"`{n}`: {d['source']} ({d['fit_rows']:,} fit / {d['heldout_rows']:,} held-out rows)"
                         for n, d in c["domains"].items())
        pairs = ", ".join(f"{k} {_f(v, '+.2f')}" for k, v in c["spearman"].items())
        out.append(f"## 3. Corpus robustness\n\n{doms}. Equal fit rows per domain, so the finite-sample bias is the "
                   f"same. Spearman between profiles: {pairs}.\n" + fig("corpora") + "\n" + c["reading"] + "\n")
    x, k = a.get("crossfeed"), a.get("control")
    if x or k or a.get("skipped", {}).get("crossfeed"):
        out.append("## 4. Learned, not architectural? Weights or inputs\n")
        if x:
            out.append(f"### a. Cross-feeding within the model\n\n"
                       f"Blocks {', '.join(map(str, x['blocks']))}: the residual "
                       f"stream entering block i's FFN, normalised with block j's own pre-FFN norm, through block j's "
                       f"FFN; exact affine fit on {x['fit_rows']:,} fit rows, scored on {x['heldout_rows']:,} held-out "
                       "rows. Rows are FFNs, columns input sources; the diagonal is R²_lin on these rows.\n"
                       + fig("crossfeed") + "\n" + x["reading"] + "\n")
        elif a.get("skipped", {}).get("crossfeed"):
            out.append(f"### a. Cross-feeding within the model\n\nNot run: {a['skipped']['crossfeed']}.\n")
        if k:
            out.append(f"### b. Untrained control\n\nThe same architecture built from its config with random weights "
                       f"(the library's initialisation, seed {k['seed']}), profiled on exactly the trained model's "
                       f"rows "
                       f"({k['fit_rows']:,} fit, {k['heldout_rows']:,} held-out).\n" + fig("control") + "\n"
                       + k["reading"] + "\n")
    out.append("## 5. Across checkpoints\n\n" + compare_table([a, *others]))
    out.append("## Per block\n\n" + _per_block_table(a))
    if tm:
        order = ["load_s", "main_pass_s", "probe_s", "crossfeed_s", "trained_s", "self_text_s", "corpora_s",
                 "control_s",
                 "total_s", "total_excluding_trained_s"]
        out.append("## Timing\n\n| stage | seconds |\n|---|---:|\n"
                   + "\n".join(f"| {key[:-2].replace('_', ' ')} | {_f(tm[key], '.1f')} |" for key in order if key in tm)
                   + "\n\nThe main pass includes the probe, cross-feeding and trained-linear work done inside it "
                   "(listed separately too).\n")
    if a.get("warnings"):
        out.append("## Warnings\n\n" + "\n".join(f"- {w}" for w in a["warnings"]) + "\n")
    return "\n".join(out)


def write_analysis(a: dict, out_dir: str | Path, others: list[dict] = ()) -> dict[str, Path]:
    """Write ``analysis.json``, the PNG figures and ``analysis.md`` into ``out_dir``."""
    from compressor.analysis.figures import draw_all

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figs = draw_all(a, out)
    paths = {"json": out / "analysis.json", "markdown": out / "analysis.md", **{f"fig_{k}": v for k, v in figs.items()}}
    _atomic(paths["json"], json.dumps(clean(a), indent=1) + "\n")
    _atomic(paths["markdown"], markdown(a, {k: v.name for k, v in figs.items()}, list(others)))
    return paths


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
