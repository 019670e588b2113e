"""Ĥ's product ``xᵀx`` (float32 sums of bfloat16 inputs, as the size planner's statistics take it): the form
``tensorstats.gram`` uses against the transposed form it replaced, on random inputs of the planner's widths.

The statistics' largest single product is a down projection's Ĥ (Qwen2.5-1.5B: 8,960 wide, one a layer a batch).
For each width and token count: seconds of :func:`compressor.engine.tensorstats.gram` (``xᵀ`` copied contiguous
once, the two bfloat16 passes added into the output in place) and of the earlier form (the same upper blocks,
each product ``x[:, a:b]ᵀ x[:, a:]`` with a transposed operand and its two passes summed into a new float32
matrix), the best of ``--repeats``; and each one's largest error against a float64 product, relative to the
largest entry. Inputs are Gaussian with column scales spread over 3 orders (Ĥ's diagonal is uneven).

    python tools/size/bench_gram.py --alone --output tools/size/results/gram_bfloat16.json

Run it alone (the timings are a 2-core machine's; oneDNN's kernels differ between CPUs).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import write_json
from tools.benchlib.cli import add_alone, tool_parser
from tools.benchlib.machine import environment
from tools.benchlib.results import command_line, utc_now


def transposed_gram(x: torch.Tensor) -> torch.Tensor:
    """The earlier form: each block a product with a transposed operand, its two passes summed into new floats."""
    d = x.shape[1]
    k = min(8, max(1, d // 256))
    edges = [round(i * d / k) for i in range(k + 1)]
    out = torch.empty(d, d, dtype=torch.float32)
    for a, b in zip(edges, edges[1:]):
        r = x[:, a:b].T @ x[:, a:]
        blk = r.float() + torch.addmm(r, x[:, a:b].T, x[:, a:], beta=-1).float()
        out[a:b, a:] = blk
        out[b:, a:b] = blk[:, b - a:].T
    return out


def best_seconds(fn, x: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(x)
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = tool_parser(__doc__)
    ap.add_argument("--widths", type=int, nargs="+", default=[1536, 8960])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None)
    add_alone(ap)
    args = ap.parse_args()
    from compressor.engine.tensorstats import gram

    g = torch.Generator().manual_seed(0)
    rows = []
    for d in args.widths:
        for n in args.tokens:
            x = (torch.randn(n, d, generator=g) * torch.logspace(-1.5, 1.5, d)).bfloat16()
            exact = x.double().T @ x.double()
            row = {"width": d, "tokens": n}
            for name, fn in (("gram", gram), ("transposed", transposed_gram)):
                s, out = best_seconds(fn, x, args.repeats)
                row[f"{name}_s"] = s
                row[f"{name}_relative_error"] = float((out.double() - exact).abs().max() / exact.abs().max())
            row["speedup"] = row["transposed_s"] / row["gram_s"]
            rows.append(row)
            print(row, flush=True)
    write_json(args.output, {"what": __doc__.split("\n")[0], "rows": rows, "ran_alone": bool(args.alone),
                             "when": utc_now(), "command": command_line(), "environment": environment()})


if __name__ == "__main__":
    main()
