#!/usr/bin/env python
"""Which calibration-side statistic ranks single-block damage on unseen text? SmolLM2-135M (issue 10).

For every FFN block of SmolLM2-135M and two replacement kinds — ``affine``
(the whole block becomes its least-squares affine map) and ``prune`` (half of
the hidden units kept, down projection re-solved) — the block's replacement is
installed *alone* and the model is measured against the original on

* ``cal-heldout``: the held-out calibration windows (exactly those windows:
  window length = stride = the calibration ``seq_len``);
* ``wiki-test``: WikiText-2 ``test.txt`` (non-overlapping 512-token windows),
  text no statistic here has seen.

The calibration is what ``recipes/smollm2-135m.yaml`` would get with
``calibration.dataset`` / ``max_tokens`` set by ``--calibration`` /
``--cal-tokens`` (default ``mix``, 16,384 tokens). Calibration-side statistics
per block, all from those tokens alone:

* ``-R²_lin``: held-out R² of the block's affine fit (the profile), negated;
* ``fisher cost``: the fisher block weight (loss-gradient second moment × output
  variance, ``plan.block_weight``) × the replacement's held-out relative
  error (SSE/SST), i.e. the cost the allocate strategy predicts;
* ``cal ΔKL`` / ``cal ΔPPL``: KL(original ‖ swapped) and relative perplexity
  change on the held-out calibration windows (one evaluation per block);

and, for reference, the relative error and the fisher weight alone, and
``-R²_bulk`` (R²_lin without the attention-sink and spike rows). Each is
rank-correlated (Spearman, average ranks for ties, with a bootstrap interval
over blocks) with the block's relative perplexity change and KL on
``wiki-test``, over all blocks and over the blocks not flagged
outlier-dominated. Writes ``tools/structural/results/bench_rank.json`` after every block.

Usage (from the repo root)::

    python tools/structural/bench_rank.py      # ≈ 1 h alone on the 2-core CPU (60 evaluations of ~45 s)
    python tools/structural/bench_rank.py --cal-tokens 2048 --test-tokens 2048 --blocks 0 1   # smoke run
    python tools/structural/bench_rank.py --calibration ../shared/data/wikitext-2/valid.txt
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (MODEL, REPO_ROOT, environment, load_bench_model, paired_change, quiet_offline_env,
                            stopwatch, utc_now, wikitext, write_json)
from tools.benchlib.cli import log_to_stderr
from tools.structural.bench_rank_report import log_summary, summarise

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_rank")

OUTPUT = RESULTS_DIR / "bench_rank.json"
RECIPE = REPO_ROOT / "recipes" / "smollm2-135m.yaml"
KINDS = ("affine", "prune")


def calibration_recipe(calibration: str, cal_tokens: int):
    """The offline default recipe with its calibration source and size replaced."""
    import yaml

    from compressor.recipe import recipe_from_dict

    data = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    data["calibration"].update(dataset=calibration, max_tokens=cal_tokens)
    return recipe_from_dict(data)


def _domain(ev, base) -> dict:
    """Relative perplexity change (± paired SE) and KL of one evaluation against its baseline."""
    dppl, se = paired_change(ev, base)
    return {"ppl": ev.ppl, "dppl": dppl, "dppl_se": se, "kl": ev.kl, "kl_se": ev.kl_se}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", default="mix", help="mix (default), embedded, self, or a text file")
    ap.add_argument("--cal-tokens", type=int, default=16384, help="calibration tokens, fit + held-out")
    ap.add_argument("--test-tokens", type=int, default=16384, help="WikiText-2 test tokens")
    ap.add_argument("--test-seq-len", type=int, default=512, help="WikiText-2 test window (= stride)")
    ap.add_argument("--prune-keep", type=float, default=0.5, help="share of hidden units the prune fit keeps")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--blocks", type=int, nargs="+", default=None, help="blocks to measure (default: all)")
    ap.add_argument("--batch-size", type=int, default=4, help="test windows per forward")
    ap.add_argument("--top-k", type=int, default=64, help="teacher log-probs kept per token for the KL")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--output", default=str(OUTPUT))
    return ap


def resolve_calibration(ap: argparse.ArgumentParser, calibration: str) -> str:
    """``mix``, ``self`` or ``embedded`` as given; a text file as its absolute path (else a usage error)."""
    if calibration in ("mix", "self", "embedded"):
        return calibration
    path = Path(calibration).expanduser()
    if not path.is_file():
        ap.error(f"--calibration {calibration!r}: not mix, self, embedded or an existing text file")
    return str(path.resolve())


def chosen_blocks(ap: argparse.ArgumentParser, wanted: list[int] | None, n_blocks: int) -> list[int]:
    blocks = sorted(set(wanted)) if wanted else list(range(n_blocks))
    if not all(0 <= i < n_blocks for i in blocks):
        ap.error(f"--blocks: the model has blocks 0..{n_blocks - 1}")
    return blocks


def teacher(model, cal, test_ids, args, cal_batch_size: int, timings: dict):
    """The evaluator on both texts, its teacher caches taken on the original model (nothing swapped yet)."""
    from compressor.evaluation.gate import Evaluator

    domains = {"cal-heldout": cal.heldout.flatten(), "wiki-test": test_ids}
    seq = {"cal-heldout": cal.seq_len, "wiki-test": args.test_seq_len}
    with stopwatch(timings, "teacher_s"):
        evaluator = Evaluator.build(model, domains, seq_len=seq, stride=seq, top_k=args.top_k,
                                    batch_size={"cal-heldout": cal_batch_size, "wiki-test": args.batch_size})
    for name, b in evaluator.baseline.domains.items():
        logger.info("baseline %s: perplexity %.4f over %d tokens (%d windows)", name, b.ppl, b.tokens, b.windows)
    return evaluator


def fit_kinds(data, weight: float, kinds: list[str], prune_keep: float) -> tuple[dict, dict]:
    """Each kind's level (prune: nearest ``prune_keep`` of the hidden units) fitted: ``(rows, fits)`` by kind."""
    from compressor.fitting.kinds import get_kind
    from compressor.recipe.schema import AffineReplacement, PruneReplacement

    cfgs = {"affine": AffineReplacement(), "prune": PruneReplacement()}
    rows, fits = {}, {}
    for name in kinds:
        kind, cfg = get_kind(name), cfgs[name]
        levels = kind.levels(data, cfg)
        if name == "prune":
            want = prune_keep * data.d_ff
            level = min(levels, key=lambda lv: (abs(lv.size - want), -lv.size))
        else:
            level = levels[0]
        fits[name] = f = kind.fit(data, cfg, level.size)
        rows[name] = {"size": level.size, "params": level.params, "rel_error": level.heldout_rel_error,
                      "fit_heldout_r2": f.heldout_r2, "fisher_cost": weight * level.heldout_rel_error}
    return rows, fits


def calibration_statistics(model, cal, modules: dict, originals: dict, args, recipe, timings: dict):
    """One loss-gradient pass and one layer walk: every calibration-side statistic and both fits,
    ``(rows by block, fits by (block, kind))``; nothing is installed during the walk."""
    import torch

    from compressor.engine.profiling import block_profile
    from compressor.engine.sensitivity import output_grad_moments
    from compressor.engine.walker import LayerWalker
    from compressor.fitting.kinds import BlockData
    from compressor.policy.compress import FISHER_MAX_WINDOWS
    from compressor.policy.plan import activation, block_weight

    c, m = recipe.calibration, recipe.measure
    with stopwatch(timings, "fisher_s"):
        grads = output_grad_moments(model, cal.fit[:FISHER_MAX_WINDOWS], modules, batch_size=c.batch_size)
    t0 = time.perf_counter()
    walker = LayerWalker(model, {"fit": cal.fit, "heldout": cal.heldout}, batch_size=c.batch_size)
    spec, act = walker.spec, activation(model, walker.spec)
    measured: dict[int, dict] = {}
    fitted: dict[tuple[int, str], object] = {}

    def on_layer(i, st):
        prof, _ = block_profile(st.xy, outlier_share_flag=m.outlier_share_flag)
        weight = block_weight("fisher", st, grads[i])
        data = BlockData(i, originals[i], spec, act, st.xy.fit, st.xy.heldout_total(), st.zfit, st.zheld,
                         output_weight=grads[i])
        kinds, fits = fit_kinds(data, weight, args.kinds, args.prune_keep)
        fitted.update({(i, name): f for name, f in fits.items()})
        measured[i] = {"block": i, "module": modules[i], "r2_lin": prof.r2_lin, "r2_bulk": prof.r2_bulk,
                       "outlier_sst_share": prof.outlier_sst_share, "outlier_dominated": prof.outlier_dominated,
                       "fisher_weight": weight, "kinds": kinds}
        logger.info("block %d: R²_lin %.4f%s, fisher weight %.4g, rel. error %s", i, prof.r2_lin,
                    " (outlier-dominated)" if prof.outlier_dominated else "", weight,
                    {k: round(v["rel_error"], 4) for k, v in kinds.items()})
        return None  # independent fits: nothing is installed during the walk

    walker.walk(on_layer, hidden="prune" in args.kinds, spike_factor=m.spike_factor,
                compute_dtype={"float32": torch.float32, "float64": torch.float64}[m.precision],
                layers=sorted(modules), desc="calibrate")
    del walker
    timings["walk_s"] = time.perf_counter() - t0
    return measured, fitted


DEFINITIONS = {
    "dppl": "ppl_swapped / ppl_original - 1 on the same windows; dppl_se = paired (by window) SE of the "
            "NLL difference × ppl ratio",
    "kl": "mean KL(original ‖ swapped) per scored token, nats (top-k + tail coarsening: a lower bound)",
    "rel_error": "held-out calibration SSE/SST of the replacement's output, from kind.levels: affine = "
                 "1 − R² of the whole-block affine fit on the held-out rows (the same fit and rows as R²_lin); "
                 "prune = the OBS path's held-out relative error at the kept size",
    "fisher_weight": "plan.block_weight('fisher'): Σ_o E[g_o²] Var(y_o), g the loss gradient at the "
                     "FFN output over the first {windows} fit windows",
    "fisher_cost": "fisher_weight × rel_error (the allocate strategy's predicted cost)",
    "spearman": "Pearson correlation of average ranks; ci95 = percentile bootstrap over blocks (1000 resamples)",
}


def result_header(args, recipe, cal, cal_info: dict, overlap: dict, baseline: dict, timings: dict) -> dict:
    """The result before the sweep: the settings, the calibration, the texts, the baselines, the definitions."""
    from compressor.policy.compress import FISHER_MAX_WINDOWS

    definitions = dict(DEFINITIONS, fisher_weight=DEFINITIONS["fisher_weight"].format(windows=FISHER_MAX_WINDOWS))
    return {
        "schema": "compressor.bench_rank/v1",
        "date": utc_now(), "model": MODEL,
        "environment": environment(), "args": vars(args),
        "calibration": {"recipe": str(RECIPE.relative_to(REPO_ROOT)), "settings": recipe.calibration.model_dump(),
                        **cal_info, "fit_windows": int(cal.fit.shape[0]), "heldout_windows": int(cal.heldout.shape[0]),
                        "seq_len": cal.seq_len, "overlap_with_wiki_test": overlap["wiki-test"]},
        "evaluation": {"cal-heldout": {"data": "the held-out calibration windows, one evaluation window each",
                                       "seq_len": cal.seq_len, "stride": cal.seq_len},
                       "wiki-test": {"data": "wikitext-2 test.txt (compressor.inputs.data.evaluation_tokens)",
                                     "seq_len": args.test_seq_len, "stride": args.test_seq_len},
                       "top_k": args.top_k},
        "baseline": {k: v.to_json() for k, v in baseline.items()},
        "definitions": definitions,
        "blocks": [], "timings": timings,
    }


def sweep(model, evaluator, modules: dict, originals: dict, measured: dict, fitted: dict, kinds: list[str],
          result: dict, save) -> None:
    """Each block's replacement alone, measured on both texts, then the original back; saved after every block."""
    baseline, timings, blocks = evaluator.baseline.domains, result["timings"], sorted(modules)
    t0 = time.perf_counter()
    for n, i in enumerate(blocks, 1):
        row = measured[i]
        for name in kinds:
            model.set_submodule(modules[i], fitted[i, name].build(originals[i]))
            try:
                ev = evaluator(model, desc=f"block {i} {name}").domains
            finally:
                model.set_submodule(modules[i], originals[i])
            row["kinds"][name].update({d: _domain(ev[d], baseline[d]) for d in ev})
            r = row["kinds"][name]
            logger.info("(%d/%d) block %2d %-6s cal ΔPPL %+7.2f%% KL %.4f | wiki ΔPPL %+7.2f%% ± %.2f%% KL %.4f",
                        n, len(blocks), i, name, 100 * r["cal-heldout"]["dppl"], r["cal-heldout"]["kl"],
                        100 * r["wiki-test"]["dppl"], 100 * (r["wiki-test"]["dppl_se"] or float("nan")),
                        r["wiki-test"]["kl"])
        result["blocks"].append(row)
        timings["sweep_s"] = time.perf_counter() - t0
        save()
    timings["evaluation_s_mean"] = timings["sweep_s"] / max(1, len(blocks) * len(kinds))


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    log_to_stderr()
    quiet_offline_env()

    import torch

    from compressor.fitting.replace import ffn_path
    from compressor.inputs.calibration import build_calibration
    from compressor.inputs.data import TextSource, check_disjoint, evaluation_tokens

    if args.threads:
        torch.set_num_threads(args.threads)
    calibration = resolve_calibration(ap, args.calibration)
    test_file = wikitext("test.txt")
    if not test_file.is_file():
        logger.error("WikiText-2 test.txt not found under %s", test_file.parent)
        return 1
    recipe = calibration_recipe(calibration, args.cal_tokens)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()

    model, tok, _, timings["load_s"] = load_bench_model(MODEL, dtype=recipe.model.dtype, device=recipe.model.device)
    blocks = chosen_blocks(ap, args.blocks, model.config.num_hidden_layers)
    modules = {i: ffn_path(model, i) for i in blocks}
    originals = {i: model.get_submodule(p) for i, p in modules.items()}
    with stopwatch(timings, "calibration_s"):
        cal, cal_info = build_calibration(recipe, model, tok, use_cache=True)
    test_ids = evaluation_tokens(tok, TextSource(str(test_file)), None, max_tokens=args.test_tokens)
    overlap = check_disjoint(cal, {"wiki-test": test_ids})  # raises if a calibration window is in the test text
    evaluator = teacher(model, cal, test_ids, args, recipe.calibration.batch_size, timings)
    measured, fitted = calibration_statistics(model, cal, modules, originals, args, recipe, timings)

    result = result_header(args, recipe, cal, cal_info, overlap, evaluator.baseline.domains, timings)
    out_path = Path(args.output)
    sweep(model, evaluator, modules, originals, measured, fitted, args.kinds, result,
          save=lambda: write_json(out_path, result))
    summarise(result, args.kinds)
    timings["total_s"] = time.perf_counter() - t_start
    write_json(out_path, result)
    log_summary(result, args.kinds)
    logger.info("wrote %s (%.1f min)", out_path, timings["total_s"] / 60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
