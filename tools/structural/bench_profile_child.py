#!/usr/bin/env python
"""One measured profile of SmolLM2-135M in this (fresh) process: ``streaming`` or ``naive``.

* ``streaming`` — the profiler under test: ``compressor.engine.measure.collect``
  over fit + held-out windows, then ``block_profile`` for every block;
* ``naive`` — store every block's FFN input and output rows as float64 numpy
  arrays, ``numpy.linalg.lstsq`` with an intercept per block, held-out R².

Records wall / CPU time, peak RSS growth over the profile (VmHWM reset after
load, calibration and a 1-window warm-up; sampled RSS as a cross-check), the
peak read at every batch start, and each block's held-out r2_lin; prints one
``BENCH_CHILD_RESULT {json}`` line. ``tools/structural/bench_profile.py`` runs it (as
``bench_profile.py --child-peak N`` / ``--child-naive N``), each size in a
fresh process; by hand, from the repo root::

    python tools/structural/bench_profile_child.py streaming 20480
    MALLOC_MMAP_THRESHOLD_=1048576 python tools/structural/bench_profile_child.py naive 20480
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import (MODEL, REPO_ROOT, WIKITEXT_DIR, MiB, PeakMeter, PeakTrajectory, load_bench_model,
                            quiet_offline_env)
from tools.benchlib.memory import emit_child_result

quiet_offline_env()

import numpy as np  # noqa: E402
import torch  # noqa: E402

logger = logging.getLogger("bench_profile")

DEFAULT_DATA = WIKITEXT_DIR / "valid.txt"
SEQ_LEN = 128
HELDOUT_FRACTION = 0.2
SEED = 0
# glibc: a fixed mmap threshold serves every allocation >= 1 MiB from mmap and returns it on free, so
# RSS follows the live buffers instead of the heap's layout (which alone moves a run's peak by ~±100 MiB).
PINNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 * MiB)}


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
    from compressor.inputs.data import TextSource, calibration_set

    model, tokenizer, _, _ = load_bench_model(MODEL)
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
    from compressor.engine.measure import collect
    from compressor.engine.profiling import block_profile

    t0 = time.perf_counter()
    stats = collect(model, cal.fit, cal.heldout, batch_size=batch_size, precision="float32")
    t1 = time.perf_counter()
    profiles = [block_profile(stats[i])[0] for i in sorted(stats)]
    t2 = time.perf_counter()
    timing = {"collect_s": t1 - t0, "solves_s": t2 - t1, "profile_s": t2 - t0}
    return timing, [p.r2_lin for p in profiles], [list(p.warnings) for p in profiles]


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


def phases(traj: PeakTrajectory, n_fit: int, n_total: int, batch_tokens: int) -> dict[str, float]:
    """Peak growth at phase landmarks: collect's held-out phase allocates masked row copies the
    fit phase does not, so each phase is compared with itself."""
    return {
        "fit_after_2_batches": traj.growth_at(min(2 * batch_tokens, n_fit)),
        "fit_end": traj.growth_at(n_fit),
        "heldout_after_2_batches": traj.growth_at(min(n_fit + 2 * batch_tokens, n_total)),
        "end": traj.points[-1][1],
    }


def run_measured(model, cal, fn, batch_size: int) -> dict:
    # One window through the body: first-call initialisation, not the real batch buffers.
    with torch.inference_mode():
        model.model(input_ids=cal.fit[:1], use_cache=False)
    with PeakMeter() as pm:
        traj = PeakTrajectory(model, pm.baseline)
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
        out["phase_peak_growth_mib"] = phases(traj, n_fit, out["tokens"], batch_size * cal.fit.shape[1])
        out["hwm_trajectory_tokens_mib"] = traj.summary()
    return out


def child_run(kind: str, tokens: int, data: Path, batch_size: int) -> dict:
    """One measured profile in this (fresh) process: ``streaming`` or ``naive``."""
    model, cal = load(tokens, data)
    out = run_measured(model, cal, streaming_profile if kind == "streaming" else naive_profile, batch_size)
    logger.info("%s @ %d tokens: peak growth %.0f MiB, %.1f s", kind, tokens, out["peak_growth_mib"],
                out["timing"]["profile_s"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("streaming", "naive"))
    p.add_argument("tokens", type=int, help="calibration tokens")
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward batch")
    p.add_argument("--data", default=None, help=f"calibration text file (default {DEFAULT_DATA})")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s child %(levelname)s %(message)s", stream=sys.stderr)
    emit_child_result(child_run(args.kind, args.tokens, resolve_data(args.data), args.batch_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
