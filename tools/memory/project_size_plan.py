#!/usr/bin/env python
"""What a GGUF size plan of a public model needs, from the memory and time models and the measured runs.

Memory: :func:`compressor.engine.memory.size_components` (onloaded and held in memory). Disk: what the run writes
beside its output (the converter's F16, llama.cpp's preset, the spilled input moments, the planned file).
Time: each part's work (:func:`compressor.engine.memory.size_work`, floating-point operations) over the throughput
that part reached in a measured run (``tools/memory/results/size_memory_*.json``: the random-weight Llama shapes
planned with ``model.offload: disk``). Each measured run gives its own projection; their spread is the model's
error at the shapes measured. Times are for the CPU the runs were measured on (2 cores); no GPU was measured, so
a GPU's time is not projected.

    python tools/memory/project_size_plan.py        # → tools/memory/results/size_projection.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import write_json

from compressor.engine.memory import layer_params, size_components, size_work

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: Public shapes (hidden, FFN, layers, vocabulary, heads, KV heads).
MODELS = {
    "Llama-3.2-3B": (3072, 8192, 28, 128256, 24, 8),
    "Qwen2.5-7B": (3584, 18944, 28, 152064, 28, 4),
    "Llama-3.1-8B": (4096, 14336, 32, 128256, 32, 8),
    "Llama-3.3-70B": (8192, 28672, 80, 128256, 64, 8),
    "Llama-3.1-405B": (16384, 53248, 126, 128256, 128, 8),
}
Q4_K_M_BPW = 4.9  # about what llama.cpp's Q4_K_M averages over a Llama's tensors
PARTS = {"statistics": "statistics_s", "pricing": "pricing_s", "rounding": "compensated_rounding_s"}


def _params(d: int, ff: int, layers: int, vocab: int, heads: int, kv: int) -> int:
    """Every weight: the decoder layers, an untied embedding and head, the final norm."""
    return layers * layer_params(d, ff, heads, kv) + 2 * vocab * d + d


def throughputs(paths: list[Path]) -> dict[str, dict[str, float]]:
    """Floating-point operations a second each part reached in each measured onloaded run."""
    out = {}
    for p in paths:
        r = json.loads(p.read_text())
        run, s = r.get("modes", {}).get("disk"), r.get("shape")
        if not run or not run.get("timings") or run.get("exit_code") != 0 or not s:
            continue
        work = size_work(d=s["hidden"], ff=s["ffn"], layers=s["layers"], vocab=s["vocab"],
                         tokens=r["calibration_tokens"], heads=s["heads"], kv_heads=s["kv_heads"])
        out[p.name] = {part: work[part] / run["timings"][key] for part, key in PARTS.items()
                       if run["timings"].get(key)}
        out[p.name]["ran_alone"] = r.get("ran_alone")
    return out


def project(tokens: int, rates: dict[str, dict[str, float]]) -> dict:
    rows = {}
    for name, (d, ff, layers, vocab, heads, kv) in MODELS.items():
        shape = dict(d=d, ff=ff, layers=layers, vocab=vocab, heads=heads, kv_heads=kv)
        params = _params(d, ff, layers, vocab, heads, kv)
        work = size_work(tokens=tokens, **shape)
        file = int(params * Q4_K_M_BPW / 8)
        rows[name] = {
            "params": params,
            "memory_onloaded_bytes": size_components(tokens=tokens, offload="disk", **shape)["peak"],
            "memory_in_memory_bytes": size_components(tokens=tokens, offload="none", **shape)["peak"],
            "disk_bytes": {"f16": 2 * params, "preset": file, "moments": layers * (3 * d * d + ff * ff) * 4,
                           "file": file},
            "work_flop": work,
            "cpu_hours": {run: {part: work[part] / rate[part] / 3600 for part in PARTS if part in rate}
                          for run, rate in rates.items()},
        }
        rows[name]["disk_bytes"]["total"] = sum(rows[name]["disk_bytes"].values())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="calibration tokens of the projected runs")
    ap.add_argument("--measured", nargs="+", type=Path,
                    default=sorted(RESULTS_DIR.glob("size_memory_[0-9]*b.json")))
    ap.add_argument("--output", type=Path, default=RESULTS_DIR / "size_projection.json")
    args = ap.parse_args()
    rates = throughputs(args.measured)
    if not rates:
        raise SystemExit("no measured onloaded run with timings among " + ", ".join(map(str, args.measured)))
    result = {"what": "GGUF size plan (Q4_K_M's size) of public shapes, projected: memory and disk from the "
                      "memory model, CPU hours from each measured run's throughput per part (their spread is the "
                      "model's error); GPU time not projected (no GPU was measured)",
              "calibration_tokens": args.tokens, "throughput_flop_per_s": rates, "models": project(args.tokens, rates)}
    write_json(args.output, result)
    for name, row in result["models"].items():
        hours = {run: round(sum(h.values()), 1) for run, h in row["cpu_hours"].items()}
        print(f"{name}: onloaded {row['memory_onloaded_bytes'] / 1e9:.1f} GB, disk "
              f"{row['disk_bytes']['total'] / 1e9:.0f} GB, CPU hours (statistics + pricing + rounding) {hours}")


if __name__ == "__main__":
    main()
