#!/usr/bin/env python
"""The heavy pieces of pass A and of the gate's re-solves, at one block of a given shape.

Synthetic statistics of a gated FFN (SwiGLU-like hidden units of random
weights; the shapes are what costs, not the values) at Qwen2.5-Coder-1.5B's
shapes by default (d 1,536, 8,960 hidden units, 16,384 calibration tokens):

* ``statistics_chunk_s``: one ``Moments.update`` of 2,048 rows of ``[x, h]``
  (10,496 columns), and ``gram_s`` / ``full_product_s`` for the symmetric
  product alone, blocked against one full matrix product;
* ``obs_path_s``: the hidden-unit removal path over every unit (step 64);
* ``refit_s``: ``solve_affine`` on 8,192 kept units as the gate re-solves them,
  with the rank check from the Cholesky factor (the default from 2,048 inputs)
  and with the check on every eigenvalue (``FAST_RANK_CHECK_FROM`` raised);
* ``cholesky_s``, ``eigvalsh_s``, ``eigh_s`` of the 8,960-unit correlation, for
  scale (``eigh`` is what the rank check computed before it read only
  eigenvalues, or only the extreme ones).

Run it alone: two torch processes on two cores distort every number.

    python tools/structural/bench_pass_a_pieces.py --output tools/structural/results/bench_pass_a_pieces.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import environment, utc_now, write_json

import torch  # noqa: E402

import compressor.fitting.solve as solve  # noqa: E402
from compressor.core.stats import Moments, gram  # noqa: E402
from compressor.fitting.obs import obs_path  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=1536)
    ap.add_argument("--d-ff", type=int, default=8960)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--kept", type=int, default=8192)
    ap.add_argument("--output", default=str(RESULTS_DIR / "bench_pass_a_pieces.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    d, dff, chunk = args.d, args.d_ff, 2048
    w_gate, w_up = torch.randn(d, dff) / d**0.5, torch.randn(d, dff) / d**0.5
    w_down = torch.randn(dff, d) / dff**0.5

    def rows(n: int):
        x = torch.randn(n, d)
        h = torch.nn.functional.silu(x @ w_gate) * (x @ w_up)
        return x, h, h @ w_down

    out = {"schema": "compressor.bench_pass_a_pieces/v1", "date": utc_now(), "environment": environment(),
           "run_alone": True, "args": vars(args), "threads": torch.get_num_threads()}
    x, h, y = rows(chunk)
    z = torch.cat([x, h], 1)
    zc = z - z.mean(0)
    out["full_product_s"], _ = timed(lambda: zc.T @ zc)
    out["gram_s"], _ = timed(lambda: gram(zc))
    m = Moments(d + dff, d)
    m.update(z, y)  # the first chunk allocates the sums
    out["statistics_chunk_s"], _ = timed(lambda: m.update(z, y))
    del m, z, zc

    held_tokens = args.tokens // 8
    fit, held = Moments(dff, d), Moments(dff, d)
    for start in range(0, args.tokens, chunk):
        _, h, y = rows(chunk)
        (fit if start < args.tokens - held_tokens else held).update(h, y)
    out["obs_path_s"], path = timed(lambda: obs_path(fit, held, 0, step=64))
    out["obs_path_steps"] = len(path.sizes) - 1

    sub = solve.subset(fit, path.kept(args.kept))
    out["refit_s"] = {"extreme_eigenvalues": timed(lambda: solve.solve_affine(sub))[0]}
    default_from = solve.FAST_RANK_CHECK_FROM
    solve.FAST_RANK_CHECK_FROM = 10**9
    try:
        out["refit_s"]["all_eigenvalues"] = timed(lambda: solve.solve_affine(sub))[0]
    finally:
        solve.FAST_RANK_CHECK_FROM = default_from
    c = fit.cxx / fit.n
    s = c.diagonal().sqrt()
    corr = c / s[:, None] / s[None, :]
    out["cholesky_s"], _ = timed(lambda: torch.linalg.cholesky_ex(corr))
    out["eigvalsh_s"], _ = timed(lambda: torch.linalg.eigvalsh(corr))
    out["eigh_s"], _ = timed(lambda: torch.linalg.eigh(corr))
    write_json(args.output, out)
    print({k: v for k, v in out.items() if k not in ("environment", "args")})


if __name__ == "__main__":
    main()
