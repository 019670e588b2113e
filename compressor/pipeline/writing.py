"""Writing, verifying and publishing: the request the writers are handed, every format written into one
staging folder, each verified, then renamed into place (:func:`write`, :func:`verify`, :func:`publish_output`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compressor.core.errors import InputError
from compressor.core.modeling import COMPRESSION_FORMAT
from compressor.core.version import __version__
from compressor.output import WriteRequest, Written, get_writer, publish, staging_folder
from compressor.output.hf import output_dtype
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import OutputConfig, Recipe
from compressor.reports.card import model_card

from compressor.pipeline.formats import writer_options
from compressor.pipeline.products import Checked, Loaded

logger = logging.getLogger(__name__)



def save_dtype(recipe: Recipe, loaded: Loaded) -> torch.dtype:
    """``output.dtype`` resolved: ``source`` is the source checkpoint's dtype, or a model object's own."""
    if recipe.output.dtype == "source" and loaded.source.in_memory:
        return next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), torch.float32)
    return output_dtype(recipe.output.dtype, loaded.source, revision=recipe.model.revision)


def compression_section(loaded: Loaded, result: CompressionResult, rep: dict) -> dict:
    """The ``compression`` section of the compressed model's ``config.json``."""
    return {
        "format": COMPRESSION_FORMAT,
        "tool": "compressor",
        "tool_version": __version__,
        "source_model": loaded.source.describe(),
        "recipe_sha256": rep["recipe_sha256"],
        "blocks": result.compression_blocks(),
        "params_before": result.params_before,
        "params_after": result.params_after,
        "perplexity": rep["perplexity"],
    }


def write_request(recipe: Recipe, loaded: Loaded, checked: Checked, result: CompressionResult,
                  rep: dict) -> WriteRequest:
    """What every writer gets: the model, its ``compression`` section, files, and the verification probe."""
    compression = compression_section(loaded, result, rep)
    e = recipe.evaluation_domains()[0]  # the primary domain: the verification probe
    mc = recipe.model
    return WriteRequest(
        model=loaded.model, tokenizer=loaded.tokenizer, compression=compression, source=loaded.source,
        dtype=save_dtype(recipe, loaded),
        extra_files={"recipe.yaml": recipe.to_yaml(), "README.md": model_card(rep)},
        probe_tokens=checked.eval_streams[e.domain_name()], probe_seq_len=e.seq_len, probe_stride=e.stride,
        probe_batch_size=e.batch_size, expected_ppl=result.final.ppl, offload=mc.offload, device=mc.device,
        gate=recipe.policy,
        options={**writer_options(recipe.output, result), "gate_domains": gate_domains(recipe, checked, result)},
    )


def gate_domains(recipe: Recipe, checked: Checked, result: CompressionResult) -> list[dict]:
    """Every evaluation domain's tokens and windows, with the original's perplexity there: what a GGUF is
    checked on in llama.cpp (the gate's text, so the file is held to the gate's rule), with the original's teacher
    there when the run kept one (the file's KL from the original)."""
    base = getattr(result.baseline, "domains", None) or {}
    return [{"name": c.domain_name(), "tokens": checked.eval_streams[c.domain_name()], "seq_len": c.seq_len,
             "stride": c.stride, "reference_ppl": base[c.domain_name()].ppl if c.domain_name() in base else None,
             "teacher": result.teachers.get(c.domain_name())}
            for c in recipe.evaluation_domains()]


@dataclass
class Staged:
    """Every requested format written into one staging folder beside the output: the folder, and what each
    writer wrote (what its verify checks)."""

    folder: Path
    written: dict[str, Written]


def write(oc: OutputConfig, request: WriteRequest, checked: Checked, timings: dict | None = None,
          plans: dict[str, Any] | None = None) -> Staged:
    """Every requested format into one staging folder beside the output. ``plans``: format → the plan its writer
    writes, in the format's terms (a size's; a format not named writes the plan of its own options).

    The output location is checked again first: it may have changed during the run."""
    from compressor.inputs.safety import check_output_folder

    src = request.source
    check_output_folder(checked.out, overwrite=oc.overwrite, reads=checked.reads,
                        model_dir=src.path if src.is_local else None)
    config = request.model.config.to_dict()
    for name in oc.writers():
        why = get_writer(name).check_widths(request.compression, config, src, request.options)
        if why:
            raise InputError(f"output.formats: {name}: {why}")
    tmp = staging_folder(checked.out)
    written: dict[str, Written] = {}
    try:
        for name in oc.writers():
            t0, since = time.perf_counter(), time.time()
            try:
                written[name] = get_writer(name).write(request, tmp, (plans or {}).get(name))
            except Exception as exc:  # noqa: BLE001 - a full disk is named here, while the file is still there
                full = disk_full(exc, tmp, since, checked.out)
                if full is None:
                    raise
                raise full from exc
            if timings is not None:
                timings[f"write_{name}_s"] = time.perf_counter() - t0
    except BaseException:
        remove_tree(tmp)
        raise
    return Staged(tmp, written)


def disk_full(exc: BaseException, tmp: Path, since: float, out: Path):
    """A writer's failure into the staging folder ``tmp`` as a
    :class:`~compressor.inputs.safety.DiskFullError` naming the file whose write failed (the writers' errors
    seldom do: numpy's short write, safetensors' ``SafetensorError``, llama.cpp's quantizer) and its disk, when
    the disk is full; None otherwise. Called before the folder is removed, which frees the disk again."""
    from compressor.inputs.safety import as_disk_full

    fix = (f"Free space on that disk, or write the output to a disk with room (--output, output.path; the "
           f"staging folder {tmp.name} sits beside the output {out}, and is removed)")
    return as_disk_full(exc, [tmp], since, fix)


def verify(oc: OutputConfig, request: WriteRequest, staged: Staged, rep: dict) -> None:
    """Each writer reloads what it wrote and compares it with the in-memory model; a mismatch
    removes the staging folder and raises (nothing is published)."""
    from compressor.output.base import GateMissed

    try:
        for name in oc.writers():
            t0 = time.perf_counter()
            try:
                check = get_writer(name).verify(request, staged.written[name])
            except GateMissed as missed:
                rep.setdefault("verification", {})[name] = missed.check
                raise _gate_failed(rep, str(missed)) from None
            rep["timings"][f"verify_{name}_s"] = time.perf_counter() - t0
            rep.setdefault("verification", {})[name] = check
            if name in ("hf", "hf-standard"):
                rep["reload_check"] = check  # the field report.json readers know
    except BaseException:
        remove_tree(staged.folder)
        raise


def _gate_failed(rep: dict, message: str):
    """The report and exception of a file over the gate where it runs (exit 3, nothing written)."""
    from compressor.core.errors import GateFailed

    rep.update(status="rejected", exit_code=3, message=message, output=None)
    return GateFailed(message, report=rep)


def publish_output(tmp: Path, out: Path, rep: dict, t_start: float, recipe: Recipe | None = None) -> Path:
    """Write ``report.json`` into the verified staging folder, with the resolved ``recipe.yaml`` and the model
    card (``README.md``) where no writer wrote them, and rename it into place. The report is validated first
    (:class:`~compressor.reports.schema.Report`): report.json holds the keys its ``schema_version`` promises."""
    from compressor.reports.schema import Report

    try:
        rep["size"].update(output_sizes(tmp, rep["size"]))
        rep["size"]["like_with_like"] = like_with_like(rep)
        rep["timings"]["total_s"] = time.perf_counter() - t_start
        if recipe is not None:  # what a writer did not write itself (a GGUF-only folder)
            for name, text in (("recipe.yaml", recipe.to_yaml), ("README.md", lambda: model_card(rep))):
                if not (tmp / name).exists():
                    (tmp / name).write_text(text())
        # what this run wrote: a later --overwrite replaces these and keeps whatever else is put beside them
        rep["files"] = sorted({p.name for p in tmp.iterdir()} | {"report.json"})
        Report.of(rep)
        (tmp / "report.json").write_text(json.dumps(rep, indent=2) + "\n")
        return publish(tmp, out)
    except BaseException:
        remove_tree(tmp)
        raise


def output_sizes(folder: Path, size: dict) -> dict:
    """Bytes per format, like with like: ``output_bytes`` is the Hugging Face folder's weights (saved
    as ``output_dtype``); ``gguf_bytes`` the GGUF file, comparable with a GGUF source's file
    (``source_bytes``) when written at the source's quantization."""
    weights = [p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt")]
    gguf = [p for p in folder.iterdir() if p.is_file() and p.suffix == ".gguf"]
    out = {"output_bytes": sum(p.stat().st_size for p in weights) if weights else None}
    if gguf:
        out["gguf_bytes"] = sum(p.stat().st_size for p in gguf)
    return out


def like_with_like(rep: dict) -> dict | None:
    """The source and the output file at the same quantization, when the run wrote one: a GGUF source
    against the GGUF written at its types, or a Hugging Face source against the folder saved in its
    dtype. None (with nothing to compare) otherwise."""
    size = rep["size"]
    # the file written at the source's own quantization (a GGUF source's format), if any
    gguf = next((c for c in (rep.get("verification") or {}).values() if c.get("quant") == "source"), None)
    src = size.get("source_bytes")
    if not src:
        return None
    if rep["model"]["resolved"].endswith(".gguf"):
        if size.get("gguf_bytes") is None or gguf is None:
            return None
        out, what = size["gguf_bytes"], f"GGUF at the source's quantization ({gguf.get('file_type')})"
    elif size.get("output_dtype_is_source"):
        out, what = size.get("output_bytes"), f"Hugging Face weights in the source's dtype ({size.get('output_dtype')})"
    else:
        return None
    if not out:
        return None
    return {"what": what, "source_bytes": src, "output_bytes": out, "ratio": out / src}


def remove_tree(tmp: Path) -> None:
    """Delete a staging folder (one this run created), whatever it holds."""
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
