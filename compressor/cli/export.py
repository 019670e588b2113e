"""``compressor export FOLDER --format gguf``: another format for an existing output folder.

Everything that can be refused is refused before the model loads (exit 2): a
folder that is not a compressor output, an unknown format, an architecture or
kind the format cannot represent, a missing runtime (llama-cpp-python), a
tokenizer the format cannot carry, an output file that exists. The file is
written and verified in a staging folder beside the output, then renamed into
place; a failed verification leaves nothing behind (exit 1).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from pathlib import Path

from compressor.cli.common import add_common, recipe_option

logger = logging.getLogger(__name__)

#: export's own exit codes (``run``'s speak of --resume and report.json, which export has neither of).
EXPORT_EXIT_CODES = """exit codes:
  0  success: the .gguf file is written and checked in llama.cpp
  1  runtime error (message on stderr; --verbose for the traceback), or llama.cpp's
     check of the written file failed: nothing is left at --output
  2  invalid input (not a compressor output folder, a compressed-tensors folder, a
     format or tokenizer the file cannot carry, an existing --output without
     --overwrite, a missing --text…): detected before the model loads
  130  interrupted (Ctrl-C); 143  terminated (SIGTERM): the staging file is removed
"""


def add_parsers(sub) -> None:
    from compressor.recipe.schema import OutputConfig

    p = sub.add_parser("export", help="write an existing compressor output folder in another format (gguf)",
                       epilog=EXPORT_EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Convert a compressor output folder (hf format) to a GGUF file that an unmodified "
                       "llama.cpp runs, and check it in llama.cpp: its perplexity on the run's evaluation text (or "
                       "--text) is compared with the folder's in transformers. See docs/gguf.md.")
    p.add_argument("folder", help="a compressor output folder (config.json with a compression section)")
    p.add_argument("--format", default="gguf", choices=["gguf"], help="output format (default: gguf)")
    recipe_option(p, "--quant", OutputConfig, "gguf_quant")
    recipe_option(p, "--unquantizable", OutputConfig, "gguf_unquantizable")
    p.add_argument("--output", "-o", default=None, help="the .gguf file to write (default: FOLDER/model.gguf)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file to verify perplexity on (default: the evaluation text of the folder's "
                   "recipe.yaml)")
    add_common(p)
    p.set_defaults(handler=handle)


def _fail(message: str):
    from compressor.core.errors import InputError

    raise InputError(message)


def preflight(args) -> dict:
    """Every check that needs no model: returns what :func:`handle` needs."""
    from compressor.output import get_writer

    folder = Path(args.folder).expanduser()
    cfg_path = folder / "config.json"
    planned = _planned_file(folder, args.format)
    if planned is not None and not cfg_path.is_file():
        _fail(f"{args.folder!r} holds a size-planned GGUF ({planned.name}, written by `compressor run` with "
              "output.size) and no Hugging Face weights (no config.json), so there is nothing to export from: "
              "export converts a Hugging Face folder. For one, run the recipe with output.formats: [hf, gguf] beside "
              "output.size, and export that folder to another one")
    if not cfg_path.is_file():
        _fail(f"{args.folder!r} is not a compressor output folder: {cfg_path} does not exist")
    out = Path(args.output).expanduser() if args.output else folder / "model.gguf"
    if planned is not None and out.resolve() == planned.resolve():
        _fail(f"{out}: the GGUF there was planned to a size by `compressor run` (output.size; see "
              f"{folder / 'report.json'}); export would replace it with a different file while report.json still "
              f"describes the planned one. Export to another folder: --output OTHER_FOLDER/{out.name}")
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    compression = cfg.get("compression")
    if not isinstance(compression, dict):
        _fail(f"{cfg_path} has no compression section: export converts folders written by `compressor run`")
    if (why := _packed_refusal(args.folder, cfg, compression)) is not None:
        _fail(why)
    model_type = str(cfg.get("model_type", "")).removeprefix("compressed_")
    try:
        writer = get_writer(args.format)
    except ValueError as e:
        _fail(str(e))
    kinds = sorted({b.get("kind") or b.get("replacement") for b in compression.get("blocks", [])} - {None, "none"})
    for kind in kinds or ["none"]:
        if (why := writer.unsupported(model_type, kind)) is not None:
            _fail(why)
    options = {"quant": args.quant, "unquantizable": args.unquantizable}
    if (why := _ask(writer, "check_options", options)) is not None:
        _fail(why)
    if out.suffix != ".gguf":
        _fail(f"--output {args.output!r} must name a .gguf file")
    if out.exists() and not args.overwrite:
        _fail(f"{out} exists; pass --overwrite to replace it")
    if not out.parent.is_dir():
        _fail(f"the folder of --output, {out.parent}, does not exist")
    source = _original_gguf(compression)
    if args.quant == "source" and source is None:
        original = str(compression.get("source_model") or "")
        if original.endswith(".gguf"):
            logger.info("the original GGUF (%s) is not on this machine: quant 'source' writes the folder's dtype",
                        original)
        else:  # a Hugging Face folder or hub id: there is no GGUF to take the types of, wherever it is
            logger.info("the original (%s) is a Hugging Face checkpoint, not a GGUF: quant 'source' writes the "
                        "folder's dtype", original or "not recorded")
    src = source or _folder_source(folder)
    if (why := _ask(writer, "check_widths", compression, cfg, src, options)) is not None:
        _fail(why)
    tokenizer = _tokenizer(folder)
    if (why := _ask(writer, "check_tokenizer", tokenizer, src)) is not None:
        _fail(why)
    tokens, seq_len, stride = _probe(args, folder, tokenizer)
    return {"folder": folder, "cfg": cfg, "compression": compression, "writer": writer, "options": options,
            "out": out, "source": src, "tokenizer": tokenizer, "tokens": tokens, "seq_len": seq_len, "stride": stride}


def _planned_file(folder: Path, fmt: str) -> Path | None:
    """The file of format ``fmt`` that ``compressor run`` planned to ``output.size`` in ``folder`` (its report.json
    has a ``size_plan`` and a ``plan`` check of that format), or None. Read as it is, of any schema version."""
    from compressor.output.registry import targets

    try:
        report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict) or report.get("size_plan") is None:
        return None
    checks = report.get("verification")
    check = checks.get(fmt) if isinstance(checks, dict) else None
    target = targets().get(fmt)
    planned = isinstance(check, dict) and check.get("quant") == "plan"
    return target().shipped(folder) if planned and target is not None else None


def _packed_refusal(given: str, cfg: dict, compression: dict) -> str | None:
    """Why a compressed-tensors folder is not exported (None for a float folder): its linears are packed integer
    codes with a ``weight_scale`` each, which the gguf writer (it reads float weights) cannot take, and decoding
    them into a GGUF would round the weights twice."""
    from compressor.output.ctensors.schemes import CTENSORS_FORMAT, QUANT_METHOD

    qcfg = cfg.get("quantization_config")
    packed = isinstance(qcfg, dict) and qcfg.get("quant_method") == QUANT_METHOD
    if not packed and compression.get("format") != CTENSORS_FORMAT:
        return None
    original = str(compression.get("source_model") or "the original model")
    return (f"{given!r} is a compressed-tensors folder (output.formats: [compressed-tensors]: integer weights "
            "packed with a weight_scale each), and export converts a float Hugging Face folder only: a GGUF made "
            "from it would round the weights a second time. Plan the GGUF from the original instead: run the same "
            f"recipe (model.source: {original}) with --set 'output.formats=[gguf]' --set output.size=Q4_K_M (or "
            "another size) -o ANOTHER_FOLDER; or export a folder written with output.formats: [hf]")


def _ask(writer, check: str, *args) -> str | None:
    """A writer's optional pre-load check (``check_options``, ``check_widths``, ``check_tokenizer``)."""
    method = getattr(writer, check, None)
    return None if method is None else method(*args)


def _original_gguf(compression: dict):
    """The GGUF the folder was compressed from, when it is still on this machine."""
    from compressor.inputs.load import resolve_source

    name = str(compression.get("source_model") or "")
    if not name.endswith(".gguf") or not Path(name).is_file():
        return None
    return resolve_source(name)


def _folder_source(folder: Path):
    from compressor.inputs.load import ResolvedSource

    return ResolvedSource(str(folder.resolve()), None, True)


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        # the folder's config names custom model code; the tokenizer needs none (see docs/loading.md)
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        _fail(f"the tokenizer in {folder} does not load ({e})")


def _probe(args, folder: Path, tokenizer):
    """Token ids, window length and stride to verify on: --text, else the recipe's first evaluation domain."""
    import torch

    if args.text:
        p = Path(args.text).expanduser()
        if not p.is_file():
            _fail(f"--text {args.text!r} does not exist")
        ids = torch.tensor(tokenizer(p.read_text(encoding="utf-8")).input_ids, dtype=torch.long)
        seq_len = min(256, ids.numel())
        if ids.numel() < 64:
            _fail(f"--text {args.text!r} has {ids.numel()} tokens; give at least 64")
        return ids, seq_len, seq_len
    from compressor.inputs.calibration import evaluation_streams
    from compressor.recipe import load_recipe

    recipe_path = folder / "recipe.yaml"
    if not recipe_path.is_file():
        _fail(f"{folder} has no recipe.yaml to take the evaluation text from; pass --text FILE")
    try:
        recipe = load_recipe(recipe_path)
        streams = evaluation_streams(recipe, tokenizer)
    except Exception as e:  # noqa: BLE001 - any failure to get the text is the same advice
        _fail(f"the evaluation text of {recipe_path} is not available here ({e}); pass --text FILE")
    e = next((e for e in recipe.evaluation_domains() if e.domain_name() in streams), None)
    if e is None:  # only text the original model wrote, which is not here to write it again
        _fail(f"{recipe_path} evaluates only on text the original model writes (evaluation.dataset: self); "
              "pass --text FILE")
    return streams[e.domain_name()], e.seq_len, e.stride


def handle(args) -> int:
    import torch

    from compressor.evaluation.perplexity import perplexity
    from compressor.output import WriteRequest
    from compressor.output.hf import OUTPUT_DTYPES, load_compressed

    p = preflight(args)
    model = load_compressed(p["folder"], dtype=torch.float32)
    model.eval()
    expected = perplexity(model, p["tokens"], seq_len=p["seq_len"], stride=p["stride"], desc="transformers",
                          shard=False)
    out: Path = p["out"]
    saved = str(p["cfg"].get("dtype") or p["cfg"].get("torch_dtype") or "float32")
    request = WriteRequest(
        model=model, tokenizer=p["tokenizer"], compression=p["compression"], source=p["source"],
        dtype=OUTPUT_DTYPES.get(saved, torch.float32), probe_tokens=p["tokens"], probe_seq_len=p["seq_len"],
        probe_stride=p["stride"], expected_ppl=expected.ppl, options={**p["options"], "file": out.name},
    )
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        written = p["writer"].write(request, tmp)
        check = p["writer"].verify(request, written)  # raises VerificationError (exit 1): nothing is moved
        (tmp / out.name).replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rel = check["relative_ppl_diff"]
    print(f"wrote {out} ({check['file_bytes'] / 1e6:.1f} MB, {check['architecture']}, {check['file_type']})")
    print(f"llama.cpp perplexity {check['perplexity']:.4f} vs transformers {expected.ppl:.4f} "
          f"(relative difference {rel:.3%}{'' if check['relative_ppl_tolerance'] is None else ', within tolerance'})"
          if rel is not None else f"llama.cpp perplexity {check['perplexity']:.4f}")
    return 0
