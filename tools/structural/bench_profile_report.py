#!/usr/bin/env python
"""The sections of ``results/bench_profile.json`` and its summary; run alone, re-prints the summary.

``tools/structural/bench_profile.py`` measures; this turns the measurements into the
result's ``speed`` / ``memory`` / ``naive`` sections and the short summary.

    python tools/structural/bench_profile_report.py                  # tools/structural/results/bench_profile.json
    python tools/structural/bench_profile_report.py other/bench_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import contention_note

RESULTS_DIR = Path(__file__).resolve().parent / "results"

TARGET_TIME_RATIO = 1.10


def speed_section(phases: dict[str, dict], prof_t: dict, tokens_used: int, n_blocks: int) -> dict:
    """From the timed phases (forward_full, forward_body, profile, moments_update_synthetic) and the
    profile's own timings (collect_s, solves_s, moments_update_synthetic_s)."""
    full, body, prof = phases["forward_full"], phases["forward_body"], phases["profile"]
    fwd_full, fwd_body = full["wall_s"], body["wall_s"]
    ratio = prof["wall_s"] / fwd_full
    return {
        "forward_full_s": fwd_full,
        "forward_full_tok_per_s": tokens_used / fwd_full,
        "forward_body_s": fwd_body,
        "lm_head_s": fwd_full - fwd_body,
        "profile_s": prof["wall_s"],
        "collect_s": prof_t["collect_s"],
        "hooks_and_statistics_s": prof_t["collect_s"] - fwd_body,
        "moments_update_synthetic_s": prof_t["moments_update_synthetic_s"],
        "solves_s": prof_t["solves_s"],
        "solve_per_block_s": prof_t["solves_s"] / n_blocks,
        "ratio_profile_over_forward": ratio,
        "ratio_collect_over_body_forward": prof_t["collect_s"] / fwd_body,
        "cpu_time_ratio_profile_over_forward": prof["cpu_s"] / full["cpu_s"],
        "target_ratio": TARGET_TIME_RATIO,
        "meets_target": ratio <= TARGET_TIME_RATIO,
        "timing_contaminated": any(r["contaminated"] for r in (full, body, prof)),
        "phases": phases,
        "notes": (
            "forward = model(input_ids=batch, use_cache=False) under torch.inference_mode over the same "
            "fit-then-held-out batches collect uses; collect stops after the last block, so the profile "
            "never pays for the LM head; hooks_and_statistics_s = collect_s - forward_body_s; a phase run "
            "while other processes used > 0.2 CPU cores is re-timed (--retries) and the fastest attempt kept"
        ),
    }


def _strip(child: dict) -> dict:
    return {k: v for k, v in child.items() if k not in ("r2_lin", "warnings")}


def memory_section(children: dict[str, dict]) -> dict:
    """From the child runs ``mem_n`` (default allocator), ``mem_n_pinned`` and ``mem_4n_pinned``."""
    pin_n, pin_4n = children["mem_n_pinned"], children["mem_4n_pinned"]
    ph4 = pin_4n.get("phase_peak_growth_mib")
    return {
        "streaming_n_pinned": _strip(pin_n),
        "streaming_4n_pinned": _strip(pin_4n),
        "peak_growth_ratio_4n_over_n": pin_4n["peak_growth_mib"] / pin_n["peak_growth_mib"],
        "streaming_n_default_allocator": _strip(children["mem_n"]),
        "within_4n_run_peak_drift_mib": None if ph4 is None else {
            "fit_phase": ph4["fit_end"] - ph4["fit_after_2_batches"],
            "heldout_phase_and_solves": ph4["end"] - ph4["heldout_after_2_batches"],
        },
        "target": "flat (ratio ≈ 1)",
        "notes": (
            "peak RSS growth = VmHWM (reset with /proc/self/clear_refs after load, calibration and a "
            "1-window warm-up) minus RSS at that point, over collect + block_profile, each size in a fresh "
            "subprocess. phase_peak_growth_mib: peak at landmarks read at each batch start; the held-out phase "
            "allocates masked row copies (sink/spike/bulk) the fit phase does not, so its peak is higher at "
            "any N; within_4n_run_peak_drift_mib is how much the peak still grew after the first 2 batches "
            "of each phase of the 4N run. "
            "N vs 4N use a pinned glibc allocator (MALLOC_MMAP_THRESHOLD_=1 MiB: buffers >= 1 MiB are "
            "mmapped and unmapped on free) so RSS follows live memory; with the default allocator the "
            "same run's peak moves by ~±100 MiB from heap layout alone (streaming_n_default_allocator is "
            "what a user sees). "
            "The floor is the statistics themselves: 30 blocks x 4 Moments (fit + sink/spike/bulk) x "
            "(cxx + cxy) = 30*4*2*576^2*8 B = 607 MiB"
        ),
    }


def naive_section(r2_stream: list[float], warn_stream: list[list[str]], naive: dict, mem_n: dict) -> tuple[dict, list]:
    """The naive-vs-streaming comparison and the per-block table (in-process streaming r2_lin against the
    naive child's; time and memory from the two default-allocator children)."""
    deltas = [abs(a - b) for a, b in zip(r2_stream, naive["r2_lin"])]
    flagged = [i for i, w in enumerate(warn_stream) if w]
    clean = [d_ for i, d_ in enumerate(deltas) if i not in flagged]
    stream_s, naive_s = mem_n["timing"]["profile_s"], naive["timing"]["profile_s"]
    section = {
        "method": (
            "forward hooks on model.model.layers[i].mlp store float64 copies of every input/output row "
            "(preallocated buffers, body-only forward); per block numpy.linalg.lstsq with an intercept "
            "column on fit rows; held-out R² = 1 - SSE/SST pooled over output features, SST about the "
            "held-out mean"
        ),
        "run": _strip(naive),
        "streaming_run": {"profile_s": stream_s, "cpu_s": mem_n["timing"]["cpu_s"],
                          "peak_growth_mib": mem_n["peak_growth_mib"]},
        "time_ratio_naive_over_streaming": naive_s / stream_s,
        "cpu_time_ratio_naive_over_streaming": naive["timing"]["cpu_s"] / mem_n["timing"]["cpu_s"],
        "peak_growth_ratio_naive_over_streaming": naive["peak_growth_mib"] / mem_n["peak_growth_mib"],
        "max_abs_delta_r2_lin": max(deltas),
        "argmax_block": int(np.argmax(deltas)),
        "blocks_with_solver_warnings": {str(i): warn_stream[i] for i in flagged},
        "max_abs_delta_r2_lin_blocks_without_warnings": max(clean) if clean else None,
        "notes": "both measured in fresh subprocesses (default allocator) on the same fit/held-out windows",
    }
    per_block = [
        {"block": i, "r2_lin_streaming": a, "r2_lin_naive": b, "abs_delta": abs(a - b),
         "streaming_warnings": warn_stream[i]}
        for i, (a, b) in enumerate(zip(r2_stream, naive["r2_lin"]))
    ]
    return section, per_block


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _drift(m: dict) -> str:
    d = m["within_4n_run_peak_drift_mib"]
    if d is None:
        return "n/a"
    return f"fit {d['fit_phase']:+.1f} MiB, held-out {d['heldout_phase_and_solves']:+.1f} MiB"


def summary(r: dict) -> str:
    s, m, n = r["speed"], r["memory"], r["naive"]
    lines = [
        f"SmolLM2-135M, {r['tokens']} tokens (seq_len {r['seq_len']}, batch {r['batch_size']}), "
        f"{r['environment']['torch_threads']} threads, torch {r['environment']['torch']}",
        f"  profile {s['profile_s']:.1f} s vs forward {s['forward_full_s']:.1f} s  ->  ratio "
        f"{s['ratio_profile_over_forward']:.3f} (target <= {s['target_ratio']}: "
        f"{'met' if s['meets_target'] else 'MISSED'})",
        f"    body forward {s['forward_body_s']:.1f} s, hooks+statistics {s['hooks_and_statistics_s']:.1f} s "
        f"(Moments.update synthetic {s['moments_update_synthetic_s']:.1f} s), solves {s['solves_s']:.1f} s, "
        f"LM head (skipped) {s['lm_head_s']:.1f} s",
        f"  peak RSS growth (pinned allocator): {m['streaming_n_pinned']['peak_growth_mib']:.0f} MiB @ N, "
        f"{m['streaming_4n_pinned']['peak_growth_mib']:.0f} MiB @ 4N  (ratio {m['peak_growth_ratio_4n_over_n']:.2f}; "
        f"4N run's peak drift after 2 batches: {_drift(m)})",
        f"  naive lstsq: {n['run']['timing']['profile_s']:.1f} s, {n['run']['peak_growth_mib']:.0f} MiB vs streaming "
        f"{n['streaming_run']['profile_s']:.1f} s, {n['streaming_run']['peak_growth_mib']:.0f} MiB (default allocator)",
        f"    -> naive/streaming {n['time_ratio_naive_over_streaming']:.2f}x time "
        f"(CPU {n['cpu_time_ratio_naive_over_streaming']:.2f}x), {n['peak_growth_ratio_naive_over_streaming']:.1f}x "
        f"memory; max |d r2_lin| = {n['max_abs_delta_r2_lin']:.2e} (block {n['argmax_block']})",
    ]
    if n["blocks_with_solver_warnings"]:
        lines.append(
            f"    blocks with solver warnings: {', '.join(n['blocks_with_solver_warnings'])}; max |d r2_lin| over the "
            f"others = {_fmt(n['max_abs_delta_r2_lin_blocks_without_warnings'], '.2e')}"
        )
    note = contention_note(r["other_processes_cpu_cores"])
    if note:
        lines.append("  " + note)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", nargs="?", type=Path, default=RESULTS_DIR / "bench_profile.json",
                    help="a bench_profile.py result (default %(default)s)")
    args = ap.parse_args(argv)
    print(summary(json.loads(args.result.read_text(encoding="utf-8"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
