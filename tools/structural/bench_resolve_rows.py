#!/usr/bin/env python
"""Why a prune re-solve that looks good on its fit rows fails on unseen text: rows per unit.

For some FFN blocks of a real model, the statistics of ``h → y`` (hidden units
to block output) are collected on WikiText-2 valid: one held-out set and two
nested fit sets (e.g. 14,336 rows, the default recipe's, and 3× as many). For
each fit set the hidden-unit removal path of the product
(:func:`compressor.fitting.obs.obs_path`) picks the kept units at a few widths,
and the down projection over them is solved

* exactly (``ridge 0``: what the product did up to 0.1),
* with a ridge toward the original down projection, ``λ`` relative to each
  kept unit's own second moment (``ridge λ``: ``(S + λ·diag S) W = S_hy +
  λ·diag S · W₀``),
* not at all (``ridge inf``: the original columns of the kept units).

Each is scored by its relative error (SSE / SST of the block output) on the
fit rows and on the held-out rows. A re-solve that overfits shows a held-out
error far above its fit error that falls with more rows.

Run it alone: two torch processes on two cores distort every number.

    python tools/structural/bench_resolve_rows.py \\
        --model ~/.cache/compressor-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --layers 5 8 \\
        --json tools/structural/results/resolve_rows_qwen2.5_coder_1.5b.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, environment, quiet_offline_env, utc_now, write_json

quiet_offline_env()

import torch  # noqa: E402

from compressor.core.stats import Moments  # noqa: E402
from compressor.fitting.obs import obs_path  # noqa: E402
from compressor.fitting.solve import uncentered  # noqa: E402
from compressor.inputs.load import load_model  # noqa: E402

F64 = torch.float64


class _Stop(Exception):
    pass


def hidden(mlp, x: torch.Tensor) -> torch.Tensor:
    """The hidden units a gated MLP's down projection receives."""
    return mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)


def collect(model, windows: torch.Tensor, layers: list[int], split_rows: list[int], batch: int) -> dict:
    """``{layer: [Moments per row range]}``: h → y statistics of each layer's MLP over consecutive
    row ranges (``split_rows``: their sizes in rows, in the order of ``windows``)."""
    blocks = model.model.layers
    d_ff, d = blocks[0].mlp.down_proj.in_features, blocks[0].mlp.down_proj.out_features
    stats = {i: [Moments(d_in=d_ff, d_out=d) for _ in split_rows] for i in layers}
    edges = [0]
    for n in split_rows:
        edges.append(edges[-1] + n)
    seen = {"rows": 0}

    def hook_for(i):
        def hook(mod, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            y = out.reshape(-1, out.shape[-1])
            h = hidden(mod, x)
            lo = seen["rows"]
            for s, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
                ra, rb = max(a, lo) - lo, min(b, lo + len(x)) - lo
                if rb > ra:
                    stats[i][s].update(h[ra:rb], y[ra:rb])
            if i == max(layers):
                raise _Stop
        return hook

    handles = [blocks[i].mlp.register_forward_hook(hook_for(i)) for i in layers]
    t = time.perf_counter()
    try:
        with torch.no_grad():
            for k in range(0, len(windows), batch):
                w = windows[k:k + batch]
                try:
                    model(w)
                except _Stop:
                    pass
                seen["rows"] += w.numel()
                print(f"  {seen['rows']:,}/{windows.numel():,} tokens, {time.perf_counter() - t:.0f} s", flush=True)
    finally:
        for h in handles:
            h.remove()
    return stats


def rel_errors(W: torch.Tensor, raw: Moments, centred: Moments) -> float:
    """SSE of ``y ≈ Wᵀh`` (no intercept; raw sums) over the SST of ``y`` about its mean."""
    sse = (raw.cyy_diag.sum() - 2 * (W * raw.cxy).sum() + (W * (raw.cxx @ W)).sum()).item()
    return max(sse, 0.0) / centred.sst()


def ridge_solve(raw: Moments, kept: torch.Tensor, w0: torch.Tensor, lam: float) -> torch.Tensor:
    s = raw.cxx[kept[:, None], kept]
    rhs = raw.cxy[kept]
    if math.isinf(lam):
        return w0[kept]
    if lam > 0:
        dg = torch.diagonal(s).clone()
        s = s + torch.diag(lam * dg)
        rhs = rhs + lam * dg[:, None] * w0[kept]
    chol, info = torch.linalg.cholesky_ex(s)
    if int(info):
        s = s + 1e-8 * torch.diagonal(s).mean() * torch.eye(len(kept), dtype=F64)
        chol = torch.linalg.cholesky(s)
    return torch.cholesky_solve(rhs, chol)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file or model folder (a gated MLP: Llama, Qwen2, ...)")
    ap.add_argument("--layers", type=int, nargs="+", default=[5, 8])
    ap.add_argument("--fit-rows", type=int, nargs="+", default=[14336, 43008],
                    help="nested fit sets (each contains the smaller ones)")
    ap.add_argument("--heldout-rows", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--keep", type=float, nargs="+", default=[0.971, 0.886])
    ap.add_argument("--ridge", type=float, nargs="+", default=[0.0, 0.01, 0.1, 1.0, math.inf])
    ap.add_argument("--step", type=int, default=64)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)

    t0 = time.perf_counter()
    model, tok, _ = load_model(args.model)
    load_s = time.perf_counter() - t0
    text = (WIKITEXT_DIR / "valid.txt").read_text(encoding="utf-8")
    ids = tok(text, return_tensors="pt").input_ids[0]
    fit_rows = sorted(args.fit_rows)
    total = args.heldout_rows + fit_rows[-1]
    if ids.numel() < total:
        raise SystemExit(f"WikiText-2 valid has {ids.numel():,} tokens; {total:,} asked")
    windows = ids[:total - total % args.seq_len].reshape(-1, args.seq_len)
    # Held-out rows first, then the fit sets in growing order (each the union of the earlier ones).
    sizes = [args.heldout_rows, fit_rows[0]] + [b - a for a, b in zip(fit_rows[:-1], fit_rows[1:])]
    t1 = time.perf_counter()
    stats = collect(model, windows, args.layers, sizes, args.batch)
    collect_s = time.perf_counter() - t1

    results = []
    for i in args.layers:
        held, parts = stats[i][0], stats[i][1:]
        held_raw = uncentered(held)
        w0 = model.model.layers[i].mlp.down_proj.weight.detach().to(F64).T.contiguous()  # [d_ff, d]
        d_ff = w0.shape[0]
        fit = None
        for n_rows, part in zip(fit_rows, parts):
            fit = part if fit is None else fit + part
            fit_raw = uncentered(fit)
            t = time.perf_counter()
            path = obs_path(fit, held, 0, step=args.step)
            path_s = time.perf_counter() - t
            for keep in args.keep:
                size = min(path.sizes, key=lambda s: abs(s - keep * d_ff))
                kept = path.kept(size)
                row = {"layer": i, "fit_rows": fit.n, "rows_per_unit": fit.n / d_ff, "heldout_rows": held.n,
                       "kept_units": int(size), "keep": size / d_ff, "path_s": path_s,
                       "path_heldout_rel_error": path.heldout_rel_error[path.sizes.index(size)],
                       "path_fit_rel_error": path.fit_rel_error[path.sizes.index(size)], "ridge": []}
                for lam in args.ridge:
                    W = ridge_solve(fit_raw, kept, w0, lam)
                    Wf = torch.zeros(d_ff, w0.shape[1], dtype=F64)
                    Wf[kept] = W
                    e_fit, e_held = rel_errors(Wf, fit_raw, fit), rel_errors(Wf, held_raw, held)
                    row["ridge"].append({"lambda": "inf" if math.isinf(lam) else lam, "fit_rel_error": e_fit,
                                         "heldout_rel_error": e_held})
                    print(f"layer {i} rows {fit.n} keep {size} λ {lam:g}: fit {e_fit:.5f} held-out {e_held:.5f}",
                          flush=True)
                results.append(row)
    write_json(args.json, {
        "what": "prune re-solve of the down projection: relative error on fit vs held-out rows, by fit rows and "
                "ridge toward the original weights (WikiText-2 valid)",
        "command": "tools/structural/bench_resolve_rows.py", "args": {k: (str(v) if k == "ridge" else v)
                                                          for k, v in vars(args).items()},
        "when": utc_now(), "environment": environment(), "ran_alone": True,
        "load_s": load_s, "collect_s": collect_s, "results": results,
    })


if __name__ == "__main__":
    main()
