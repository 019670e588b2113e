#!/usr/bin/env python
"""Does a 2-rank data-parallel run equal a 1-process run? SmolLM2-135M, CPU, gloo.

Runs one recipe (calibration on WikiText-2 ``valid.txt``, the greedy gate) twice:
as one process, and under ``torchrun --nproc-per-node 2`` (gloo), every process
on one intra-op thread. Each process records the reduced statistics of every
layer (the walker's output, before any fit); the driver compares them (max
relative difference and sha256), the decisions each rank took itself, and the
sha256 of the written ``model.safetensors``; wall times and their ratio.

    python tools/distributed/bench_distributed.py   # → tools/distributed/results/bench_distributed.json (≈ 10 min, 2-core CPU)

Worker mode (``--worker``) is what the driver launches; it is not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import MODEL, environment, quiet_offline_env, utc_now, wikitext, write_json
from tools.benchlib.runs import launch_ranks

quiet_offline_env()

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OUTPUT = RESULTS_DIR / "bench_distributed.json"


def recipe(out: Path, cal_tokens: int, eval_tokens: int) -> dict:
    valid = str(wikitext("valid.txt"))
    return {
        "model": {"source": MODEL},
        "calibration": {"dataset": valid, "seq_len": 128, "max_tokens": cal_tokens, "batch_size": 8},
        "evaluation": {"dataset": valid, "seq_len": 256, "stride": 256, "max_tokens": eval_tokens,
                       "min_tokens": min(1024, eval_tokens)},
        # a bounded gate: a few single-block evaluations, then stop
        "policy": {"threshold": 0.5, "ppl_budget": 0.05, "max_blocks": 2, "patience": 2},
        "measure": {"cache": False},
        "output": {"path": str(out)},
    }


def worker(args) -> int:
    """One process of a run: record every layer's reduced statistics, run the recipe, dump what it decided."""
    import torch

    torch.set_num_threads(1)
    import compressor
    from compressor.policy import compress
    from compressor.core import distributed
    from compressor.engine.walker import LayerWalker

    distributed.init_from_env("cpu")
    rank = distributed.rank()
    stats_dir = Path(args.stats_dir)
    digests: dict[str, str] = {}

    class RecordingWalker(LayerWalker):
        """The engine's walker, also keeping the first pass's statistics (the ones every decision rests on)."""

        def _layer_stats(self, i, *a, **kw):
            out = super()._layer_stats(i, *a, **kw)
            if f"layer{i}" not in digests:
                sd = out["stats"].xy.state_dict()
                sd[f"block{i}.resid_energy"] = torch.tensor([out["stats"].resid_energy], dtype=torch.float64)
                digests[f"layer{i}"] = hashlib.sha256(b"".join(
                    sd[k].contiguous().view(torch.uint8).numpy().tobytes() for k in sorted(sd))).hexdigest()
                if rank == 0:
                    torch.save(sd, stats_dir / f"layer{i}.pt")
            return out

    # The benchmark's one intrusion: the pass-A walker records what it reduced.
    compress.LayerWalker = RecordingWalker
    rec = compressor.recipe_from_dict(json.loads(args.recipe))
    t0 = time.perf_counter()
    res = compressor.run(rec)
    run_s = time.perf_counter() - t0
    dump = {"compressor": compressor.__file__, "rank": rank, "world_size": distributed.world_size(),
            "exit_code": res.exit_code, "run_s": run_s, "decisions": res.result.decisions_json(), "final_ppl": res.result.final.ppl,
            "baseline_ppl": res.result.baseline.ppl, "stats_sha256": digests, "timings": res.result.timings}
    (stats_dir / f"rank{rank}.json").write_text(json.dumps(dump, indent=2))
    return 0


def launch(world: int, rec: dict, stats_dir: Path) -> tuple[float, float]:
    script = [str(Path(__file__).resolve()), "--worker", "--recipe", json.dumps(rec), "--stats-dir", str(stats_dir)]
    return launch_ranks(script, world, 1)


def max_relative_diff(a: dict, b: dict) -> float:
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        scale = float(y.abs().max()) or 1.0
        worst = max(worst, float((x - y).abs().max()) / scale)
    return worst


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--stats-dir", help=argparse.SUPPRESS)
    ap.add_argument("--cal-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--output", default=str(OUTPUT))
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    try:
        runs = {}
        for world in (1, args.world):
            d = work / f"w{world}"
            d.mkdir()
            rec = recipe(d / "out", args.cal_tokens, args.eval_tokens)
            wall, load = launch(world, rec, d)
            ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(world)]
            runs[world] = {"dir": d, "wall_s": wall, "load_avg_5min": load, "ranks": ranks,
                           "model_sha256": hashlib.sha256((d / "out" / "model.safetensors").read_bytes()).hexdigest()}
            print(f"{world} process(es): {wall:.1f} s wall", flush=True)
        one, many = runs[1], runs[args.world]
        layers = sorted((p.name for p in one["dir"].glob("layer*.pt")), key=lambda n: int(n[5:-3]))
        rel = max(max_relative_diff(torch.load(one["dir"] / n), torch.load(many["dir"] / n)) for n in layers)
        ref = one["ranks"][0]
        summary = {
            "schema": "compressor.bench_distributed/v1",
            "date": utc_now(),
            "environment": environment(),
            "model": MODEL,
            "recipe": recipe(Path("<out>"), args.cal_tokens, args.eval_tokens),
            "world_size": args.world,
            "backend": "gloo",
            "threads_per_process": 1,
            "layers_compared": len(layers),
            "stats_max_relative_diff": rel,
            "stats_sha256_equal": all(r["stats_sha256"] == ref["stats_sha256"] for r in many["ranks"]),
            "decisions_equal": all(r["decisions"] == ref["decisions"] for r in many["ranks"]),
            "exit_codes": {"1": ref["exit_code"], str(args.world): [r["exit_code"] for r in many["ranks"]]},
            "blocks_kept": [d["index"] for d in ref["decisions"] if d["decision"] == "kept"],
            "baseline_ppl": ref["baseline_ppl"],
            "final_ppl": {"1": ref["final_ppl"], str(args.world): [r["final_ppl"] for r in many["ranks"]]},
            "model_sha256": {"1": one["model_sha256"], str(args.world): many["model_sha256"]},
            "checkpoint_identical": one["model_sha256"] == many["model_sha256"],
            "wall_s": {"1": one["wall_s"], str(args.world): many["wall_s"]},
            "run_s": {"1": ref["run_s"], str(args.world): [r["run_s"] for r in many["ranks"]]},
            "stage_s": {"1": ref["timings"], str(args.world): many["ranks"][0]["timings"]},
            "wall_ratio": many["wall_s"] / one["wall_s"],
            "load_avg_5min_after": {"1": one["load_avg_5min"], str(args.world): many["load_avg_5min"]},
            "run_ratio": many["ranks"][0]["run_s"] / ref["run_s"],
        }
        write_json(args.output, summary)
        print(json.dumps({k: summary[k] for k in ("stats_max_relative_diff", "stats_sha256_equal", "decisions_equal",
                                                   "checkpoint_identical", "wall_s", "wall_ratio", "run_ratio")},
                         indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
