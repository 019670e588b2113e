"""compressor on a CUDA device, checked against the same run on the CPU.

The recipes say "use model.device: cuda on a GPU"; this is the check that it holds. For tiny models
built from configs (no downloads), each search is run twice with ``compressor run`` — once with
``model.device: cuda`` (and once more with ``model.offload: cpu``, layers waiting in host RAM), once
on the CPU — and the outputs are compared:

* the run's outcome: exit code, blocks kept and their widths, the gate's change on every domain;
* the saved weights, tensor by tensor (``allclose``);
* the outputs loaded in plain transformers (compressor not importable), logits on the same ids.

Size runs (``output.size``: a GGUF at Q4_K_M's size, a compressed-tensors checkpoint at W4A16's) are checked
the same way on a wider tiny model whose rows take the k-quants and 128-wide groups: the statistics (the loss
gradients F and input moments Ĥ) come from the model's device, pricing and rounding from them on the CPU.
Compared: the plan (every tensor's type, the predicted loss), the measured change of the written file on every
gate domain (in llama.cpp for the GGUF), and the file itself (bytes that differ; logits in plain transformers
for the compressed-tensors checkpoint). Ĥ summed in another order can turn a GPTQ near-tie the other way,
so the JSON gives the share of differing bytes rather than failing on it. The GGUF size run is also made
onloaded (``model.offload: disk`` on the CPU, ``cpu`` on the GPU: one layer's weights at a time), whose file
on the same device is the one the run holding the model writes, byte for byte.

Float32 on both sides; the matrix products on the GPU run without TF32 (PyTorch's default for
float32 matmuls), so the differences are summation order. Choices are discrete (the search picks
widths from measured changes), so a choice may flip where two candidates are within that noise:
the JSON lists any such difference instead of failing on it.

    python tools/checks/gpu_check.py --work /tmp/gpu-check --output tools/checks/results/gpu_check.json

Needs a CUDA device; exits 2 without one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]  # this checkout's compressor; the tests' tiny models

SEARCHES = {
    # the default: prune, allocate (bisection on one global cut), gated on prose and code
    "allocate-prune": {"replacement": {"kind": "prune"}},
    # whole-block affine swaps, the greedy search
    "greedy-affine": {"replacement": {"kind": "affine"}, "policy": {"threshold": -100}},
}
DEVICES = {"cpu": {"device": "cpu"}, "cuda": {"device": "cuda"}, "cuda-offload-cpu": {"device": "cuda", "offload": "cpu"}}
#: Where a size run may also run onloaded: a GGUF size streams one layer at a time (``model.offload``), on the CPU
#: from disk and on the GPU from host RAM; a compressed-tensors size is planned in memory.
SIZE_DEVICES = {"gguf": {"cpu": DEVICES["cpu"], "cpu-offload-disk": {"device": "cpu", "offload": "disk"},
                         "cuda": DEVICES["cuda"], "cuda-offload-cpu": DEVICES["cuda-offload-cpu"]},
                "compressed-tensors": {"cpu": DEVICES["cpu"], "cuda": DEVICES["cuda"]}}

#: Size runs: the file users ship at a byte budget.
SIZES = {
    "size-gguf-Q4_K_M": {"output": {"size": "Q4_K_M", "formats": ["gguf"]}, "file": "model.gguf"},
    "size-ctensors-W4A16": {"output": {"size": "W4A16", "formats": ["compressed-tensors"]}, "file": None},
}
#: The size runs' tiny model: every row a multiple of 256 (k-quant super-blocks) and of 128 (W4A16 groups).
SIZE_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64}

LOGITS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
torch.manual_seed(0)
ids = torch.randint(3, 120, (2, 48))  # the tiny tokenizer's vocabulary is 128
out = {}
for name in sys.argv[1:]:
    m = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, trust_remote_code=True).eval()
    with torch.no_grad():
        out[name] = m(ids).logits.double().tolist()
print(json.dumps(out))
"""


def recipe(source: Path, out: Path, search: dict, device: dict) -> dict:
    r = {
        "model": {"source": str(source), **device},
        "calibration": {"dataset": "embedded", "max_tokens": 4096, "seq_len": 64},
        "evaluation": [{"dataset": d, "max_tokens": 2048, "seq_len": 64, "stride": 64}
                       for d in ("embedded", "embedded-code")],
        "policy": {"ppl_budget": 0.5, **search.get("policy", {})},
        "measure": {"cache": False},
        "output": {"path": str(out), "formats": ["hf"], "dtype": "float32"},
    }
    if "replacement" in search:
        r["replacement"] = search["replacement"]
    else:  # a size run: tensor types only, under an explicit budget so that the file is written and compared
        r["policy"] = {"ppl_budget": 5.0}
        r["output"] = {"path": str(out), **search["output"]}
    return r


def size_source(folder: Path, model_type: str) -> Path:
    """A tiny ``model_type`` of :data:`SIZE_SHAPE` with a byte-level BPE tokenizer trained on the embedded text
    (one the GGUF writer carries), saved as a Hugging Face folder."""
    import torch
    import transformers
    from tiny import byte_level_tokenizer

    from compressor.inputs.data import _embedded_documents

    tok = byte_level_tokenizer("\n".join(_embedded_documents("calibration")), vocab_size=512)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type](
        vocab_size=len(tok), max_position_embeddings=256, **SIZE_SHAPE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(source: Path, work: Path, name: str, search: dict, device: dict) -> dict:
    import yaml

    out = work / f"out-{name}"
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe(source, out, search, device)))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "compressor", "run", str(path), "--set", "output.overwrite=true",
                        "--quiet", "--verbose"], cwd=REPO_ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])))
    seconds = time.perf_counter() - t0
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    domains = {d["name"]: d.get("relative_delta") for d in (report.get("evaluation") or {}).get("domains", [])}
    row = {"exit_code": p.returncode, "seconds": seconds, "out": str(out), "stderr_tail": p.stderr[-1500:],
           "kept": {str(b["index"]): b.get("size") for b in report.get("blocks", []) if b["decision"] == "kept"},
           "gate": domains, "ppl_final": (report.get("perplexity") or {}).get("final", {}).get("ppl")}
    plan = report.get("size_plan")
    if plan:
        row["plan"] = {"types": {t["tensor"]: t["type"] for t in plan.get("tensors", [])},
                       "predicted_nll_increase": plan.get("predicted_nll_increase"),
                       "tensor_bytes": plan.get("tensor_bytes")}
        row["gate"] = {d["name"]: d.get("relative_change")
                       for check in (report.get("verification") or {}).values() if isinstance(check, dict)
                       for d in check.get("domains") or []}
    return row


def size_diff(ref: dict, other: dict, file: str | None) -> dict:
    """Two size runs' plans and files compared: tensors whose type differs, the predicted loss, and the share of
    the file's bytes (``file``) or of its tensors' elements that differ."""
    a, b = ref["plan"], other["plan"]
    out = {"same_types": a["types"] == b["types"],
           "types_differ": sorted(k for k in a["types"] if a["types"][k] != b["types"].get(k)),
           "predicted_nll_relative_difference": abs(a["predicted_nll_increase"] - b["predicted_nll_increase"])
           / max(abs(a["predicted_nll_increase"]), 1e-12),
           "same_tensor_bytes": a["tensor_bytes"] == b["tensor_bytes"]}
    if file is not None:
        x, y = (Path(r["out"], file).read_bytes() for r in (ref, other))
        out["file_bytes"] = [len(x), len(y)]
        if len(x) == len(y):
            import numpy as np

            out["differing_bytes_share"] = float((np.frombuffer(x, np.uint8) != np.frombuffer(y, np.uint8)).mean())
    else:
        from safetensors.torch import load_file

        ta, tb = ({k: v for f in sorted(Path(r["out"]).glob("*.safetensors")) for k, v in load_file(f).items()}
                  for r in (ref, other))
        out["same_tensors"] = ta.keys() == tb.keys() and all(ta[k].shape == tb[k].shape for k in ta)
        if out["same_tensors"]:
            out["differing_elements_share"] = (sum(int((ta[k] != tb[k]).sum()) for k in ta)
                                               / max(sum(ta[k].numel() for k in ta), 1))
    return out


def weights_diff(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    ta, tb = tensors(a), tensors(b)
    if ta.keys() != tb.keys() or any(ta[k].shape != tb[k].shape for k in ta):
        return {"same_tensors": False}
    worst = max(((ta[k] - tb[k]).abs().max().item() / max(ta[k].abs().max().item(), 1e-12), k) for k in ta)
    return {"same_tensors": True, "worst_relative": worst[0], "worst_tensor": worst[1],
            "allclose": all(__import__("torch").allclose(ta[k], tb[k], rtol=1e-3, atol=1e-4) for k in ta)}


def logits_diff(folders: list[str]) -> dict:
    from checkpoints import BLOCK_COMPRESSOR

    p = subprocess.run([sys.executable, "-c", BLOCK_COMPRESSOR + LOGITS, *folders], capture_output=True, text=True)
    if p.returncode:
        return {"error": p.stderr[-1500:]}
    import torch

    got = {k: torch.tensor(v) for k, v in json.loads(p.stdout).items()}
    ref = got[folders[0]]
    return {f: {"max_abs": (got[f] - ref).abs().max().item(), "scale": ref.abs().max().item()} for f in folders[1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--output", type=Path, required=True)
    ap.add_argument("--models", default="llama,qwen2")
    ap.add_argument("--cpu-only", action="store_true", help="run the CPU side alone (to try the script)")
    ap.add_argument("--searches", nargs="+", default=[*SEARCHES, *SIZES], choices=[*SEARCHES, *SIZES],
                    help="which runs (default: all)")
    args = ap.parse_args()
    import torch

    if not args.cpu_only and not torch.cuda.is_available():
        print("no CUDA device: this check needs one", file=sys.stderr)
        return 2
    from checkpoints import save_tiny_checkpoint

    args.work.mkdir(parents=True, exist_ok=True)
    devices = {"cpu": DEVICES["cpu"]} if args.cpu_only else DEVICES
    rows = []
    for model_type in args.models.split(","):
        source = save_tiny_checkpoint(args.work / f"src-{model_type}", model_type)
        for sname, search in ((k, v) for k, v in SEARCHES.items() if k in args.searches):
            runs = {d: run(source, args.work, f"{model_type}-{sname}-{d}", search, dev) for d, dev in devices.items()}
            row = {"model": model_type, "search": sname, "runs": runs}
            ref = runs["cpu"]
            row["compared_with_cpu"] = {
                d: {"same_exit": r["exit_code"] == ref["exit_code"], "same_kept": r["kept"] == ref["kept"],
                    "gate_difference": {k: (r["gate"].get(k) or 0) - (v or 0) for k, v in ref["gate"].items()},
                    **(weights_diff(Path(ref["out"]), Path(r["out"])) if r["exit_code"] == 0 == ref["exit_code"]
                       else {})}
                for d, r in runs.items() if d != "cpu"}
            ok = [r["out"] for r in runs.values() if r["exit_code"] == 0]
            if len(ok) > 1 and ok[0] == ref["out"]:
                row["logits_vs_cpu_in_plain_transformers"] = logits_diff(ok)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}, indent=1), flush=True)
        if not set(args.searches) & set(SIZES):
            continue
        source = size_source(args.work / f"src-size-{model_type}", model_type)
        for sname, search in ((k, v) for k, v in SIZES.items() if k in args.searches):
            devices = SIZE_DEVICES[search["output"]["formats"][0]]
            if args.cpu_only:
                devices = {d: dev for d, dev in devices.items() if dev["device"] == "cpu"}
            runs = {d: run(source, args.work, f"{model_type}-{sname}-{d}", search, dev)
                    for d, dev in devices.items()}
            row = {"model": model_type, "search": sname, "runs": runs}
            ref = runs["cpu"]
            row["compared_with_cpu"] = {
                d: {"same_exit": r["exit_code"] == ref["exit_code"],
                    "gate_difference": {k: (r["gate"].get(k) or 0) - (v or 0) for k, v in ref["gate"].items()},
                    **(size_diff(ref, r, search["file"]) if r["exit_code"] == 0 == ref["exit_code"] else {})}
                for d, r in runs.items() if d != "cpu"}
            ok = [r["out"] for r in runs.values() if r["exit_code"] == 0]
            if search["file"] is None and len(ok) > 1 and ok[0] == ref["out"]:
                row["logits_vs_cpu_in_plain_transformers"] = logits_diff(ok)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}, indent=1), flush=True)
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "rows": rows}
    import transformers

    result["transformers"] = transformers.__version__
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
