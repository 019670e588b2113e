#!/usr/bin/env python
"""Benchmark perplexity-gated FFN compression on SmolLM2-135M (wikitext-2).

One run, one model load, one calibration pass:

1. baseline perplexity on wikitext-2 test tokens (HF sliding windows);
2. per-block table for all blocks: held-out R²_lin, bulk R², outlier flag and
   the single-swap perplexity (each block alone replaced by its full-rank
   closed-form affine fit, then undone);
3. compression under a +5 % relative perplexity budget with
   (a) the bare threshold rule (no gate, R²_lin ≥ 0.9, outlier blocks allowed),
   (b) the gated policy (threshold 0.6, order r2, no refit),
   (c) gated + refit,
   (d) gated, order swap_ppl (skippable: --skip-swap-order, or skipped
       automatically when the time budget is nearly spent);
   each on a fresh deep copy of the pristine model, reusing a deep copy of the
   one set of statistics. Reports blocks replaced, parameters, final
   perplexity and Δ, wall time and plain-forward CPU throughput before/after.

Usage (from the repo root)::

    . .venv/bin/activate
    python tools/bench_compress.py                     # writes tools/results/bench_compress.json

Progress goes to the log (stderr); a short summary is printed to stdout.
The JSON is rewritten after every stage, so an interrupted run leaves
partial results.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchlib import MODEL, REPO_ROOT, RESULTS_DIR, WIKITEXT_DIR, environment, quiet_offline_env

quiet_offline_env()

import torch  # noqa: E402

logger = logging.getLogger("bench_compress")

DEFAULT_OUTPUT = RESULTS_DIR / "bench_compress.json"
CAL_SEQ_LEN = 128
EVAL_SEQ_LEN = 256
EVAL_STRIDE = 128
EVAL_BATCH = 8
PPL_BUDGET = 0.05


def resolve_data() -> tuple[Path, Path]:
    cal, ev = (WIKITEXT_DIR / "valid.txt").resolve(), (WIKITEXT_DIR / "test.txt").resolve()
    missing = [str(p) for p in (cal, ev) if not p.is_file()]
    if missing:
        raise SystemExit(
            f"bench_compress: wikitext-2 file(s) not found: {', '.join(missing)}\n"
            f"expected <repo>/../shared/data/wikitext-2/{{valid,test}}.txt (repo = {REPO_ROOT})"
        )
    return cal, ev


def throughput(model, vocab: int, *, batch: int = 8, seq: int = 256, reps: int = 3) -> dict:
    """Tokens/s of a plain forward (LM head included) under inference_mode."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    model.eval()
    times = []
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            times.append(time.perf_counter() - t0)
    best, med = min(times), sorted(times)[len(times) // 2]
    return {
        "batch": batch, "seq_len": seq, "reps": reps, "times_s": times,
        "tokens_per_s_best": batch * seq / best, "tokens_per_s_median": batch * seq / med,
    }


def recipe_dict(cal_path: Path, ev_path: Path, args, policy: dict, *, swap_sweep: bool = False) -> dict:
    return {
        "model": {"source": MODEL, "dtype": "float32", "device": "cpu"},
        "calibration": {"dataset": str(cal_path), "seq_len": CAL_SEQ_LEN, "max_tokens": args.cal_tokens, "batch_size": 8},
        "evaluation": {"dataset": str(ev_path), "seq_len": EVAL_SEQ_LEN, "stride": EVAL_STRIDE,
                       "max_tokens": args.eval_tokens, "batch_size": EVAL_BATCH},
        "measure": {"swap_sweep": swap_sweep, "cache": False},
        "policy": {"ppl_budget": PPL_BUDGET, "budget_mode": "relative", **policy},
        "replacement": {"kind": "affine"},
    }


CONFIGS = {
    "a_threshold_rule": {
        "label": "(a) bare threshold rule R²_lin ≥ 0.9 (no gate)",
        "policy": {"gate": False, "threshold": 0.9, "skip_outlier_dominated": False, "order": "r2", "min_blocks": 0},
    },
    "b_gated": {
        "label": "(b) gated, threshold 0.6, order r2",
        "policy": {"gate": True, "threshold": 0.6, "order": "r2", "refit": False, "min_blocks": 0},
    },
    "c_gated_refit": {
        "label": "(c) gated, threshold 0.6, order r2, refit",
        "policy": {"gate": True, "threshold": 0.6, "order": "r2", "refit": True, "min_blocks": 0},
    },
    "d_gated_swap_order": {
        "label": "(d) gated, threshold 0.6, order swap_ppl",
        "policy": {"gate": True, "threshold": 0.6, "order": "swap_ppl", "refit": False, "min_blocks": 0},
    },
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cal-tokens", type=int, default=12288, help="calibration tokens (fit + held-out), seq_len 128")
    ap.add_argument("--eval-tokens", type=int, default=3072, help="evaluation tokens (windows 256, stride 128)")
    ap.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON output path")
    ap.add_argument("--skip-swap-order", action="store_true", help="skip configuration (d) (order swap_ppl)")
    ap.add_argument("--time-budget", type=float, default=22 * 60,
                    help="seconds; (d) is skipped if less than its estimated cost remains (default 1320)")
    ap.add_argument("--throughput-reps", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"comma-separated subset of configurations to run (default: all of {','.join(CONFIGS)})")
    ap.add_argument("--no-sweep", action="store_true", help="skip the 30-block single-swap sweep (table keeps R² columns)")
    args = ap.parse_args(argv)
    selected = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in selected if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; choose from {list(CONFIGS)}")

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "datasets", "filelock", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    cal_path, ev_path = resolve_data()
    t_start = time.perf_counter()

    from compressor.compress import compress_model
    from compressor.data import TextSource, calibration_set, evaluation_tokens
    from compressor.load import load_model
    from compressor.measure import collect
    from compressor.profiling import block_profile
    from compressor.recipe import recipe_from_dict
    from compressor.replace import build_module, count_params, swap
    from compressor.evaluate import perplexity

    out: dict = {
        "benchmark": "bench_compress",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "reproduce": "cd " + shlex.quote(str(REPO_ROOT)) + " && . .venv/bin/activate && python tools/bench_compress.py "
                     + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "environment": dict(
            environment(), load_avg_at_start=os.getloadavg() if hasattr(os, "getloadavg") else None,
        ),
        "settings": {
            "model": MODEL, "calibration_data": str(cal_path), "evaluation_data": str(ev_path),
            "cal_tokens": args.cal_tokens, "cal_seq_len": CAL_SEQ_LEN, "heldout_fraction": 0.2, "seed": 0,
            "eval_tokens": args.eval_tokens, "eval_seq_len": EVAL_SEQ_LEN, "eval_stride": EVAL_STRIDE,
            "eval_batch_size": EVAL_BATCH, "ppl_budget": PPL_BUDGET, "budget_mode": "relative",
            "replacement": "affine (full rank)", "throughput": {"batch": 8, "seq_len": 256, "reps": args.throughput_reps},
        },
        "stages_s": {},
        "configs_selected": selected,
        "sweep": not args.no_sweep,
        "configs": {},
    }
    def write() -> None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        out["elapsed_s"] = time.perf_counter() - t_start
        tmp = args.output.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(out, indent=2, default=float) + "\n")
        tmp.replace(args.output)

    # ---- load, data, statistics (all once) -------------------------------
    t0 = time.perf_counter()
    model, tokenizer, _ = load_model(MODEL)
    model.eval()
    out["stages_s"]["load"] = time.perf_counter() - t0
    vocab = model.get_input_embeddings().weight.shape[0]

    t0 = time.perf_counter()
    cal_src, ev_src = TextSource(str(cal_path)), TextSource(str(ev_path))
    cal = calibration_set(tokenizer, cal_src, seq_len=CAL_SEQ_LEN, max_tokens=args.cal_tokens, heldout_fraction=0.2, seed=0)
    ev_tokens = evaluation_tokens(tokenizer, ev_src, cal_src, max_tokens=args.eval_tokens)
    out["stages_s"]["data"] = time.perf_counter() - t0
    out["settings"]["cal_windows"] = {"fit": int(cal.fit.shape[0]), "heldout": int(cal.heldout.shape[0])}
    out["settings"]["eval_tokens_actual"] = int(ev_tokens.numel())
    logger.info("eval stream: %d tokens", ev_tokens.numel())

    base_recipe = recipe_from_dict(recipe_dict(cal_path, ev_path, args, {}))
    m = base_recipe.measure
    t0 = time.perf_counter()
    stats = collect(model, cal.fit, cal.heldout, batch_size=8, spike_factor=m.spike_factor, precision=m.precision)
    out["stages_s"]["collect"] = time.perf_counter() - t0
    logger.info("statistics collected in %.1f s", out["stages_s"]["collect"])
    pristine = copy.deepcopy(model)  # never modified; every configuration works on a copy of it

    def ppl(mdl, desc: str):
        return perplexity(mdl, ev_tokens, seq_len=EVAL_SEQ_LEN, stride=EVAL_STRIDE, batch_size=EVAL_BATCH, desc=desc)

    t0 = time.perf_counter()
    base = ppl(model, "baseline")
    out["stages_s"]["baseline_ppl"] = ppl_cost = time.perf_counter() - t0
    limit = base.ppl * (1 + PPL_BUDGET)
    out["baseline"] = {**base.to_json(), "budget_ppl": limit}
    logger.info("baseline perplexity %.4f (%d tokens, %.1f s); budget %.4f", base.ppl, base.tokens, ppl_cost, limit)

    t0 = time.perf_counter()
    tp_before = throughput(model, vocab, reps=args.throughput_reps)
    out["throughput_before"] = tp_before
    out["stages_s"]["throughput_before"] = time.perf_counter() - t0
    params_total = count_params(model)
    out["params_total"] = params_total
    logger.info("throughput before: %.0f tok/s (best of %d)", tp_before["tokens_per_s_best"], args.throughput_reps)
    write()

    # ---- per-block table + single-swap sweep ------------------------------
    t0 = time.perf_counter()
    n_blocks = len(stats)
    blocks = []
    for i in range(n_blocks):
        prof, fit = block_profile(stats[i], outlier_share_flag=m.outlier_share_flag)
        path = None
        from compressor.replace import ffn_path

        path = ffn_path(model, i)
        row = {
            "index": i, "r2_lin": prof.r2_lin, "r2_bulk": prof.r2_bulk, "outlier_sst_share": prof.outlier_sst_share,
            "outlier_dominated": prof.outlier_dominated,
        }
        if not args.no_sweep:
            s = swap(model, i, build_module(fit, model.get_submodule(path)))
            try:
                r = ppl(model, f"sweep {i}")
            finally:
                s.undo()
            row.update(swap_ppl=r.ppl, swap_delta_ppl=r.ppl - base.ppl, swap_delta_pct=100 * (r.ppl / base.ppl - 1),
                       within_budget_alone=r.ppl <= limit)
            logger.info("block %2d: R²_lin %.4f bulk %.4f flag %s swap ppl %.4f (%+.2f %%)", i, prof.r2_lin,
                        prof.r2_bulk, prof.outlier_dominated, r.ppl, row["swap_delta_pct"])
        blocks.append(row)
    out["blocks"] = blocks
    out["stages_s"]["sweep"] = time.perf_counter() - t0
    # sanity: the sweep must leave the model as it was
    if not args.no_sweep:
        chk = ppl(model, "post-sweep check")
        out["baseline_after_sweep_check"] = chk.ppl
        if abs(chk.ppl - base.ppl) > 1e-6 * base.ppl:
            logger.warning("perplexity after the sweep %.6f ≠ baseline %.6f: undo is not clean", chk.ppl, base.ppl)
    write()
    del model
    gc.collect()

    # ---- configurations ----------------------------------------------------
    for name, cfg in CONFIGS.items():
        if name not in selected:
            continue
        elapsed = time.perf_counter() - t_start
        if name == "d_gated_swap_order":
            n_cand = sum(1 for b in blocks if b["r2_lin"] >= 0.6 and not b["outlier_dominated"])
            est = (2 * n_cand + 3) * ppl_cost + 10
            if args.skip_swap_order:
                out["configs"][name] = {"label": cfg["label"], "skipped": "--skip-swap-order"}
                continue
            if elapsed + est > args.time_budget:
                why = f"time budget: {elapsed:.0f} s elapsed + ~{est:.0f} s estimated > {args.time_budget:.0f} s"
                logger.warning("skipping %s (%s)", name, why)
                out["configs"][name] = {"label": cfg["label"], "skipped": why}
                write()
                continue
        logger.info("=== %s: %s", name, cfg["label"])
        recipe = recipe_from_dict(recipe_dict(cal_path, ev_path, args, cfg["policy"]))
        work = copy.deepcopy(pristine)
        t0 = time.perf_counter()
        res = compress_model(work, recipe, cal, ev_tokens, stats=copy.deepcopy(stats))
        wall = time.perf_counter() - t0
        tp_after = throughput(work, vocab, reps=args.throughput_reps)
        kept = [d.index for d in res.kept]
        tried = [d.index for d in res.decisions if d.decision in ("kept", "rejected")]
        entry = {
            "label": cfg["label"],
            "policy": recipe.policy.model_dump(mode="json"),
            "blocks_replaced": sorted(kept),
            "kept_in_order": kept if recipe.policy.gate else sorted(kept),
            "n_blocks_replaced": len(kept),
            "candidates_tried": tried,
            "params_before": res.params_before,
            "params_after": res.params_after,
            "params_removed": res.params_before - res.params_after,
            "params_removed_pct": 100 * (res.params_before - res.params_after) / res.params_before,
            "baseline_ppl": res.baseline.ppl,
            "final_ppl": res.final.ppl,
            "delta_ppl_pct": 100 * (res.final.ppl / res.baseline.ppl - 1),
            "budget_ppl": res.budget_ppl,
            "met_budget": res.final.ppl <= res.budget_ppl,
            "gate_passed": res.gate_passed,
            "gate_message": res.gate_message,
            "wall_s": wall,
            "timings": res.timings,
            "throughput_before_tok_s": tp_before["tokens_per_s_best"],
            "throughput_after_tok_s": tp_after["tokens_per_s_best"],
            "throughput_after": tp_after,
            "speedup": tp_after["tokens_per_s_best"] / tp_before["tokens_per_s_best"],
            "decisions": res.decisions_json(),
        }
        out["configs"][name] = entry
        logger.info("%s: %d block(s) %s, ppl %.4f (%+.2f %%), params −%d, %.0f s, %.0f → %.0f tok/s",
                    name, len(kept), sorted(kept), res.final.ppl, entry["delta_ppl_pct"], entry["params_removed"],
                    wall, tp_before["tokens_per_s_best"], tp_after["tokens_per_s_best"])
        write()
        del work, res
        gc.collect()

    # ---- summary -----------------------------------------------------------
    done = {k: v for k, v in out["configs"].items() if "skipped" not in v}
    within = {k: v for k, v in done.items() if v["met_budget"]}
    if within:
        winner = max(within, key=lambda k: (within[k]["params_removed"], -within[k]["final_ppl"]))
        out["winner"] = {"config": winner, "rule": "most parameters removed among runs within the +5 % budget"}
    if "b_gated" in done and "c_gated_refit" in done:
        b, c = done["b_gated"], done["c_gated_refit"]
        out["refit_effect"] = {
            "blocks_without": b["n_blocks_replaced"], "blocks_with": c["n_blocks_replaced"],
            "params_removed_without": b["params_removed"], "params_removed_with": c["params_removed"],
            "final_ppl_without": b["final_ppl"], "final_ppl_with": c["final_ppl"],
        }
    write()

    print(f"\nSmolLM2-135M, wikitext-2: baseline ppl {base.ppl:.3f} on {base.tokens} tokens; budget ≤ {limit:.3f} (+5 %)")
    print(f"{'blk':>3} {'R2_lin':>7} {'bulk':>7} {'flag':>4} {'swapΔ%':>8}")
    for b in blocks:
        sw = f"{b['swap_delta_pct']:+8.2f}" if "swap_delta_pct" in b else f"{'n/a':>8}"
        print(f"{b['index']:>3} {b['r2_lin']:7.4f} {b['r2_bulk']:7.4f} {'Y' if b['outlier_dominated'] else '-':>4} {sw}")
    print(f"\n{'config':<22} {'#blk':>4} {'params removed':>15} {'ppl':>8} {'Δ%':>7} {'budget':>6} {'wall s':>7} tok/s")
    for k, v in out["configs"].items():
        if "skipped" in v:
            print(f"{k:<22} skipped: {v['skipped']}")
            continue
        print(f"{k:<22} {v['n_blocks_replaced']:>4} {v['params_removed']:>15,} {v['final_ppl']:8.3f} {v['delta_ppl_pct']:+7.2f} "
              f"{'ok' if v['met_budget'] else 'MISS':>6} {v['wall_s']:7.0f} {v['throughput_before_tok_s']:.0f}→{v['throughput_after_tok_s']:.0f}")
    if "winner" in out:
        print(f"\nwinner: {out['winner']['config']} ({out['winner']['rule']})")
    print(f"total {time.perf_counter() - t_start:.0f} s; JSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
