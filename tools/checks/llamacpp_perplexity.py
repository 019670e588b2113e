"""Perplexity of GGUF files on a text, in llama.cpp alone (compressor is not imported).

The independent check of a GGUF output: an unmodified llama.cpp (llama-cpp-python)
tokenizes the text itself and scores non-overlapping windows; the relative change
of every file after the first is against the first.

    python tools/checks/llamacpp_perplexity.py ORIGINAL.gguf COMPRESSED.gguf \\
        --text ../shared/data/wikitext-2/test.txt --windows 32 --output result.json [--kld]

``--kld``: also the KL divergence of every file's next-token distribution from the first file's, token by
token over the same windows, as ``llama-perplexity --kl-divergence`` reports it — mean (with its SE over
windows), median, 99th and 99.9th percentiles (``p99``, ``p99_9``: its "99.0%" and "99.9%"), and the
same-top-token rate. The first file's log-probabilities are kept on disk (float16, one file a window, in a
temporary folder removed after) while the others are scored. ``--reference-dir DIR`` keeps them in DIR instead,
with the first file's row: a later call with the same first file, text and windows reuses them and scores only
the other files (a benchmark then scores each new file once).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import tempfile
import time

import numpy as np


def perplexity(path: str, text: str, seq_len: int, windows: int, threads: int, kld: KLD | None = None) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=seq_len, logits_all=True, verbose=False, n_threads=threads,
                          n_batch=seq_len)
    toks = llm.tokenize(text.encode("utf-8"), add_bos=False)[: windows * seq_len]
    nll, n, t0, per_window = 0.0, 0, time.perf_counter(), []
    for i, start in enumerate(range(0, len(toks) - seq_len + 1, seq_len)):
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
        if kld is not None:
            kld.window(i, logp[: len(win) - 1])
    out = {"file": path, "ppl": math.exp(nll / n), "scored_tokens": n, "seconds": time.perf_counter() - t0,
           "llama_cpp_python": llama_cpp.__version__, "window_nll": per_window}
    if kld is not None and not kld.is_reference:
        out["kld"] = kld.summary()
    return out


class KLD:
    """KL(reference ‖ file) per token: the reference's log-probabilities are saved window by window while it
    is scored (:attr:`is_reference`), then every later file's are compared with them."""

    def __init__(self, folder: str) -> None:
        self.folder, self.is_reference = folder, True
        self.per_token: list[np.ndarray] = []
        self.top_same: list[np.ndarray] = []

    def next_file(self) -> None:
        self.is_reference, self.per_token, self.top_same = False, [], []

    def window(self, i: int, logp: np.ndarray) -> None:
        path = os.path.join(self.folder, f"ref-{i}.npy")
        if self.is_reference:
            np.save(path, logp.astype(np.float16))
            return
        ref = np.load(path).astype(np.float64)
        self.per_token.append((np.exp(ref) * (ref - logp)).sum(axis=1))
        self.top_same.append(ref.argmax(axis=1) == logp.argmax(axis=1))

    def summary(self) -> dict:
        tokens = np.concatenate(self.per_token)
        means = np.array([w.mean() for w in self.per_token])
        se = float(means.std(ddof=1) / math.sqrt(len(means))) if len(means) > 1 else None
        return {"mean": float(tokens.mean()), "mean_se": se, "median": float(np.median(tokens)),
                "p99": float(np.quantile(tokens, 0.99)), "p99_9": float(np.quantile(tokens, 0.999)),
                "max": float(tokens.max()),
                "same_top_token": float(np.concatenate(self.top_same).mean()), "tokens": int(tokens.size)}


def reference_identity(path: str, text: str, seq_len: int, windows: int) -> dict:
    """What a kept reference was scored from: the file (path, bytes, modification time) and the text and windows."""
    st = os.stat(path)
    return {"file": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "seq_len": seq_len,
            "windows": windows, "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}


def score_all(args, text: str, folder: str) -> list[dict]:
    """Every file's row; the first file's taken from ``folder`` when it was kept there for the same inputs."""
    kld = KLD(folder) if args.kld else None
    kept = os.path.join(folder, "reference.json")
    ident = reference_identity(args.gguf[0], text, args.seq_len, args.windows)
    rows = []
    if args.reference_dir and os.path.exists(kept):
        saved = json.load(open(kept))
        if saved["identity"] == ident and (saved["kld"] or not args.kld):
            rows.append(saved["row"])
            if kld is not None:
                kld.next_file()
    for p in args.gguf[len(rows):]:
        rows.append(perplexity(p, text, args.seq_len, args.windows, args.threads, kld))
        if len(rows) == 1 and args.reference_dir:
            with open(kept, "w") as f:
                json.dump({"identity": ident, "kld": bool(args.kld), "row": rows[0]}, f)
        if kld is not None:
            kld.next_file()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+", help="GGUF files; the first is the reference")
    ap.add_argument("--text", required=True, help="UTF-8 text file (e.g. WikiText-2 test)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None, help="write the result as JSON here")
    ap.add_argument("--kld", action="store_true", help="also the KL divergence from the first file, token by token")
    ap.add_argument("--reference-dir", default=None,
                    help="keep the first file's scores here and reuse them when called again with the same inputs")
    args = ap.parse_args()
    text = open(args.text, encoding="utf-8").read()
    if args.reference_dir:
        os.makedirs(args.reference_dir, exist_ok=True)
        rows = score_all(args, text, args.reference_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="llamacpp-kld-") as folder:
            rows = score_all(args, text, folder)
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
