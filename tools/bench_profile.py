#!/usr/bin/env python
"""Benchmark the streaming FFN-linearity profiler on SmolLM2-135M.

One run measures, on the same calibration windows:

1. **Speed** — the profile (``compressor.measure.collect`` over fit + held-out
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

Timed phases are re-run (``--retries``) when other processes were using the
CPU meanwhile; every phase records how many cores they used.

Usage (from the repo root)::

    . .venv/bin/activate
    python tools/bench_profile.py --wait-idle 300     # ≈20k tokens, writes tools/results/bench_profile.json

Progress goes to the log (stderr); a short summary is printed to stdout at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shlex
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from benchlib import MODEL, REPO_ROOT, RESULTS_DIR, WIKITEXT_DIR, environment, quiet_offline_env

quiet_offline_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

logger = logging.getLogger("bench_profile")

DEFAULT_DATA = WIKITEXT_DIR / "valid.txt"
DEFAULT_OUTPUT = RESULTS_DIR / "bench_profile.json"
SEQ_LEN = 128
HELDOUT_FRACTION = 0.2
SEED = 0
CHILD_MARKER = "BENCH_CHILD_RESULT "
TARGET_TIME_RATIO = 1.10
MiB = 1024 * 1024


# ---------------------------------------------------------------------------
# memory helpers
# ---------------------------------------------------------------------------
def _proc_status_bytes() -> dict[str, int]:
    """VmRSS / VmHWM (peak) of this process in bytes, from /proc/self/status."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, val = line.split(":", 1)
                    out[key] = int(val.split()[0]) * 1024
    except OSError:
        pass
    return out


def _current_rss() -> int:
    return _proc_status_bytes().get("VmRSS", 0)


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    st = _proc_status_bytes()
    return "VmHWM" in st and st["VmHWM"] <= st.get("VmRSS", 0) + 4 * MiB


class _RssSampler:
    """Background RSS sampler: the fallback (and cross-check) when VmHWM cannot be reset."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = _current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _current_rss())
            self._stop.wait(self.interval)

    def __enter__(self) -> "_RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _current_rss())


class PeakMeter:
    """Peak RSS growth over a region, relative to the RSS at entry."""

    def __enter__(self) -> "PeakMeter":
        gc.collect()
        self.hwm_reset = _reset_peak_rss()
        self.baseline = _current_rss()
        self.sampler = _RssSampler().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.sampler.__exit__(*exc)
        st = _proc_status_bytes()
        self.hwm = st.get("VmHWM")
        if self.hwm_reset and self.hwm is not None:
            self.peak, self.method = self.hwm, "VmHWM after clear_refs reset"
        else:
            self.peak, self.method = self.sampler.peak, "RSS sampled every 20 ms"

    def report(self) -> dict:
        return {
            "rss_after_load_mib": self.baseline / MiB,
            "peak_rss_mib": self.peak / MiB,
            "peak_growth_mib": (self.peak - self.baseline) / MiB,
            "sampled_peak_growth_mib": (self.sampler.peak - self.baseline) / MiB,
            "method": self.method,
        }


# ---------------------------------------------------------------------------
# shared setup
# ---------------------------------------------------------------------------
def resolve_data(path: str | None) -> Path:
    p = Path(path).expanduser() if path else DEFAULT_DATA
    if not p.is_absolute():
        p = REPO_ROOT / p
    p = p.resolve()
    if not p.is_file():
        raise SystemExit(
            f"calibration text not found: {p}\n"
            f"  expected WikiText-2 validation text at ../shared/data/wikitext-2/valid.txt relative to the "
            f"repo root ({REPO_ROOT}); pass --data PATH to use another plain-text file."
        )
    return p


def load(tokens: int, data: Path):
    """Load SmolLM2 and cut ``tokens`` calibration tokens into fit / held-out windows."""
    from compressor.data import TextSource, calibration_set
    from compressor.load import load_model

    t0 = time.perf_counter()
    model, tokenizer, src = load_model(MODEL)
    logger.info("loaded %s in %.1f s", src.describe(), time.perf_counter() - t0)
    cal = calibration_set(
        tokenizer, TextSource(str(data)), seq_len=SEQ_LEN, max_tokens=tokens,
        heldout_fraction=HELDOUT_FRACTION, seed=SEED,
    )
    got = (cal.fit.shape[0] + cal.heldout.shape[0]) * SEQ_LEN
    if got < tokens - SEQ_LEN + 1:
        raise SystemExit(f"{data} gave only {got} tokens in whole windows; {tokens} requested")
    return model, cal


def batches(cal, batch_size: int):
    """Fit windows then held-out windows, in the same batches ``collect`` uses."""
    for windows in (cal.fit, cal.heldout):
        for start in range(0, windows.shape[0], batch_size):
            yield windows[start : start + batch_size]


def streaming_profile(model, cal, batch_size: int) -> tuple[dict, list[float], list[list[str]]]:
    """The profile under test: collect + block_profile for every block, timed.

    Returns the timings, each block's held-out r2_lin and its solver warnings."""
    from compressor.measure import collect
    from compressor.profiling import block_profile

    t0 = time.perf_counter()
    stats = collect(model, cal.fit, cal.heldout, batch_size=batch_size, precision="float32")
    t1 = time.perf_counter()
    profiles = [block_profile(stats[i])[0] for i in sorted(stats)]
    t2 = time.perf_counter()
    timing = {"collect_s": t1 - t0, "solves_s": t2 - t1, "profile_s": t2 - t0}
    return timing, [p.r2_lin for p in profiles], [list(p.warnings) for p in profiles]


# ---------------------------------------------------------------------------
# children (fresh processes)
# ---------------------------------------------------------------------------
def _warm_up(model, cal) -> None:
    # One window through the body: first-call initialisation, not the real batch buffers.
    with torch.inference_mode():
        model.model(input_ids=cal.fit[:1], use_cache=False)


class HwmTrajectory:
    """Peak RSS growth seen at the start of every forward batch (a forward pre-hook on the
    input embeddings): shows *within one process* whether the peak keeps growing with tokens."""

    def __init__(self, model, baseline: int) -> None:
        self.baseline = baseline
        self.points: list[tuple[int, float]] = []
        self.tokens = 0
        self._h = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args) -> None:
        self.mark()
        self.tokens += args[0].numel()

    def mark(self) -> None:
        hwm = _proc_status_bytes().get("VmHWM")
        if hwm is not None:
            self.points.append((self.tokens, (hwm - self.baseline) / MiB))

    def close(self) -> None:
        self._h.remove()
        self.mark()

    def growth_at(self, tokens: int) -> float:
        """Peak growth over the first ``tokens`` tokens (the first reading taken once they were done)."""
        return next(g for t, g in self.points if t >= tokens)

    def phases(self, n_fit: int, n_total: int, batch_tokens: int) -> dict[str, float]:
        """Peak growth at phase landmarks: collect's held-out phase allocates masked row copies the
        fit phase does not, so each phase is compared with itself."""
        return {
            "fit_after_2_batches": self.growth_at(min(2 * batch_tokens, n_fit)),
            "fit_end": self.growth_at(n_fit),
            "heldout_after_2_batches": self.growth_at(min(n_fit + 2 * batch_tokens, n_total)),
            "end": self.points[-1][1],
        }

    def summary(self, max_points: int = 41) -> list[tuple[int, float]]:
        pts = self.points
        if len(pts) <= max_points:
            return pts
        step = (len(pts) - 1) / (max_points - 1)
        return [pts[round(k * step)] for k in range(max_points)]


def _run_measured(model, cal, fn, batch_size: int) -> dict:
    _warm_up(model, cal)
    with PeakMeter() as pm:
        traj = HwmTrajectory(model, pm.baseline)
        c0 = time.process_time()
        try:
            timing, r2, warnings = fn(model, cal, batch_size)
        finally:
            traj.close()
        timing["cpu_s"] = time.process_time() - c0
    out = {"tokens": int(cal.fit.numel() + cal.heldout.numel()),
           "n_fit_windows": cal.fit.shape[0], "n_heldout_windows": cal.heldout.shape[0],
           "allocator": "pinned (MALLOC_MMAP_THRESHOLD_=%s)" % os.environ["MALLOC_MMAP_THRESHOLD_"]
           if "MALLOC_MMAP_THRESHOLD_" in os.environ else "glibc default"}
    out.update(pm.report(), timing=timing, r2_lin=r2, warnings=warnings)
    if pm.hwm_reset:
        n_fit = int(cal.fit.numel())
        out["phase_peak_growth_mib"] = traj.phases(n_fit, out["tokens"], batch_size * cal.fit.shape[1])
        out["hwm_trajectory_tokens_mib"] = traj.summary()
    return out


def naive_profile(model, cal, batch_size: int) -> tuple[dict, list[float], list[list[str]]]:
    """Store every FFN input/output row (float64), then lstsq + held-out R² per block.

    Given every advantage: buffers are preallocated (no list-then-concatenate
    copy) and the forward runs the body only (no LM head), so the comparison
    isolates "statistics" against "stored activations".
    """
    layers = model.model.layers
    d_in = model.config.hidden_size  # FFN input and output width
    d_out = d_in
    rows = {"fit": cal.fit.numel(), "heldout": cal.heldout.numel()}
    bufs = {
        split: [(np.empty((n, d_in)), np.empty((n, d_out))) for _ in layers] for split, n in rows.items()
    }
    cursor = {"split": "fit", "pos": 0}

    def make_hook(i: int):
        def hook(module, args, output):
            x = args[0].reshape(-1, d_in)
            y = output.reshape(-1, d_out)
            a = cursor["pos"]
            X, Y = bufs[cursor["split"]][i]
            X[a : a + x.shape[0]] = x.numpy()  # float32 → float64 copy
            Y[a : a + y.shape[0]] = y.numpy()

        return hook

    t0 = time.perf_counter()
    handles = [layer.mlp.register_forward_hook(make_hook(i)) for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            for split, windows in (("fit", cal.fit), ("heldout", cal.heldout)):
                cursor.update(split=split, pos=0)
                for start in range(0, windows.shape[0], batch_size):
                    batch = windows[start : start + batch_size]
                    model.model(input_ids=batch, use_cache=False)
                    cursor["pos"] += batch.numel()
    finally:
        for h in handles:
            h.remove()
    t1 = time.perf_counter()
    r2 = []
    for i in range(len(layers)):
        Xf, Yf = bufs["fit"][i]
        Xh, Yh = bufs["heldout"][i]
        A = np.hstack([Xf, np.ones((Xf.shape[0], 1))])
        coef, *_ = np.linalg.lstsq(A, Yf, rcond=None)
        del A
        pred = Xh @ coef[:-1] + coef[-1]
        sse = float(((Yh - pred) ** 2).sum())
        sst = float(((Yh - Yh.mean(0)) ** 2).sum())
        r2.append(1.0 - sse / sst)
        bufs["fit"][i] = bufs["heldout"][i] = None  # a naive script keeps them; freeing cannot raise the peak
    t2 = time.perf_counter()
    return {"capture_s": t1 - t0, "lstsq_s": t2 - t1, "profile_s": t2 - t0}, r2, [[] for _ in r2]


def child_run(kind: str, tokens: int, data: Path, batch_size: int) -> dict:
    """One measured profile in this (fresh) process: ``streaming`` or ``naive``."""
    model, cal = load(tokens, data)
    out = _run_measured(model, cal, streaming_profile if kind == "streaming" else naive_profile, batch_size)
    logger.info("%s @ %d tokens: peak growth %.0f MiB, %.1f s", kind, tokens, out["peak_growth_mib"],
                out["timing"]["profile_s"])
    return out


# glibc: a fixed mmap threshold serves every allocation >= 1 MiB from mmap and returns it on free, so
# RSS follows the live buffers instead of the heap's layout (which alone moves a run's peak by ~±100 MiB).
PINNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 * MiB)}


def run_child(mode: str, tokens: int, args, env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), mode, str(tokens),
           "--batch-size", str(args.batch_size), "--data", str(args.data_path)]
    logger.info("subprocess: %s%s", "".join(f"{k}={v} " for k, v in (env or {}).items()), shlex.join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, cwd=REPO_ROOT,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"child {mode} {tokens} failed with exit code {proc.returncode}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(CHILD_MARKER)]
    if not lines:
        raise RuntimeError(f"child {mode} {tokens} printed no result")
    return json.loads(lines[-1][len(CHILD_MARKER):])


# ---------------------------------------------------------------------------
# main benchmark
# ---------------------------------------------------------------------------
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
    from compressor.stats import Moments

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


def _busy_cpu_s() -> float:
    """CPU seconds all processes have spent busy since boot (/proc/stat), NaN if unavailable."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    # user nice system idle iowait irq softirq steal ...: everything but idle and iowait
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its finished children."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


BUSY_CORES = 0.2  # other processes using more than this many cores → the timing is flagged


class OtherCpu:
    """Average CPU cores used by other processes over a region: a contamination flag for timings."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet

    def __enter__(self) -> "OtherCpu":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        dt = time.perf_counter() - self.t0
        other = (_busy_cpu_s() - self.busy0) - (_own_cpu_s() - self.own0)
        self.cores = max(0.0, other / dt) if dt > 0 else float("nan")
        if self.cores > BUSY_CORES and not self.quiet:
            logger.warning("other processes used %.2f CPU cores during this phase: timing is contaminated", self.cores)


def wait_for_idle(max_wait: float, threshold: float = BUSY_CORES) -> float:
    """Wait (up to ``max_wait`` s) until other processes use < ``threshold`` cores over 5 s."""
    deadline = time.monotonic() + max_wait
    while True:
        with OtherCpu(quiet=True) as oc:
            time.sleep(5.0)
        if oc.cores < threshold or time.monotonic() >= deadline:
            if oc.cores >= threshold:
                logger.warning("machine still busy (%.2f cores used by others); benchmarking anyway", oc.cores)
            return oc.cores
        logger.info("waiting for the machine to go idle (others use %.2f cores)", oc.cores)


def timed(name: str, fn, retries: int):
    """Run ``fn()`` timed; re-run up to ``retries`` times while other processes load the CPU.

    Returns ``(value, record)`` for the fastest attempt; ``record`` has its wall
    and CPU seconds, the cores other processes used meanwhile, and all attempts.
    """
    attempts, best = [], None
    for k in range(retries + 1):
        with OtherCpu(quiet=True) as oc:
            c0, t0 = time.process_time(), time.perf_counter()
            value = fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rec = {"wall_s": wall, "cpu_s": cpu, "other_cores": oc.cores}
        attempts.append(rec)
        if best is None or wall < best[1]["wall_s"]:
            best = (value, rec)
        if oc.cores <= BUSY_CORES:
            break
        logger.warning(
            "%s: other processes used %.2f CPU cores (%.1f s wall)%s", name, oc.cores, wall,
            "; timing again" if k < retries else "; keeping the fastest attempt",
        )
    value, rec = best
    return value, dict(rec, attempts=attempts, contaminated=rec["other_cores"] > BUSY_CORES)


def main_bench(args) -> dict:
    started = time.perf_counter()
    busy_before = wait_for_idle(args.wait_idle) if args.wait_idle > 0 else None
    other: dict[str, float] = {}
    torch.manual_seed(0)
    model, cal = load(args.tokens, args.data_path)
    n_blocks = len(model.model.layers)
    d = model.config.hidden_size
    tokens_used = (cal.fit.shape[0] + cal.heldout.shape[0]) * SEQ_LEN

    # -- 1. speed ---------------------------------------------------------
    logger.info("warm-up: 2 windows, then one full batch (untimed)")
    with torch.inference_mode():
        model(input_ids=cal.fit[:2], use_cache=False)
        model(input_ids=cal.fit[: args.batch_size], use_cache=False)
    logger.info("timing plain forward (full model, LM head included) over %d tokens", tokens_used)
    _, full = timed("forward", lambda: time_forward(model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (%.0f tok/s)", full["wall_s"], tokens_used / full["wall_s"])
    logger.info("timing body-only forward (model.model, no hooks)")
    _, body = timed("body forward", lambda: time_forward(model.model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (%.0f tok/s)", body["wall_s"], tokens_used / body["wall_s"])
    logger.info("timing the profile (collect + block_profile x %d)", n_blocks)
    (prof_t, r2_stream, warn_stream), prof = timed("profile", lambda: streaming_profile(model, cal, args.batch_size), args.retries)
    logger.info("  %.1f s (collect %.1f s, solves %.1f s)", prof["wall_s"], prof_t["collect_s"], prof_t["solves_s"])
    logger.info("timing Moments.update on synthetic tensors of the same shapes")
    synth, synth_rec = timed(
        "Moments.update", lambda: time_synthetic_updates(cal, args.batch_size, n_blocks, d, d), args.retries
    )
    logger.info("  %.1f s", synth)
    for key, rec in (("forward_full", full), ("forward_body", body), ("profile", prof), ("moments_update_synthetic", synth_rec)):
        other[key] = rec["other_cores"]
    fwd_full, fwd_body = full["wall_s"], body["wall_s"]
    ratio = prof["wall_s"] / fwd_full
    speed = {
        "forward_full_s": fwd_full,
        "forward_full_tok_per_s": tokens_used / fwd_full,
        "forward_body_s": fwd_body,
        "lm_head_s": fwd_full - fwd_body,
        "profile_s": prof["wall_s"],
        "collect_s": prof_t["collect_s"],
        "hooks_and_statistics_s": prof_t["collect_s"] - fwd_body,
        "moments_update_synthetic_s": synth,
        "solves_s": prof_t["solves_s"],
        "solve_per_block_s": prof_t["solves_s"] / n_blocks,
        "ratio_profile_over_forward": ratio,
        "ratio_collect_over_body_forward": prof_t["collect_s"] / fwd_body,
        "cpu_time_ratio_profile_over_forward": prof["cpu_s"] / full["cpu_s"],
        "target_ratio": TARGET_TIME_RATIO,
        "meets_target": ratio <= TARGET_TIME_RATIO,
        "timing_contaminated": any(r["contaminated"] for r in (full, body, prof)),
        "phases": {"forward_full": full, "forward_body": body, "profile": prof, "moments_update_synthetic": synth_rec},
        "notes": (
            "forward = model(input_ids=batch, use_cache=False) under torch.inference_mode over the same "
            "fit-then-held-out batches collect uses; collect stops after the last block, so the profile "
            "never pays for the LM head; hooks_and_statistics_s = collect_s - forward_body_s; a phase run "
            "while other processes used > 0.2 CPU cores is re-timed (--retries) and the fastest attempt kept"
        ),
    }
    del model
    gc.collect()
    children: dict[str, dict] = {}

    # -- 2. memory at N and 4N, 3. naive ------------------------------------
    # Default allocator: what a user sees, and the naive comparison (time + memory).
    # Pinned allocator: the N vs 4N flatness check, free of heap-layout noise.
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
    mem_n, naive = children["mem_n"], children["naive"]
    pin_n, pin_4n = children["mem_n_pinned"], children["mem_4n_pinned"]

    deltas = [abs(a - b) for a, b in zip(r2_stream, naive["r2_lin"])]
    child_vs_main = max(abs(a - b) for a, b in zip(r2_stream, mem_n["r2_lin"]))
    growth_ratio = pin_4n["peak_growth_mib"] / pin_n["peak_growth_mib"]
    ph4 = pin_4n.get("phase_peak_growth_mib")
    flagged = [i for i, w in enumerate(warn_stream) if w]
    clean = [d_ for i, d_ in enumerate(deltas) if i not in flagged]
    stream_s, naive_s = mem_n["timing"]["profile_s"], naive["timing"]["profile_s"]
    result = {
        "benchmark": "compressor streaming profiler vs plain forward and naive lstsq",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
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
        "memory": {
            "streaming_n_pinned": _strip(pin_n),
            "streaming_4n_pinned": _strip(pin_4n),
            "peak_growth_ratio_4n_over_n": growth_ratio,
            "streaming_n_default_allocator": _strip(mem_n),
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
        },
        "naive": {
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
        },
        "sanity": {"max_abs_delta_r2_main_vs_child_streaming": child_vs_main},
        "per_block": [
            {"block": i, "r2_lin_streaming": a, "r2_lin_naive": b, "abs_delta": abs(a - b),
             "streaming_warnings": warn_stream[i]}
            for i, (a, b) in enumerate(zip(r2_stream, naive["r2_lin"]))
        ],
        "other_processes_cpu_cores": {"before_start": busy_before, **other},
        "load_average_1_5_15_at_end": list(os.getloadavg()),
        "wall_time_s": time.perf_counter() - started,
    }
    return result


def _strip(child: dict) -> dict:
    return {k: v for k, v in child.items() if k not in ("r2_lin", "warnings")}


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
        f"{s['ratio_profile_over_forward']:.3f} (target <= {TARGET_TIME_RATIO}: "
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
    busy = {k: v for k, v in r["other_processes_cpu_cores"].items() if v is not None and v > BUSY_CORES}
    if busy:
        lines.append("  WARNING: other processes were using the CPU (cores): "
                     + ", ".join(f"{k} {v:.2f}" for k, v in busy.items()) + " -- timings inflated")
    return "\n".join(lines)


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
    if args.child_peak or args.child_naive:
        kind = "streaming" if args.child_peak else "naive"
        out = child_run(kind, args.child_peak or args.child_naive, args.data_path, args.batch_size)
        sys.stdout.write(CHILD_MARKER + json.dumps(out) + "\n")
        return 0
    result = main_bench(args)
    out = args.output if args.output.is_absolute() else Path.cwd() / args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    logger.info("wrote %s", out)
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
