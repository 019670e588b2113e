#!/usr/bin/env python
"""Where a pruned FFN's decoding time goes in transformers (CPU): one FFN, one token at a time.

Decoding runs every FFN on a single token, so a step is a few matrix-vector
products plus per-call overhead. This times, per call, SmolLM2's original
``LlamaMLP`` (d 576, width 1536) against compressor's ``HiddenUnitFFN`` (gate
and up rows fused into one projection, a biased output projection) at the same
width and at widths a pruned model has — equal widths, multiples of 32, odd
widths — and against the same fused module with its gate/up halves kept in
separate projections, so each difference is one cause. Interleaved rounds,
medians, ratios from one run.

    python tools/speed/bench_ffn_decode.py             # → tools/speed/results/bench_ffn_decode.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import environment, interleaved, quiet_offline_env, write_json

quiet_offline_env()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from compressor.core.modeling import HiddenUnitFFN  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"

D, WIDTH = 576, 1536


class SplitFFN(nn.Module):
    """HiddenUnitFFN's computation with separate gate and up projections (as LlamaMLP has them)."""

    def __init__(self, units: int, bias: bool) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(D, units, bias=False), nn.Linear(D, units, bias=False)
        self.down = nn.Linear(units, D, bias=bias)

    def forward(self, x):
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def variants() -> dict[str, nn.Module]:
    cfg = LlamaConfig(hidden_size=D, intermediate_size=WIDTH, hidden_act="silu", mlp_bias=False)
    out = {"LlamaMLP 1536": LlamaMLP(cfg)}
    for w in (1536, 1504, 1524, 1152):
        out[f"HiddenUnitFFN {w}"] = HiddenUnitFFN(D, D, w, "silu", True, False, False)
    out["split, biased down 1536"] = SplitFFN(1536, True)
    out["split, no bias 1536"] = SplitFFN(1536, False)
    out["split, biased down 1524"] = SplitFFN(1524, True)
    return {k: v.eval() for k, v in out.items()}


@torch.no_grad()
def per_call_us(module: nn.Module, calls: int) -> float:
    x = torch.randn(1, 1, D)
    for _ in range(20):
        module(x)
    t = time.perf_counter()
    for _ in range(calls):
        module(x)
    return 1e6 * (time.perf_counter() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--output", default=str(RESULTS_DIR / "bench_ffn_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mods = variants()
    times = interleaved(mods, lambda m: per_call_us(m, args.calls), args.rounds)
    base = statistics.median(times["LlamaMLP 1536"])
    rows = {name: {"median_us_per_call": statistics.median(t), "vs_llama_mlp": statistics.median(t) / base,
                   "rounds_us": t} for name, t in times.items()}
    write_json(args.output, {"schema": "compressor.bench_ffn_decode/v1", "environment": environment(),
                             "run_alone": True, "args": vars(args), "d": D, "variants": rows})
    for name, r in rows.items():
        print(f"{name:28s} {r['median_us_per_call']:8.1f} us/call  {r['vs_llama_mlp']:.3f}x LlamaMLP")


if __name__ == "__main__":
    main()
