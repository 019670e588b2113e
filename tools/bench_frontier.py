#!/usr/bin/env python
"""The compression frontier on SmolLM2-135M: perplexity against FFN parameters removed.

Calibrate on WikiText-2 ``valid.txt`` (one layer-sequential pass per
calibration size), evaluate on ``test.txt`` (non-overlapping 512-token
windows; never seen by calibration, sensitivities or allocation). Series:

* ``affine``: whole-block affine swaps (round 1), blocks added cheapest first;
* ``drop``: whole FFNs removed (ShortGPT-style no-op), cheapest first;
* ``prune`` / ``hybrid`` with sensitivity allocation and with a uniform keep
  fraction, target ``none`` (independent fits);
* ``hybrid`` with the teacher targets (``teacher_output``, ``teacher_residual``);

plus the cost of compressing (pass A against one plain forward over the
calibration tokens) and what a user gets (parameters, safetensors bytes,
prefill and greedy-decode speed of the saved model at the best points within
+5 % and +20 %). Writes ``tools/results/bench_frontier.json`` and ``.png``.

    python tools/bench_frontier.py --device cuda               # ≈ minutes on one GPU
    python tools/bench_frontier.py --quick                     # CPU smoke run, small sizes
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (MODEL, RESULTS_DIR, device_sync, environment, load_bench_model, prefill_decode, quiet_offline_env,
                      stopwatch, utc_now, wikitext, write_json)
from bench_frontier_report import best_points, plot

quiet_offline_env()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from compressor.core.params import count_params  # noqa: E402
from compressor.engine.profiling import block_profile  # noqa: E402
from compressor.engine.sensitivity import output_grad_moments  # noqa: E402
from compressor.engine.walker import LayerWalker  # noqa: E402
from compressor.evaluation.evaluate import perplexity  # noqa: E402
from compressor.fitting.kinds import BlockData, get_kind  # noqa: E402
from compressor.fitting.replace import ffn_path  # noqa: E402
from compressor.inputs.data import tokenize_stream  # noqa: E402
from compressor.policy.allocate import BlockCurve, allocate  # noqa: E402
from compressor.policy.plan import activation, block_weight  # noqa: E402
from compressor.recipe.schema import AffineReplacement, HybridReplacement, PruneReplacement  # noqa: E402

logger = logging.getLogger("bench_frontier")


class ZeroFFN(nn.Module):
    """The FFN dropped: adds nothing to the residual stream (ShortGPT-style)."""

    def forward(self, x, *args, **kwargs):
        return torch.zeros_like(x)


def read_docs(path: Path) -> list[str]:
    """WikiText-2 articles: split at top-level ' = Title = ' headings."""
    docs, cur = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(" = ") and not line.startswith(" = = ") and cur:
            docs.append("\n".join(cur))
            cur = []
        cur.append(line)
    if cur:
        docs.append("\n".join(cur))
    return [d for d in docs if d.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cal-tokens", type=int, nargs="+", default=[16384, 65536, 131072, 245760])
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.5])
    ap.add_argument("--teacher-keeps", type=float, nargs="+", default=[0.85, 0.75, 0.65])
    ap.add_argument("--teacher-variants", nargs="+", default=["prune/fisher", "hybrid/fisher"])
    ap.add_argument("--targets", nargs="+", default=["teacher_output", "teacher_residual"])
    ap.add_argument("--variants", nargs="+", default=None, help="series to run (default: all)")
    ap.add_argument("--small-variants", nargs="+", default=None,
                    help="series for calibration sizes below the largest (default: --variants)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for a CPU smoke run")
    ap.add_argument("--output", default=str(RESULTS_DIR / "bench_frontier.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if args.quick:
        args.cal_tokens, args.eval_tokens, args.keeps, args.teacher_keeps = [4096], 1024, [0.8], [0.8]
        args.teacher_variants = ["prune/fisher"]
    device, sync = args.device, device_sync(args.device)
    model, tok, _, _ = load_bench_model(MODEL, device=device)
    model.requires_grad_(False)
    valid_docs, test_docs = read_docs(wikitext("valid.txt")), read_docs(wikitext("test.txt"))
    test_ids = tokenize_stream(tok, test_docs, args.eval_tokens)
    n_blocks = model.config.num_hidden_layers
    modules = {i: ffn_path(model, i) for i in range(n_blocks)}
    originals = {i: model.get_submodule(modules[i]) for i in range(n_blocks)}
    ffn_params = {i: count_params(originals[i]) for i in range(n_blocks)}
    ffn_total, model_total = sum(ffn_params.values()), count_params(model)

    def restore():
        for i, m in originals.items():
            model.set_submodule(modules[i], m)

    def ppl() -> float:
        return perplexity(model, test_ids, seq_len=512, stride=512, batch_size=16, desc="eval").ppl

    out = {"schema": "compressor.bench_frontier/v1", "date": utc_now("auto"),
           "environment": environment(), "device": device, "args": vars(args),
           "eval": {"data": "wikitext-2 test.txt", "tokens": int(test_ids.numel()), "window": 512, "stride": 512},
           "ffn_params_total": ffn_total, "model_params": model_total}
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    base = ppl()
    out["baseline_ppl"] = base
    logger.info("baseline perplexity %.4f on %d test tokens", base, test_ids.numel())
    out["runs"] = []
    path = Path(args.output)

    def save():
        write_json(path, out)

    for n_cal in args.cal_tokens:
        stream = tokenize_stream(tok, valid_docs, n_cal)
        n_win = stream.numel() // 128
        windows = stream[: n_win * 128].view(n_win, 128)
        g = torch.Generator().manual_seed(0)
        perm = torch.randperm(n_win, generator=g)
        n_held = max(1, n_win // 8)
        fit_w, held_w = windows[perm[n_held:]], windows[perm[:n_held]]
        run = {"cal_tokens": int(n_win * 128), "series": {}}
        out["runs"].append(run)
        # one plain forward over the calibration windows, for the cost ratio
        with stopwatch(run, "plain_forward_s", sync), torch.no_grad():
            for s in range(0, n_win, args.batch_size):
                model(input_ids=windows[s:s + args.batch_size].to(device), use_cache=False)
        with stopwatch(run, "fisher_s", sync):
            grads = output_grad_moments(model, fit_w[:128], modules, batch_size=args.batch_size)
        t0 = time.perf_counter()
        walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w}, batch_size=args.batch_size)
        spec, act = walker.spec, activation(model, walker.spec)
        data: dict[int, BlockData] = {}
        weights: dict[str, dict[int, float]] = {"residual": {}, "fisher": {}, "uniform": {}}
        flagged: set[int] = set()

        def on_layer(i, st):
            for mode in weights:
                weights[mode][i] = block_weight(mode, st, grads[i])
            if block_profile(st.xy)[0].outlier_dominated:
                flagged.add(i)
            data[i] = BlockData(i, originals[i], spec, act, st.xy.fit, st.xy.heldout_total(), st.zfit, st.zheld,
                                output_weight=grads[i])
            return None

        walker.walk(on_layer, hidden=True)
        sync(); run["pass_a_s"] = time.perf_counter() - t0
        run["outlier_dominated"] = sorted(flagged)
        variants = {  # series name → (kind, config, allocation)
            "prune/uniform": ("prune", PruneReplacement(), "uniform"),
            "prune/residual": ("prune", PruneReplacement(), "residual"),
            "prune/fisher": ("prune", PruneReplacement(), "fisher"),
            "prune/fisher/loss-selection": ("prune", PruneReplacement(selection="loss"), "fisher"),
            "hybrid/uniform": ("hybrid", HybridReplacement(), "uniform"),
            "hybrid/fisher": ("hybrid", HybridReplacement(), "fisher"),
            "hybrid/fisher/loss-selection": ("hybrid", HybridReplacement(selection="loss"), "fisher"),
        }
        wanted = args.variants if n_cal == max(args.cal_tokens) else (args.small_variants or args.variants)
        if wanted:
            variants = {k: v for k, v in variants.items() if k in wanted}
        # the outlier-dominated blocks stay original: the target counts them as kept
        flagged_params = sum(ffn_params[i] for i in flagged)
        with stopwatch(run, "obs_paths_s"):
            curves = {name: [BlockCurve(i, ffn_params[i], get_kind(kname).levels(data[i], cfg), weights[mode][i])
                             for i in range(n_blocks) if i not in flagged]
                      for name, (kname, cfg, mode) in variants.items()}
        run["weights"] = weights
        logger.info("cal %d: plain forward %.1fs, fisher pass %.1fs, pass A %.1fs, OBS paths (%d variants) %.1fs",
                    run["cal_tokens"], run["plain_forward_s"], run["fisher_s"], run["pass_a_s"], len(variants),
                    run["obs_paths_s"])

        def point(series: str, installs: dict[int, nn.Module], extra: dict) -> None:
            restore()
            for i, mod in installs.items():
                model.set_submodule(modules[i], mod)
            p = ppl()
            removed = ffn_total - sum(count_params(model.get_submodule(modules[i])) for i in range(n_blocks))
            rec = {"ffn_removed": removed / ffn_total, "model_removed": removed / model_total, "ppl": p,
                   "rel_ppl": p / base - 1, "blocks": len(installs), **extra}
            run["series"].setdefault(series, []).append(rec)
            logger.info("%-34s removed %5.1f%% FFN  ppl %.3f (%+.1f%%)", series, 100 * rec["ffn_removed"], p,
                        100 * rec["rel_ppl"])
            save()

        # whole-block affine and drop, cheapest first by predicted (fisher) cost, outlier blocks protected
        affine, acfg = get_kind("affine"), AffineReplacement()
        aff_err = {i: affine.levels(data[i], acfg)[0].heldout_rel_error for i in range(n_blocks)}
        safe = [i for i in range(n_blocks) if i not in flagged]
        for series, cost, make in (
            ("affine", lambda i: weights["fisher"][i] * aff_err[i], lambda i: affine.fit(data[i], acfg).build(originals[i])),
            ("drop", lambda i: weights["fisher"][i], lambda i: ZeroFFN()),
        ):
            order = sorted(safe, key=cost)
            for n in (1, 2, 4, 6, 8):
                point(series, {i: make(i) for i in order[:n]}, {"order": order[:n]})
        for name, (kname, cfg, mode) in variants.items():
            k = get_kind(kname)
            for keep in args.keeps:
                choice = allocate(curves[name], int(keep * ffn_total) - flagged_params, mode)
                installs = {i: k.fit(data[i], cfg, lv.size).build(originals[i])
                            for i, lv in choice.items() if lv is not None}
                point(f"{name}/none", installs,
                      {"keep_target": keep, "units": {i: lv.size for i, lv in choice.items() if lv is not None}})
        # teacher targets: a second walk per point, fitting on the student stream
        if n_cal == max(args.cal_tokens):
            for vname in args.teacher_variants:
                kname, cfg0, mode = variants[vname]
                k = get_kind(kname)
                for target in args.targets:
                    cfg = cfg0.model_copy(update={"target": target})
                    for keep in args.teacher_keeps:
                        restore()
                        choice = allocate(curves[vname], int(keep * ffn_total) - flagged_params, mode)
                        installs = {}

                        def fit_layer(i, st):
                            lv = choice.get(i)
                            if lv is None:
                                return None
                            bd = BlockData(i, originals[i], spec, act, st.xy.fit, st.xy.heldout_total(), st.zfit,
                                           st.zheld, output_weight=grads[i])
                            installs[i] = k.fit(bd, cfg, lv.size).build(originals[i])
                            return installs[i]

                        t0 = time.perf_counter()
                        walker.walk(fit_layer, hidden=True, target=target,
                                    layers=[i for i, lv in choice.items() if lv is not None])
                        point(f"{vname}/{target}", installs, {"keep_target": keep, "pass_b_s": time.perf_counter() - t0})
            # what the user gets: best points within +5 % and +20 %
            best_name = max(variants, key=lambda n: best_points(run).get(f"{n}/none", {}).get("+5%", 0))
            kname, cfg, mode = variants[best_name]
            out["deploy"] = deploy(model, tok, restore, modules, originals, curves[best_name], (get_kind(kname), cfg, mode),
                                   data, ffn_total, flagged_params, run["series"][f"{best_name}/none"], device)
            out["deploy"]["variant"] = best_name
            save()
        del data, walker
        restore()
    plot(out, path.with_suffix(".png"))
    save()
    print(json.dumps({"baseline_ppl": base, "runs": [{"cal_tokens": r["cal_tokens"], "best": best_points(r)} for r in out["runs"]]}, indent=1))
    return 0


def speed(model, device) -> dict:
    """Prefill of 1×512 tokens (mean of 5 after a warm-up) and greedy decoding of 64 tokens."""
    ids = torch.randint(100, 1000, (1, 512), generator=torch.Generator().manual_seed(0)).to(device)
    prefill, decode = prefill_decode(model, ids, 5, stat="mean", device=device)
    return {"prefill_512_s": prefill, "decode_tok_s": decode}


def bf16_bytes(model) -> int:
    """Size of the model's state dict as one bfloat16 safetensors file."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory() as d:
        save_file({n: t.detach().to(torch.bfloat16).cpu().contiguous() for n, t in model.state_dict().items()},
                  f"{d}/m.safetensors")
        return Path(f"{d}/m.safetensors").stat().st_size


def deploy(model, tok, restore, modules, originals, curves, kind_cfg, data, ffn_total, flagged_params, points,
           device) -> dict:
    k, cfg, mode = kind_cfg
    res = {}
    restore()
    res["original"] = {"params": count_params(model), "bf16_bytes": bf16_bytes(model), **speed(model, device)}
    for lim in (0.05, 0.20):
        ok = [p for p in points if p["rel_ppl"] <= lim]
        if not ok:
            continue
        best = max(ok, key=lambda p: p["ffn_removed"])
        restore()
        choice = allocate(curves, int(best["keep_target"] * ffn_total) - flagged_params, mode)
        for i, lv in choice.items():
            if lv is not None:
                model.set_submodule(modules[i], k.fit(data[i], cfg, lv.size).build(originals[i]))
        res[f"+{int(lim * 100)}%"] = {"keep_target": best["keep_target"], "ffn_removed": best["ffn_removed"],
                                      "rel_ppl": best["rel_ppl"], "params": count_params(model),
                                      "bf16_bytes": bf16_bytes(model), **speed(model, device)}
    restore()
    return res


if __name__ == "__main__":
    sys.exit(main())
