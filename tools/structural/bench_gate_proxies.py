#!/usr/bin/env python
"""Which text, available offline, moves like WikiText-2 test under a cut? (issue 34)

The gate's promise failed on Gemma-3-270M: its cut cost +6.6 % on WikiText-2
test for a gate bound of +3.5 % on Python's reference prose. This tool scores
compressed outputs against their original on candidate gate texts and on
WikiText-2 test, all as the gate scores (windows starting with BOS where the
tokenizer adds one, paired by window), so each candidate's ratio to WikiText-2
test can be read off:

* ``wikitext2_test@512`` — the target (the length llama.cpp and the
  independent checks score), and ``@256`` (the gate's length);
* ``embedded@256`` / ``@512`` — the default prose domain (the gate's windows);
* ``embedded-code@256`` — the default code domain;
* ``self@256`` — text the original model writes itself from the calibration's
  one-word openings, with another seed than the calibration's (``--seed``);
  its change is the per-token KL of the compressed model from the original
  on the original's own writing.

    python tools/structural/bench_gate_proxies.py --original <gemma .gguf> /tmp/gx/out \\
        --output tools/structural/results/gate_proxies_gemma3_270m.json

Run it alone: two torch processes on 2 cores run about ten times slower.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, environment, paired_window_change, write_json

#: (name, dataset, window length)
TEXTS = (("wikitext2_test@512", "wikitext", 512), ("wikitext2_test@256", "wikitext", 256),
         ("embedded@256", "embedded", 256), ("embedded@512", "embedded", 512),
         ("embedded-code@256", "embedded-code", 256))


def window_nll(model, windows, batch_size: int = 8) -> list[float]:
    """Mean NLL of every window (each scored from its second token on)."""
    import torch

    out = []
    with torch.no_grad():
        for b in range(0, windows.shape[0], batch_size):
            x = windows[b:b + batch_size]
            logp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), -1)
            out += (-logp.gather(-1, x[:, 1:, None]).squeeze(-1).double()).mean(1).tolist()
    return out


def gate_windows(tokenizer, dataset: str, seq_len: int, tokens: int):
    """``[n, seq_len]`` ids the way the gate cuts its evaluation text (BOS at every window start when the
    tokenizer adds one)."""
    from compressor.inputs.calibration import evaluation_streams
    from compressor.recipe.schema import Recipe

    path = str(WIKITEXT_DIR / "test.txt") if dataset == "wikitext" else dataset
    recipe = Recipe.model_validate({"calibration": {"dataset": "self"}, "evaluation": [
        {"dataset": path, "seq_len": seq_len, "stride": seq_len, "max_tokens": tokens, "name": "t"}]})
    ids = evaluation_streams(recipe, tokenizer)["t"]
    n = ids.numel() // seq_len * seq_len
    return ids[:n].view(-1, seq_len)


def self_windows(model, tokenizer, seq_len: int, tokens: int, seed: int):
    """The original model's own writing: rows of ``seq_len`` ids (BOS, a one-word opening, the rest sampled)."""
    from compressor.inputs.selfcal import SelfCalSettings, generate_tokens

    prompt = 1 + (tokenizer.bos_token_id is not None)
    ids = generate_tokens(model, tokenizer, SelfCalSettings(n_tokens=tokens, seq_len=seq_len - prompt, seed=seed))
    n = ids.numel() // seq_len * seq_len
    return ids[:n].view(-1, seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outputs", nargs="+", help="compressed output folders of the same original")
    ap.add_argument("--original", required=True, help="the source model (a .gguf, pkg:NAME, a folder)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of each text")
    ap.add_argument("--seed", type=int, default=1, help="seed of the self-written text (the calibration's is 0)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args()

    import torch

    from compressor.inputs.load import load_model
    from compressor.output.hf import load_compressed

    torch.manual_seed(0)
    t0 = time.perf_counter()
    original, tokenizer, _ = load_model(args.original)
    texts = {name: gate_windows(tokenizer, ds, L, args.tokens) for name, ds, L in TEXTS}
    texts["self@256"] = self_windows(original, tokenizer, 256, args.tokens, args.seed)
    base = {name: window_nll(original, w) for name, w in texts.items()}
    del original
    rows = []
    for folder in args.outputs:
        model = load_compressed(folder).eval()
        changes = {}
        for name, w in texts.items():
            p1, p0, change, se = paired_window_change(window_nll(model, w), base[name])
            changes[name] = {"windows": int(w.shape[0]), "tokens": int(w.numel()), "ppl_original": p0,
                             "ppl_compressed": p1, "relative_change": change, "relative_change_se": se}
        target = changes["wikitext2_test@512"]["relative_change"]
        for c in changes.values():
            c["wikitext_ratio"] = target / c["relative_change"] if c["relative_change"] > 0 else None
        rows.append({"output": str(Path(folder).resolve()), "changes": changes})
        print(f"{folder}:", file=sys.stderr)
        for name, c in changes.items():
            print(f"  {name:>20} {100 * c['relative_change']:+6.2f} % ± {100 * (c['relative_change_se'] or math.nan):.2f}"
                  f"  WikiText@512 / this: {c['wikitext_ratio'] or math.nan:.2f}", file=sys.stderr)
        del model
    write_json(args.output, {"original": args.original, "tokens": args.tokens, "self_seed": args.seed,
                             "outputs": rows, "seconds": time.perf_counter() - t0, "environment": environment()})


if __name__ == "__main__":
    main()
