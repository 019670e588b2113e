"""The rounding alone: one uniform type everywhere — nearest with and without column weights, and
error-compensating.

Every 2-D tensor of the F16 re-quantized to one type (default Q4_0, which rows of 32 take; ``--type Q3_K``
takes the tensors whose rows hold whole 256-element blocks, the rest ``--fallback``) five ways: compressor's
writer without weights, compressor's writer with the run's ``diag(Ĥ)`` (what the size planner passes to
ggml), compressor's error-compensating rounding (GPTQ through the run's Ĥ onto those same scales,
:mod:`compressor.fitting.gridround`), ``llama-quantize --pure`` without and with ``llama-imatrix`` from the
same calibration text. All scored on WikiText-2 test by ``tools/checks/llamacpp_perplexity.py`` (a process that
does not import compressor). The token embedding keeps llama.cpp's importance-free treatment here
(``llama-imatrix`` does not cover it, and a lookup has no Ĥ), so the sides differ only in the matrices.

    python tools/size/bench_imatrix_alone.py --work /tmp/bench-smol --tools /path/to/build/bin \\
        --output tools/size/results/imatrix_alone_smollm2.json

``--work``: the folder of ``tools/size/bench_size_frontier.py`` (its F16.gguf, imatrix.gguf, calibration.txt).
Run it alone.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import load_bench_model, wikitext, write_json
from tools.benchlib.cli import add_alone, add_model, log_to_stderr, tool_parser
from tools.benchlib.runs import llamacpp_perplexity_cmd, scores

logger = logging.getLogger("bench_imatrix_alone")


def main() -> None:
    ap = tool_parser(__doc__)
    add_model(ap)
    ap.add_argument("--work", required=True)
    ap.add_argument("--tools", required=True)
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--fallback", default="Q4_0", help="the type of tensors whose rows --type does not fit")
    ap.add_argument("--cal-tokens", type=int, default=16384)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--output", required=True)
    add_alone(ap)
    args = ap.parse_args()
    log_to_stderr()
    import torch

    from compressor.engine.tensorstats import input_moments, linear_names
    from compressor.output.gguf.write import write_requantized
    from compressor.output.gguf.target import gguf_namer
    from compressor.pipeline.size.prices import moment_groups
    from compressor.sizing.sites import _imatrix

    work, tools = Path(args.work), Path(args.tools)
    f16 = work / "F16.gguf"
    model, tok, _, _ = load_bench_model(args.model, dtype="float32")
    text = (work / "calibration.txt").read_text(encoding="utf-8")
    ids = torch.tensor(tok(text).input_ids[: args.cal_tokens]).reshape(-1, 512)
    import gguf

    from compressor.core.ggml import GGMLType, fits

    two_d = {t.name: int(t.shape[0]) for t in gguf.GGUFReader(f16).tensors if len([d for d in t.shape if d > 1]) >= 2}
    types = {name: args.type if fits(GGMLType[args.type], n) else args.fallback for name, n in two_d.items()}
    namer = gguf_namer(model)
    imatrix, stored, gptq_s = {}, {}, 0.0
    # the moments in groups of layers that fit memory beside the model, as the size plan measures them
    # (Qwen2.5-1.5B's every Ĥ at once, 10 GB beside 7 GB of float32 model, was killed for memory)
    for group in moment_groups(model, linear_names(model)):
        moments = input_moments(model, ids, group, batch_size=4)
        imatrix.update({namer(f"{n}.weight"): _imatrix(torch.diagonal(moments[n])) for n in group
                        if namer(f"{n}.weight")})
        t0 = time.perf_counter()
        stored.update(compensated(model, moments, namer, types, imatrix))  # consumes the moments
        gptq_s += time.perf_counter() - t0
        logger.info("rounded %d of the linear layers", len(stored))
    del model  # the writes below read the F16
    gc.collect()
    files = {}
    files["compressor, no weights"] = work / f"uniform-{args.type}-plain.gguf"
    write_requantized(f16, files["compressor, no weights"], types)
    files["compressor, diag(H) of the run"] = work / f"uniform-{args.type}-ours.gguf"
    write_requantized(f16, files["compressor, diag(H) of the run"], types, imatrix)
    files["compressor, error-compensating (GPTQ through H)"] = work / f"uniform-{args.type}-gptq.gguf"
    write_requantized(f16, files["compressor, error-compensating (GPTQ through H)"], types, imatrix, stored=stored)
    files["llama-quantize --pure"] = work / f"pure-{args.type}.gguf"
    files["llama-quantize --pure --imatrix"] = work / f"pure-{args.type}-imatrix.gguf"
    for label, extra in (("llama-quantize --pure", []),
                         ("llama-quantize --pure --imatrix", ["--imatrix", str(work / "imatrix.gguf")])):
        overrides = [a for name, t in types.items() if t != args.type for a in ("--tensor-type", f"{name}={t.lower()}")]
        subprocess.run([str(tools / "llama-quantize"), "--pure", *extra, *overrides, str(f16), str(files[label]),
                        args.type, "2"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    scored = work / f"imatrix-alone-{args.type}.json"
    cmd = llamacpp_perplexity_cmd([f16, *files.values()], wikitext("test.txt"), args.windows, scored)
    subprocess.run([str(c) for c in cmd], check=True, stdout=subprocess.DEVNULL)
    res = {Path(r["file"]).name: r for r in scores(scored)}
    base = res["F16.gguf"]["ppl"]
    rows = [{"file": label, "bytes": p.stat().st_size, "ppl": res[p.name]["ppl"],
             "change_vs_f16": res[p.name]["ppl"] / base - 1} for label, p in files.items()]
    write_json(args.output, {
        "model": args.model, "type": args.type, "fallback": args.fallback,
        "types_used": {t: list(types.values()).count(t) for t in sorted(set(types.values()))},
        "gptq_seconds": gptq_s, "eval": f"WikiText-2 test, {args.windows} windows of 512, llama.cpp",
        "calibration": f"{args.cal_tokens} tokens of {work / 'calibration.txt'} (the first characters of WikiText-2 "
                       "valid), the same text llama-imatrix read", "f16_ppl": base, "ran_alone": bool(args.alone),
        "rows": rows})
    for r in rows:
        print(f"{r['file']:34s} {r['bytes'] / 1e6:7.1f} MB  {100 * r['change_vs_f16']:+6.2f} %")


def compensated(model, moments: dict, namer, types: dict, imatrix: dict) -> dict:
    """GGUF name → (type, GPTQ bytes in the file's row order) for every linear the file stores. Each Ĥ is
    dropped from ``moments`` once used (a matrix its layers share is freed after the last of them)."""
    from compressor.core.ggml import GGMLType
    from compressor.fitting.gridround import gptq_quantize
    from compressor.core.archs import ARCHITECTURES
    from compressor.output.gguf.naming import to_file_rows

    arch = ARCHITECTURES[model.config.model_type].gguf_native  # the F16 from a Hugging Face folder: its native arch
    out = {}
    for module in list(moments):
        h = moments.pop(module)
        name = namer(f"{module}.weight")
        if name is None or name not in types:
            continue
        w = model.get_submodule(module).weight.detach().float()
        raw = gptq_quantize(w, h.float(), GGMLType[types[name]], imatrix[name])
        out[name] = (types[name], to_file_rows(name, raw, arch, model.config))
    return out


if __name__ == "__main__":
    main()
