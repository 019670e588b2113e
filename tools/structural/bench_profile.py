#!/usr/bin/env python
"""Benchmark the streaming FFN-linearity profiler on SmolLM2-135M.

One run measures, on the same calibration windows:

1. **Speed** — the profile (``compressor.engine.measure.collect`` over fit + held-out
   windows, then ``block_profile`` for every block) against one plain
   ``model(input_ids)`` forward of the full model (LM head included) under
   ``torch.inference_mode``, plus where the profile's time goes: body-only
   forward (``model.model``), hooks + statistics (collect − body forward),
   ``Moments.update`` on synthetic tensors of the same shapes, and the solves.
2. **Memory** — peak RSS growth of the profile (VmHWM, reset after load via
   /proc/self/clear_refs) at N and 4N tokens, each in a fresh subprocess
   (``--child-peak N``) with glibc's mmap threshold pinned to 1 MiB so RSS
   follows live buffers rather than heap layout; plus the peak under the
   default allocator at N (what a user sees), and the peak as read at every
   batch start, which shows within one process whether it keeps growing.
3. **Against the naive way** — store every block's FFN input and output rows
   as float64 numpy arrays, ``numpy.linalg.lstsq`` with an intercept per block,
   score held-out R² (``--child-naive N``, also a fresh subprocess, against the
   default-allocator ``--child-peak N``): time ratio, peak-memory ratio and
   max |Δ r2_lin| over the blocks.

The subprocesses are ``tools/structural/bench_profile_child.py`` (what one of them
measures is described there). Timed phases are re-run (``--retries``) when
other processes were using the CPU meanwhile; every phase records how many
cores they used.

Usage (from the repo root)::

    . .venv/bin/activate
    python tools/structural/bench_profile.py --wait-idle 300   # ≈20k tokens → tools/structural/results/bench_profile.json

Progress goes to the log (stderr); a short summary is printed to stdout at the end.
"""

from __future__ import annotations

import argparse
import gc
import logging
import shlex
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (BUSY_CORES, MODEL, REPO_ROOT, OtherCpu, command_line, environment, json_child,
                            load_average, quiet_offline_env, timed_with_retries, utc_now, wait_for_idle, write_json)
from tools.benchlib.memory import emit_child_result
from tools.structural.bench_profile_child import (DEFAULT_DATA, PINNED_ALLOCATOR, SEQ_LEN, batches, child_run, load,
                                                  resolve_data, streaming_profile)
from tools.structural.bench_profile_report import memory_section, naive_section, speed_section, summary

quiet_offline_env()

import torch  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

logger = logging.getLogger("bench_profile")

DEFAULT_OUTPUT = RESULTS_DIR / "bench_profile.json"


def run_child(mode: str, tokens: int, args, env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), mode, str(tokens),
           "--batch-size", str(args.batch_size), "--data", str(args.data_path)]
    logger.info("subprocess: %s%s", "".join(f"{k}={v} " for k, v in (env or {}).items()), shlex.join(cmd))
    return json_child(cmd, env, name=f"child {mode} {tokens}", cwd=REPO_ROOT)


def time_forward(fn, cal, batch_size: int) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches(cal, batch_size):
            fn(input_ids=batch, use_cache=False)
    return time.perf_counter() - t0


def time_synthetic_updates(cal, batch_size: int, n_blocks: int, d_in: int, d_out: int) -> float:
    """Moments.update on random tensors shaped like collect's per-block, per-batch chunks.

    Fit batches: one update of all rows. Held-out batches: the sink rows
    (position 0) and the rest (bulk) as two updates, as collect does when no
    row is a spike.
    """
    from compressor.core.stats import Moments

    g = torch.Generator().manual_seed(0)
    shapes = []
    for split, windows in (("fit", cal.fit), ("heldout", cal.heldout)):
        for start in range(0, windows.shape[0], batch_size):
            b = min(batch_size, windows.shape[0] - start)
            rows = b * windows.shape[1]
            shapes.append([rows] if split == "fit" else [b, rows - b])
    x = torch.randn(max(s for ss in shapes for s in ss), d_in, generator=g)
    y = torch.randn(x.shape[0], d_out, generator=g)
    total = 0.0
    for _ in range(n_blocks):
        ms = {"fit": Moments(d_in, d_out), "sink": Moments(d_in, d_out), "bulk": Moments(d_in, d_out)}
        for ss in shapes:
            parts = ["fit"] if len(ss) == 1 else ["sink", "bulk"]
            for part, rows in zip(parts, ss):
                xs, ys = x[:rows].clone(), y[:rows].clone()  # collect's masked rows are fresh copies too
                t0 = time.perf_counter()
                ms[part].update(xs, ys, torch.float32)
                total += time.perf_counter() - t0
    return total


def measure_speed(model, cal, args, tokens_used: int) -> tuple[dict, dict, list[float], list[list[str]]]:
    """Phase records (forward, body forward, profile, synthetic updates), the profile's own timings,
    and the in-process profile's r2_lin and warnings per block."""
    n_blocks, d = len(model.model.layers), model.config.hidden_size
    logger.info("warm-up: 2 windows, then one full batch (untimed)")
    with torch.inference_mode():
        model(input_ids=cal.fit[:2], use_cache=False)
        model(input_ids=cal.fit[: args.batch_size], use_cache=False)
    logger.info("timing plain forward (full model, LM head included) over %d tokens", tokens_used)
    _, full = timed_with_retries("forward", lambda: time_forward(model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (%.0f tok/s)", full["wall_s"], tokens_used / full["wall_s"])
    logger.info("timing body-only forward (model.model, no hooks)")
    _, body = timed_with_retries("body forward", lambda: time_forward(model.model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (%.0f tok/s)", body["wall_s"], tokens_used / body["wall_s"])
    logger.info("timing the profile (collect + block_profile x %d)", n_blocks)
    (prof_t, r2, warns), prof = timed_with_retries(
        "profile", lambda: streaming_profile(model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (collect %.1f s, solves %.1f s)", prof["wall_s"], prof_t["collect_s"], prof_t["solves_s"])
    logger.info("timing Moments.update on synthetic tensors of the same shapes")
    synth, synth_rec = timed_with_retries(
        "Moments.update", lambda: time_synthetic_updates(cal, args.batch_size, n_blocks, d, d), args.retries
    )
    logger.info("  %.1f s", synth)
    phases = {"forward_full": full, "forward_body": body, "profile": prof, "moments_update_synthetic": synth_rec}
    return phases, dict(prof_t, moments_update_synthetic_s=synth), r2, warns


def main_bench(args) -> dict:
    started = time.perf_counter()
    busy_before = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else None
    torch.manual_seed(0)
    model, cal = load(args.tokens, args.data_path)
    n_blocks = len(model.model.layers)
    d = model.config.hidden_size
    tokens_used = (cal.fit.shape[0] + cal.heldout.shape[0]) * SEQ_LEN

    # -- 1. speed ---------------------------------------------------------
    phases, prof_t, r2_stream, warn_stream = measure_speed(model, cal, args, tokens_used)
    other: dict[str, float] = {key: rec["other_cores"] for key, rec in phases.items()}
    speed = speed_section(phases, prof_t, tokens_used, n_blocks)
    del model
    gc.collect()

    # -- 2. memory at N and 4N, 3. naive ------------------------------------
    # Default allocator: what a user sees, and the naive comparison (time + memory).
    # Pinned allocator: the N vs 4N flatness check, free of heap-layout noise.
    children: dict[str, dict] = {}
    plan = (("mem_n", "--child-peak", args.tokens, None), ("naive", "--child-naive", args.tokens, None),
            ("mem_n_pinned", "--child-peak", args.tokens, PINNED_ALLOCATOR),
            ("mem_4n_pinned", "--child-peak", 4 * args.tokens, PINNED_ALLOCATOR))
    for key, mode, n, env in plan:
        with OtherCpu(quiet=True) as oc:
            children[key] = run_child(mode, n, args, env)
        other[f"child_{key}"] = oc.cores
        if oc.cores > BUSY_CORES:
            logger.warning("other processes used %.2f CPU cores during child %s: its timing is contaminated",
                           oc.cores, key)
    naive, per_block = naive_section(r2_stream, warn_stream, children["naive"], children["mem_n"])
    return {
        "benchmark": "compressor streaming profiler vs plain forward and naive lstsq",
        "date": utc_now(),
        "command": command_line(),
        "model": MODEL,
        "data": str(args.data_path),
        "tokens": tokens_used,
        "tokens_requested": args.tokens,
        "seq_len": SEQ_LEN,
        "batch_size": args.batch_size,
        "n_fit_windows": int(cal.fit.shape[0]),
        "n_heldout_windows": int(cal.heldout.shape[0]),
        "n_blocks": n_blocks,
        "hidden_size": d,
        "precision": "float32 products, float64 accumulation",
        "environment": environment(),
        "speed": speed,
        "memory": memory_section(children),
        "naive": naive,
        "sanity": {"max_abs_delta_r2_main_vs_child_streaming":
                   max(abs(a - b) for a, b in zip(r2_stream, children["mem_n"]["r2_lin"]))},
        "per_block": per_block,
        "other_processes_cpu_cores": {"before_start": busy_before, **other},
        "load_average_1_5_15_at_end": load_average(),
        "wall_time_s": time.perf_counter() - started,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=20480, help="calibration tokens N (memory is also measured at 4N)")
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward batch")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="JSON result path")
    p.add_argument("--data", default=None, help=f"calibration text file (default {DEFAULT_DATA})")
    p.add_argument("--wait-idle", type=float, default=0.0, metavar="SECONDS",
                   help="first wait up to this long for other processes to stop using the CPU")
    p.add_argument("--retries", type=int, default=1,
                   help="re-time a phase up to this many times when other processes were using the CPU")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    child = p.add_mutually_exclusive_group()
    child.add_argument("--child-peak", type=int, metavar="N", help=argparse.SUPPRESS)
    child.add_argument("--child-naive", type=int, metavar="N", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tokens < 2 * SEQ_LEN:
        p.error(f"--tokens must be at least {2 * SEQ_LEN} (two windows of {SEQ_LEN})")
    if args.batch_size < 1:
        p.error("--batch-size must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format=f"%(asctime)s {'child' if (args.child_peak or args.child_naive) else 'main '} %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    args.data_path = resolve_data(args.data)
    if args.child_peak or args.child_naive:  # the subprocesses: tools/structural/bench_profile_child.py
        kind = "streaming" if args.child_peak else "naive"
        emit_child_result(child_run(kind, args.child_peak or args.child_naive, args.data_path, args.batch_size))
        return 0
    result = main_bench(args)
    out = args.output if args.output.is_absolute() else Path.cwd() / args.output
    write_json(out, result, default=str)
    logger.info("wrote %s", out)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
