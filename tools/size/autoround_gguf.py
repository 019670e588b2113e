"""AutoRound's GGUF export of a Hugging Face folder, calibrated on a given text: the baseline a user would
reach for instead of compressor's size planner (``auto-round`` on PyPI, Intel; SignRound: each block's
rounding offsets and clipping tuned by signed gradient descent, then written by its own GGUF exporter).

Runs in an environment with ``auto-round`` installed; it never imports compressor, so its file owes
nothing to compressor's code::

    python -m venv /tmp/ar && /tmp/ar/bin/pip install torch==2.13.0 auto-round==0.15.1
    /tmp/ar/bin/python tools/size/autoround_gguf.py --model /tmp/offgrid-smollm2 --text cal.txt \\
        --format gguf:q4_k_m --iters 50 --output /tmp/work/autoround-Q4_K_M.gguf

The calibration is the first ``--tokens`` tokens of ``--text`` in windows of ``--seq-len`` (the same
tokens ``llama-imatrix`` and compressor read in ``tools/size/bench_size_frontier.py``). ``--iters 0`` is
AutoRound's tuning-free path (its own importance-weighted round to nearest); its default is 200. The
seconds AutoRound took (load, tune, export) are written beside the file as ``<output>.json``.

auto-round 0.15.1's bundled converter for qwen2 reads ``gguf.MODEL_ARCH.DFLASH``, which the newest ``gguf`` on PyPI
(0.19.0) lacks: for a Qwen model put llama.cpp's own ``gguf-py`` first (``PYTHONPATH=<llama.cpp>/gguf-py``), as the
off-grid Qwen2.5-Coder-1.5B runs did; llama models convert with the installed ``gguf``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face folder")
    ap.add_argument("--text", required=True, help="calibration text file")
    ap.add_argument("--format", required=True, help="AutoRound's GGUF format, e.g. gguf:q4_k_m, gguf:q2_k_s")
    ap.add_argument("--iters", type=int, default=200, help="SignRound steps per block (0: no tuning)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=None, help="AutoRound's learning rate (default 1/iters)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--compile", action="store_true", help="AutoRound's torch.compile (off: no C++ build per shape)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", required=True, help="the .gguf to write")
    args = ap.parse_args()
    out = Path(args.output)
    if out.exists():
        raise SystemExit(f"{out} exists; remove it first")
    import torch

    torch.set_num_threads(args.threads)
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ids = tok(Path(args.text).read_text(encoding="utf-8")).input_ids
    n = args.tokens // args.seq_len
    if len(ids) < n * args.seq_len:
        raise SystemExit(f"{args.text} has {len(ids)} tokens; --tokens {args.tokens} needs more text")
    windows = torch.tensor(ids[: n * args.seq_len]).reshape(n, args.seq_len)
    dataset = [windows[i:i + 1] for i in range(n)]  # one window per item: AutoRound batches them itself
    ar = AutoRound(model, tokenizer=tok, scheme=args.format, dataset=dataset, iters=args.iters, nsamples=n,
                   seqlen=args.seq_len, batch_size=args.batch_size, device_map="cpu", lr=args.lr,
                   enable_torch_compile=args.compile)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        ar.quantize_and_save(tmp, format=args.format)
        written = sorted(Path(tmp).rglob("*.gguf"))
        if len(written) != 1:
            raise SystemExit(f"AutoRound wrote {[str(p) for p in written]}; expected one .gguf")
        part = out.with_suffix(".gguf.part")
        shutil.move(written[0], part)
        os.replace(part, out)
    seconds = time.perf_counter() - t0
    import auto_round

    sidecar = out.with_suffix(".json.part")
    sidecar.write_text(json.dumps({
        "format": args.format, "iters": args.iters, "tokens": n * args.seq_len, "seq_len": args.seq_len,
        "lr": args.lr, "compile": args.compile, "batch_size": args.batch_size, "auto_round": auto_round.__version__, "seconds": seconds,
        "bytes": out.stat().st_size}, indent=2) + "\n")
    os.replace(sidecar, out.with_suffix(".json"))
    print(f"{out}: {out.stat().st_size / 1e6:.1f} MB in {seconds:.0f} s")


if __name__ == "__main__":
    main()
