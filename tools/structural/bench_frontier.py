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
+5 % and +20 %). Writes ``tools/structural/results/bench_frontier.json`` and ``.png``.

    python tools/structural/bench_frontier.py --device cuda               # ≈ minutes on one GPU
    python tools/structural/bench_frontier.py --quick                     # CPU smoke run, small sizes
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (MODEL, device_sync, environment, load_bench_model, prefill_decode, quiet_offline_env,
                            stopwatch, utc_now, wikitext, write_json)
from tools.benchlib.cli import log_to_stderr, tool_parser
from tools.structural.bench_frontier_report import best_points, plot, summary

quiet_offline_env()

import torch  # noqa: E402
from torch import nn  # noqa: E402

from compressor.core.params import count_params  # noqa: E402
from compressor.engine.profiling import block_profile  # noqa: E402
from compressor.engine.sensitivity import output_grad_moments  # noqa: E402
from compressor.engine.walker import LayerWalker  # noqa: E402
from compressor.evaluation.perplexity import perplexity  # noqa: E402
from compressor.fitting.kinds import BlockData, get_kind  # noqa: E402
from compressor.fitting.replace import ffn_path  # noqa: E402
from compressor.inputs.data import tokenize_stream  # noqa: E402
from compressor.policy.allocate import BlockCurve, allocate  # noqa: E402
from compressor.policy.plan import activation, block_weight  # noqa: E402
from compressor.recipe.schema import AffineReplacement, HybridReplacement, PruneReplacement  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_frontier")

VARIANTS = {  # series name → (kind, config, allocation)
    "prune/uniform": ("prune", PruneReplacement(), "uniform"),
    "prune/residual": ("prune", PruneReplacement(), "residual"),
    "prune/fisher": ("prune", PruneReplacement(), "fisher"),
    "prune/fisher/loss-selection": ("prune", PruneReplacement(selection="loss"), "fisher"),
    "hybrid/uniform": ("hybrid", HybridReplacement(), "uniform"),
    "hybrid/fisher": ("hybrid", HybridReplacement(), "fisher"),
    "hybrid/fisher/loss-selection": ("hybrid", HybridReplacement(selection="loss"), "fisher"),
}


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


def parse_args():
    ap = tool_parser(__doc__)
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
    if args.quick:
        args.cal_tokens, args.eval_tokens, args.keeps, args.teacher_keeps = [4096], 1024, [0.8], [0.8]
        args.teacher_variants = ["prune/fisher"]
    return args


class Frontier:
    """The model with swappable FFNs, the test windows, its baseline, and the result written after each point."""

    def __init__(self, model, test_ids, args) -> None:
        self.model, self.test_ids, self.device = model, test_ids, args.device
        self.n_blocks = model.config.num_hidden_layers
        self.modules = {i: ffn_path(model, i) for i in range(self.n_blocks)}
        self.originals = {i: model.get_submodule(self.modules[i]) for i in range(self.n_blocks)}
        self.ffn_params = {i: count_params(self.originals[i]) for i in range(self.n_blocks)}
        self.ffn_total, self.model_total = sum(self.ffn_params.values()), count_params(model)
        self.path = Path(args.output)
        self.out = {"schema": "compressor.bench_frontier/v1", "date": utc_now("auto"),
                    "environment": environment(), "device": args.device, "args": vars(args),
                    "eval": {"data": "wikitext-2 test.txt", "tokens": int(test_ids.numel()), "window": 512,
                             "stride": 512},
                    "ffn_params_total": self.ffn_total, "model_params": self.model_total}
        if args.device.startswith("cuda"):
            self.out["gpu"] = torch.cuda.get_device_name()
        self.base = self.out["baseline_ppl"] = self.ppl()
        logger.info("baseline perplexity %.4f on %d test tokens", self.base, test_ids.numel())
        self.out["runs"] = []

    def restore(self) -> None:
        for i, m in self.originals.items():
            self.model.set_submodule(self.modules[i], m)

    def install(self, installs: dict[int, nn.Module]) -> None:
        """The originals back, then ``installs`` (block → module) in their place."""
        self.restore()
        for i, mod in installs.items():
            self.model.set_submodule(self.modules[i], mod)

    def ppl(self) -> float:
        return perplexity(self.model, self.test_ids, seq_len=512, stride=512, batch_size=16, desc="eval").ppl

    def save(self) -> None:
        write_json(self.path, self.out)

    def point(self, run: dict, series: str, installs: dict[int, nn.Module], extra: dict) -> None:
        """Measure the model with ``installs`` in place: one point of ``series``, saved at once."""
        self.install(installs)
        p = self.ppl()
        removed = self.ffn_total - sum(count_params(self.model.get_submodule(self.modules[i]))
                                       for i in range(self.n_blocks))
        rec = {"ffn_removed": removed / self.ffn_total, "model_removed": removed / self.model_total, "ppl": p,
               "rel_ppl": p / self.base - 1, "blocks": len(installs), **extra}
        run["series"].setdefault(series, []).append(rec)
        logger.info("%-34s removed %5.1f%% FFN  ppl %.3f (%+.1f%%)", series, 100 * rec["ffn_removed"], p,
                    100 * rec["rel_ppl"])
        self.save()


@dataclass
class Calibrated:
    """One calibration size: its run record, the walker (teacher targets walk again) and what pass A measured."""

    run: dict
    walker: LayerWalker
    spec: object
    act: object
    grads: dict
    data: dict[int, BlockData] = field(default_factory=dict)
    weights: dict[str, dict[int, float]] = field(default_factory=lambda: {"residual": {}, "fisher": {}, "uniform": {}})
    flagged: set[int] = field(default_factory=set)

    def block_data(self, fr: Frontier, i: int, st) -> BlockData:
        return BlockData(i, fr.originals[i], self.spec, self.act, st.xy.fit, st.xy.heldout_total(), st.zfit, st.zheld,
                         output_weight=self.grads[i])

    def kept_params(self, fr: Frontier, keep: float) -> int:
        """The parameter target of the allocation: the outlier-dominated blocks stay original and count as kept."""
        return int(keep * fr.ffn_total) - sum(fr.ffn_params[i] for i in self.flagged)


def calibration_windows(tok, valid_docs: list[str], n_cal: int):
    """``n_cal`` tokens of WikiText-2 valid in windows of 128, and a seeded 7:1 split into fit and held-out."""
    stream = tokenize_stream(tok, valid_docs, n_cal)
    n_win = stream.numel() // 128
    windows = stream[: n_win * 128].view(n_win, 128)
    perm = torch.randperm(n_win, generator=torch.Generator().manual_seed(0))
    n_held = max(1, n_win // 8)
    return windows, windows[perm[n_held:]], windows[perm[:n_held]]


def calibrate(fr: Frontier, tok, valid_docs: list[str], n_cal: int, batch_size: int) -> Calibrated:
    """Pass A for one calibration size, timed against one plain forward over the same windows."""
    model, sync = fr.model, device_sync(fr.device)
    windows, fit_w, held_w = calibration_windows(tok, valid_docs, n_cal)
    run = {"cal_tokens": int(windows.shape[0] * 128), "series": {}}
    fr.out["runs"].append(run)
    # one plain forward over the calibration windows, for the cost ratio
    with stopwatch(run, "plain_forward_s", sync), torch.no_grad():
        for s in range(0, windows.shape[0], batch_size):
            model(input_ids=windows[s:s + batch_size].to(fr.device), use_cache=False)
    with stopwatch(run, "fisher_s", sync):
        grads = output_grad_moments(model, fit_w[:128], fr.modules, batch_size=batch_size)
    with stopwatch(run, "pass_a_s", sync):
        walker = LayerWalker(model, {"fit": fit_w, "heldout": held_w}, batch_size=batch_size)
        cp = Calibrated(run, walker, walker.spec, activation(model, walker.spec), grads)

        def on_layer(i, st):
            for mode in cp.weights:
                cp.weights[mode][i] = block_weight(mode, st, grads[i])
            if block_profile(st.xy)[0].outlier_dominated:
                cp.flagged.add(i)
            cp.data[i] = cp.block_data(fr, i, st)
            return None

        walker.walk(on_layer, hidden=True)
    run["outlier_dominated"] = sorted(cp.flagged)
    return cp


def obs_curves(fr: Frontier, cp: Calibrated, variants: dict) -> dict[str, list[BlockCurve]]:
    """Each variant's cost curve per block (the outlier-dominated blocks left out: they stay original)."""
    run = cp.run
    with stopwatch(run, "obs_paths_s"):
        curves = {name: [BlockCurve(i, fr.ffn_params[i], get_kind(kname).levels(cp.data[i], cfg), cp.weights[mode][i])
                         for i in range(fr.n_blocks) if i not in cp.flagged]
                  for name, (kname, cfg, mode) in variants.items()}
    run["weights"] = cp.weights
    logger.info("cal %d: plain forward %.1fs, fisher pass %.1fs, pass A %.1fs, OBS paths (%d variants) %.1fs",
                run["cal_tokens"], run["plain_forward_s"], run["fisher_s"], run["pass_a_s"], len(variants),
                run["obs_paths_s"])
    return curves


def whole_block_series(fr: Frontier, cp: Calibrated) -> None:
    """Whole-block affine and drop, cheapest first by predicted (fisher) cost, outlier blocks protected."""
    affine, acfg = get_kind("affine"), AffineReplacement()
    aff_err = {i: affine.levels(cp.data[i], acfg)[0].heldout_rel_error for i in range(fr.n_blocks)}
    fisher = cp.weights["fisher"]
    safe = [i for i in range(fr.n_blocks) if i not in cp.flagged]
    for series, cost, make in (
        ("affine", lambda i: fisher[i] * aff_err[i], lambda i: affine.fit(cp.data[i], acfg).build(fr.originals[i])),
        ("drop", lambda i: fisher[i], lambda i: ZeroFFN()),
    ):
        order = sorted(safe, key=cost)
        for n in (1, 2, 4, 6, 8):
            fr.point(cp.run, series, {i: make(i) for i in order[:n]}, {"order": order[:n]})


def allocated(fr: Frontier, cp: Calibrated, curve: list[BlockCurve], mode: str, keep: float) -> dict:
    """The allocation's choice at ``keep``: block → level, the blocks left whole left out."""
    choice = allocate(curve, cp.kept_params(fr, keep), mode)
    return {i: lv for i, lv in choice.items() if lv is not None}


def allocated_series(fr: Frontier, cp: Calibrated, variants: dict, curves: dict, keeps: list[float]) -> None:
    """Each variant at each keep target, independent fits (target ``none``)."""
    for name, (kname, cfg, mode) in variants.items():
        k = get_kind(kname)
        for keep in keeps:
            choice = allocated(fr, cp, curves[name], mode, keep)
            installs = {i: k.fit(cp.data[i], cfg, lv.size).build(fr.originals[i]) for i, lv in choice.items()}
            fr.point(cp.run, f"{name}/none", installs,
                     {"keep_target": keep, "units": {i: lv.size for i, lv in choice.items()}})


def teacher_series(fr: Frontier, cp: Calibrated, variants: dict, curves: dict, args) -> None:
    """Teacher targets: a second walk per point, fitting on the student stream."""
    for vname in args.teacher_variants:
        kname, cfg0, mode = variants[vname]
        k = get_kind(kname)
        for target in args.targets:
            cfg = cfg0.model_copy(update={"target": target})
            for keep in args.teacher_keeps:
                fr.restore()
                choice = allocated(fr, cp, curves[vname], mode, keep)
                installs = {}

                def fit_layer(i, st):
                    lv = choice.get(i)
                    if lv is None:
                        return None
                    installs[i] = k.fit(cp.block_data(fr, i, st), cfg, lv.size).build(fr.originals[i])
                    return installs[i]

                timing = {}
                with stopwatch(timing, "pass_b_s"):
                    cp.walker.walk(fit_layer, hidden=True, target=target, layers=list(choice))
                fr.point(cp.run, f"{vname}/{target}", installs, {"keep_target": keep, **timing})


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


def deploy(fr: Frontier, cp: Calibrated, variants: dict, curves: dict) -> dict:
    """What the user gets from the variant with the most removed within +5 %: parameters, bfloat16 bytes,
    prefill and decode speed, of the original and of its best points within +5 % and +20 %."""
    run, model = cp.run, fr.model
    name = max(variants, key=lambda n: best_points(run).get(f"{n}/none", {}).get("+5%", 0))
    kname, cfg, mode = variants[name]
    k = get_kind(kname)
    fr.restore()
    res = {"original": {"params": count_params(model), "bf16_bytes": bf16_bytes(model), **speed(model, fr.device)}}
    for lim in (0.05, 0.20):
        ok = [p for p in run["series"][f"{name}/none"] if p["rel_ppl"] <= lim]
        if not ok:
            continue
        best = max(ok, key=lambda p: p["ffn_removed"])
        choice = allocated(fr, cp, curves[name], mode, best["keep_target"])
        fr.install({i: k.fit(cp.data[i], cfg, lv.size).build(fr.originals[i]) for i, lv in choice.items()})
        res[f"+{int(lim * 100)}%"] = {"keep_target": best["keep_target"], "ffn_removed": best["ffn_removed"],
                                      "rel_ppl": best["rel_ppl"], "params": count_params(model),
                                      "bf16_bytes": bf16_bytes(model), **speed(model, fr.device)}
    fr.restore()
    res["variant"] = name
    return res


def main() -> int:
    args = parse_args()
    log_to_stderr("%(asctime)s %(message)s")
    model, tok, _, _ = load_bench_model(MODEL, device=args.device)
    model.requires_grad_(False)
    valid_docs, test_docs = read_docs(wikitext("valid.txt")), read_docs(wikitext("test.txt"))
    fr = Frontier(model, tokenize_stream(tok, test_docs, args.eval_tokens), args)
    for n_cal in args.cal_tokens:
        cp = calibrate(fr, tok, valid_docs, n_cal, args.batch_size)
        largest = n_cal == max(args.cal_tokens)
        wanted = args.variants if largest else (args.small_variants or args.variants)
        variants = {k: v for k, v in VARIANTS.items() if not wanted or k in wanted}
        curves = obs_curves(fr, cp, variants)
        whole_block_series(fr, cp)
        allocated_series(fr, cp, variants, curves, args.keeps)
        if largest:
            teacher_series(fr, cp, variants, curves, args)
            fr.out["deploy"] = deploy(fr, cp, variants, curves)
            fr.save()
        del cp
        fr.restore()
    plot(fr.out, fr.path.with_suffix(".png"))
    fr.save()
    print(json.dumps(summary(fr.out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
