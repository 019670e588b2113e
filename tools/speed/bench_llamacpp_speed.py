#!/usr/bin/env python
"""Speed in llama.cpp: an original GGUF against compressed GGUFs at the same quantization and threads.

Prefill: one 512-token batch into an empty context. Decode: 128 tokens, one
llama.cpp call per token (fixed token ids, so sampling costs nothing and is
the same for every file). Rounds are interleaved (A B C A B C …) and the
medians compared, so machine noise hits every file alike; every file stays
loaded for the whole run.

Targets (issue: speed in a real runtime): decode speed-up ≥ 0.9 × the ratio of
the weight bytes a decoding step reads (every tensor but a separate token
embedding, which is a row lookup), prefill speed-up ≥ 0.9 × the ratio of
multiply-adds per token (weight matrices, plus attention over the average
context). Both ratios are read from the files, not assumed. gguf-py reads the
tensor table; llama.cpp (llama-cpp-python) runs the files. compressor is not
imported.

    python tools/speed/bench_llamacpp_speed.py ORIGINAL.gguf COMPRESSED.gguf [MORE.gguf] \\
        --label original default cut20 --output tools/speed/results/llamacpp_speed_smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import environment, utc_now, write_json


def weight_stats(path: str, context: int) -> dict:
    """Bytes a decoding step reads and multiply-adds per token (at an average context of ``context``)."""
    import gguf

    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    tied = "output.weight" not in tensors
    read, macs = 0, 0
    for name, t in tensors.items():
        if name == "token_embd.weight" and not tied:
            continue  # a lookup of one row per token
        read += int(t.n_bytes)
        if len(t.shape) == 2:
            macs += int(t.shape[0]) * int(t.shape[1])
    f = r.fields
    n_layer = int(f[f"{arch}.block_count"].parts[-1][0])
    d = int(f[f"{arch}.embedding_length"].parts[-1][0])
    attn = 2 * n_layer * d * context  # q·k and the weighted sum of v, per token (all heads together)
    return {"architecture": arch, "weight_bytes_read_per_token": read, "matmul_macs_per_token": macs + attn,
            "attention_macs_per_token": attn, "file_bytes": int(sum(t.n_bytes for t in r.tensors))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+", help="GGUF files; the first is the reference")
    ap.add_argument("--label", nargs="+", default=None)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    labels = args.label or [f"file{i}" for i in range(len(args.gguf))]
    if len(labels) != len(args.gguf):
        raise SystemExit("--label needs one label per file")

    import llama_cpp

    n_ctx = args.prefill + args.decode + 8
    llms = {lab: llama_cpp.Llama(model_path=p, n_ctx=n_ctx, n_batch=args.prefill, n_threads=args.threads,
                                 n_threads_batch=args.threads, verbose=False) for lab, p in zip(labels, args.gguf)}
    vocab = min(llm.n_vocab() for llm in llms.values())
    prompt = [(17 + 7919 * i) % vocab for i in range(args.prefill)]
    steps = [(29 + 104729 * i) % vocab for i in range(args.decode)]

    def measure(llm) -> tuple[float, float]:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill = args.prefill / (time.perf_counter() - t)
        t = time.perf_counter()
        for tok in steps:
            llm.eval([tok])
        return prefill, args.decode / (time.perf_counter() - t)

    for llm in llms.values():  # warm-up: page the weights in, build the graphs
        measure(llm)
    runs: dict[str, list[tuple[float, float]]] = {lab: [] for lab in labels}
    for _ in range(args.rounds):
        for lab, llm in llms.items():
            runs[lab].append(measure(llm))
    stats = {lab: weight_stats(p, args.prefill // 2) for lab, p in zip(labels, args.gguf)}
    ref = labels[0]
    rows = {}
    for lab in labels:
        pre = statistics.median(r[0] for r in runs[lab])
        dec = statistics.median(r[1] for r in runs[lab])
        rows[lab] = {"file": args.gguf[labels.index(lab)], **stats[lab], "prefill_tok_s": pre, "decode_tok_s": dec,
                     "rounds": [{"prefill_tok_s": a, "decode_tok_s": b} for a, b in runs[lab]]}
    ref_pre, ref_dec = rows[ref]["prefill_tok_s"], rows[ref]["decode_tok_s"]
    for lab in labels[1:]:
        r = rows[lab]
        bytes_ratio = stats[ref]["weight_bytes_read_per_token"] / r["weight_bytes_read_per_token"]
        macs_ratio = stats[ref]["matmul_macs_per_token"] / r["matmul_macs_per_token"]
        r.update(decode_speedup=r["decode_tok_s"] / ref_dec, prefill_speedup=r["prefill_tok_s"] / ref_pre,
                 weight_bytes_ratio=bytes_ratio, macs_ratio=macs_ratio)
        r["decode_target_met"] = r["decode_speedup"] >= 0.9 * bytes_ratio
        r["prefill_target_met"] = r["prefill_speedup"] >= 0.9 * macs_ratio
    write_json(args.output, {
        "schema": "compressor.bench_llamacpp_speed/v1", "when": utc_now(), "environment": environment(),
        "run_alone": True, "llama_cpp_python": llama_cpp.__version__, "args": vars(args), "reference": ref,
        "targets": "decode_speedup >= 0.9 x weight_bytes_ratio; prefill_speedup >= 0.9 x macs_ratio",
        "files": rows,
    })
    for lab in labels:
        r = rows[lab]
        extra = "" if lab == ref else (f"  decode x{r['decode_speedup']:.3f} (bytes x{r['weight_bytes_ratio']:.3f}), "
                                       f"prefill x{r['prefill_speedup']:.3f} (MACs x{r['macs_ratio']:.3f})")
        print(f"{lab:12s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:6.1f} tok/s{extra}")


if __name__ == "__main__":
    main()
