"""Perplexity of GGUF files on a text, in llama.cpp alone (compressor is not imported).

The independent check of a GGUF output: an unmodified llama.cpp (llama-cpp-python)
tokenizes the text itself and scores non-overlapping windows; the relative change
of every file after the first is against the first.

    python tools/llamacpp_perplexity.py ORIGINAL.gguf COMPRESSED.gguf \\
        --text ../shared/data/wikitext-2/test.txt --windows 32 --output result.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np


def perplexity(path: str, text: str, seq_len: int, windows: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=seq_len, logits_all=True, verbose=False, n_threads=threads,
                          n_batch=seq_len)
    toks = llm.tokenize(text.encode("utf-8"), add_bos=False)[: windows * seq_len]
    nll, n, t0, per_window = 0.0, 0, time.perf_counter(), []
    for start in range(0, len(toks) - seq_len + 1, seq_len):
        win = toks[start : start + seq_len]
        llm.reset()
        llm.eval(win)
        logits = np.asarray(llm.scores[: len(win)], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        w = -float(logp[np.arange(len(win) - 1), win[1:]].sum())
        per_window.append(w / (len(win) - 1))
        nll += w
        n += len(win) - 1
    return {"file": path, "ppl": math.exp(nll / n), "scored_tokens": n, "seconds": time.perf_counter() - t0,
            "llama_cpp_python": llama_cpp.__version__, "window_nll": per_window}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+", help="GGUF files; the first is the reference")
    ap.add_argument("--text", required=True, help="UTF-8 text file (e.g. WikiText-2 test)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    args = ap.parse_args()
    text = open(args.text, encoding="utf-8").read()
    rows = [perplexity(p, text, args.seq_len, args.windows, args.threads) for p in args.gguf]
    for r in rows[1:]:
        r["relative_change"] = r["ppl"] / rows[0]["ppl"] - 1
        d = [a - b for a, b in zip(r["window_nll"], rows[0]["window_nll"], strict=True)]
        if len(d) > 1:  # paired by window: the SE of the mean NLL difference, times the perplexity ratio
            mean = sum(d) / len(d)
            se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) * (len(d) - 1)))
            r["relative_change_se"] = se * r["ppl"] / rows[0]["ppl"]
    result = {"text": args.text, "seq_len": args.seq_len, "windows": args.windows, "results": rows}
    print(json.dumps(result, indent=2))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
