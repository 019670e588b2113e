#!/usr/bin/env python
"""A size plan under torchrun: does it write one process's file, and how much do its shared parts save?

Plans SmolLM2-135M to Q4_K_M's size (GGUF, calibration on WikiText-2 ``valid.txt``) three ways, one after
another, each alone on the machine:

* ``1x1``: one process on one intra-op thread — the reference the ranks must equal bit for bit;
* ``2x1``: ``torchrun --nproc-per-node 2`` (gloo), one thread each: statistics split by batches, pricing and
  the chosen plan's rounding split by tensor (``size_plan.ranks`` in the report says who did what);
* ``1x2``: one process on two threads — what a user of this 2-core machine runs without torchrun (its file may
  differ in bits: a matrix product's rounding depends on the thread count).

Records each run's wall time, the size plan's part timings (statistics, pricing, rounding on rank 0), the work
each rank did, and the sha256 of the planned file.

    python tools/size/offgrid.py <SmolLM2 Q4_1 GGUF> /tmp/offgrid-smollm2
    python tools/distributed/bench_size_ranks.py --source /tmp/offgrid-smollm2 --cal-tokens 8192 \
        --output tools/distributed/results/size_ranks_offgrid_smollm2.json     # ≈ 8 min, 2-core CPU

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
OUTPUT = RESULTS_DIR / "size_ranks_smollm2.json"
RUNS = {"1x1": (1, 1), "2x1": (2, 1), "1x2": (1, 2)}
"""Run name → (processes, intra-op threads each)."""


def recipe(out: Path, cal_tokens: int, eval_tokens: int, size: str, source: str = MODEL) -> dict:
    valid = str(wikitext("valid.txt"))
    return {
        "model": {"source": source},
        "calibration": {"dataset": valid, "seq_len": 512, "max_tokens": cal_tokens, "batch_size": 4},
        "evaluation": {"dataset": valid, "seq_len": 512, "stride": 512, "max_tokens": eval_tokens,
                       "min_tokens": min(1024, eval_tokens)},
        "policy": {"ppl_budget": 0.5},
        "measure": {"cache": False},
        "output": {"path": str(out), "size": size},
    }


def _offgrid(source: str) -> dict | None:
    """What ``tools/size/offgrid.py`` recorded of an off-grid source folder (None: another source)."""
    record = Path(source) / "offgrid.json"
    return json.loads(record.read_text()) if record.is_file() else None


def worker(args) -> int:
    """One process of a run: the recipe, then what it reported."""
    import torch

    torch.set_num_threads(args.threads)
    import compressor
    from compressor.core import distributed

    distributed.init_from_env("cpu")
    t0 = time.perf_counter()
    res = compressor.run(compressor.recipe_from_dict(json.loads(args.recipe)))
    run_s = time.perf_counter() - t0
    plan = res.report.get("size_plan") or {}
    dump = {"rank": distributed.rank(), "world_size": distributed.world_size(), "exit_code": res.exit_code,
            "run_s": run_s, "size_timings": plan.get("timings"), "ranks": plan.get("ranks"),
            "compensated_tensors": plan.get("compensated_tensors"), "tensor_bytes": plan.get("tensor_bytes"),
            "timings": res.report.get("timings")}
    (Path(args.stats_dir) / f"rank{distributed.rank()}.json").write_text(json.dumps(dump, indent=2))
    return 0


def launch(processes: int, threads: int, rec: dict, stats_dir: Path) -> tuple[float, float]:
    script = [str(Path(__file__).resolve()), "--worker", "--recipe", json.dumps(rec), "--stats-dir", str(stats_dir),
              "--threads", str(threads)]
    return launch_ranks(script, processes, threads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--recipe", help=argparse.SUPPRESS)
    ap.add_argument("--stats-dir", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cal-tokens", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--size", default="Q4_K_M")
    ap.add_argument("--source", default=MODEL, help="the model planned (default: SmolLM2-135M's GGUF; an off-grid "
                    "folder from tools/size/offgrid.py makes the plan choose GPTQ, whose rounding is then shared too)")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--output", default=str(OUTPUT))
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    work = Path(tempfile.mkdtemp(prefix="bench-size-ranks-"))
    try:
        runs = {}
        for name in args.runs:
            processes, threads = RUNS[name]
            d = work / name
            d.mkdir()
            wall, load = launch(processes, threads, recipe(d / "out", args.cal_tokens, args.eval_tokens, args.size,
                                                               args.source), d)
            ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(processes)]
            files = sorted((d / "out").glob("*.gguf"))
            runs[name] = {"processes": processes, "threads_per_process": threads, "wall_s": wall,
                          "load_avg_5min_after": load, "exit_codes": [r["exit_code"] for r in ranks],
                          "run_s": ranks[0]["run_s"], "size_timings": ranks[0]["size_timings"],
                          "ranks": ranks[0]["ranks"], "compensated_tensors": ranks[0]["compensated_tensors"],
                          "tensor_bytes": ranks[0]["tensor_bytes"],
                          "file_sha256": {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}}
            print(f"{name}: {wall:.1f} s wall, size plan {ranks[0]['size_timings']}", flush=True)
        summary = {
            "schema": "compressor.bench_size_ranks/v1",
            "date": utc_now(),
            "environment": environment(),
            "ran_alone": True,
            "model": args.source,
            "offgrid": _offgrid(args.source),
            "recipe": recipe(Path("<out>"), args.cal_tokens, args.eval_tokens, args.size, args.source),
            "backend": "gloo",
            "runs": runs,
        }
        if "1x1" in runs and "2x1" in runs:
            one, two = runs["1x1"], runs["2x1"]
            summary["file_identical_1x1_2x1"] = bool(one["file_sha256"]) and one["file_sha256"] == two["file_sha256"]
            summary["ratios_2x1_over_1x1"] = {
                k: two["size_timings"][k] / one["size_timings"][k] for k in ("statistics_s", "pricing_s",
                                                                             "compensated_rounding_s")
                if (one["size_timings"] or {}).get(k) and (two["size_timings"] or {}).get(k)}
            summary["ratios_2x1_over_1x1"]["wall"] = two["wall_s"] / one["wall_s"]
        if "1x2" in runs and "2x1" in runs:
            one, two = runs["1x2"], runs["2x1"]
            summary["ratios_2x1_over_1x2"] = {
                k: two["size_timings"][k] / one["size_timings"][k] for k in ("statistics_s", "pricing_s",
                                                                             "compensated_rounding_s")
                if (one["size_timings"] or {}).get(k) and (two["size_timings"] or {}).get(k)}
            summary["ratios_2x1_over_1x2"]["wall"] = two["wall_s"] / one["wall_s"]
        write_json(args.output, summary)
        print(json.dumps({k: v for k, v in summary.items() if k.startswith(("file_", "ratios"))}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
