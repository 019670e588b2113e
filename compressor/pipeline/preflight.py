"""The checks before anything loads: the recipe against its inputs, the model's architecture and files, the
output location and the writers (:func:`preflight`, :func:`check`). Everything found here is found before the
model loads (exit 2)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from compressor.core import distributed as dist
from compressor.core.errors import InputError
from compressor.engine.records import ResumeError
from compressor.engine.runkey import run_key
from compressor.engine.runstate import RunState
from compressor.inputs.calibration import DataInput, evaluation_streams, load_tokenizer
from compressor.inputs.load import ResolvedSource, model_config, resolve_source
from compressor.inputs.safety import OutputLock
from compressor.inputs.validate import check_context, check_inputs, run_reads
from compressor.output import get_writer
from compressor.output.registry import check_folders
from compressor.output.hf import output_dtype
from compressor.recipe.schema import ModelConfig, OutputConfig, Recipe, width_multiple
from compressor.pipeline.products import Checked, Loaded
from compressor.pipeline.workflow import Workflow

logger = logging.getLogger(__name__)


def default_formats(recipe: Recipe, model_type: str | None = None, src: ResolvedSource | None = None,
                    flow: Workflow | None = None) -> list[str]:
    """Fill in ``output.formats`` when the recipe does not set it, as the run's workflow says
    (:meth:`~compressor.pipeline.workflow.Workflow.default_formats`): the format a size names; ``[hf]``, with a
    GGUF source's own format beside it where its writer takes the architecture (the output then goes where the
    source went, at its quantization). Returns the formats; the recipe (and the ``recipe.yaml`` saved with the
    output) then names them. ``model_type``: the source's, when the caller has read it already."""
    oc = recipe.output
    if "formats" in oc.model_fields_set:
        return oc.formats
    flow = flow or workflow_for(recipe)
    src = src or resolve_source(recipe.model.source, recipe.model.gguf_file)
    oc.formats = flow.default_formats(model_type or _model_type(recipe) if src.gguf_file else model_type, src)
    oc._defaulted = True
    return oc.formats


def _model_type(recipe: Recipe) -> str:
    mc = recipe.model
    src = resolve_source(mc.source, mc.gguf_file)
    return model_config(src, trust_remote_code=mc.trust_remote_code, revision=mc.revision).model_type


@dataclass
class Preflight:
    """What :func:`preflight` read and checked: everything a run can know before the model loads."""

    write: bool
    model_type: str
    src: ResolvedSource
    streams: dict[str, torch.Tensor]
    width_multiple: int
    workflow: Workflow


def preflight(recipe: Recipe, *, given: Loaded | None = None, output_required: bool = True) -> Preflight:
    """Every check that needs no model: files, data, the evaluation text's size, the formats, a size's
    rules, dtype rules, the architecture — what ``compressor validate`` runs, so it agrees with ``run``.

    ``given``: a model object handed in (:func:`from_object`); its source is not read, and with
    ``output.path`` unset nothing is to be written. ``output_required=False`` (``validate`` of a recipe
    with no ``output.path``): the output folder's own checks are left for the run that names one."""
    flow = workflow_for(recipe)
    write = given is None or recipe.output.path is not None
    check_inputs(recipe, need_output=write and (output_required or recipe.output.path is not None),
                 check_source=given is None)
    write = write or not output_required
    # read once: from a GGUF source it means parsing the file's metadata
    model_type = given.model_type if given is not None else _model_type(recipe)
    src = given.source if given is not None else resolve_source(recipe.model.source, recipe.model.gguf_file)
    default_formats(recipe, model_type, src, flow)
    check_folders(recipe.output.writers())
    mc = recipe.model
    config = given.model.config if given is not None else model_config(
        src, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
    check_context(recipe, config)
    if write:  # where a size run's F16 goes: said before the model loads, as the output folder is
        from compressor.pipeline.size.workdir import check_workdir

        check_workdir(recipe, Path(src.path).expanduser().resolve() if src.is_local else None)
    # a size run that would not fit memory onloads (or is refused) before loading
    flow.check_config(config, writes=write, given=given is not None)
    _fetch_hub_calibration(recipe)
    for name in recipe.output.writers():
        try:
            get_writer(name)
        except ValueError as err:
            raise InputError(f"output.formats: {err}") from None
    # Size the evaluation text with the tokenizer alone: a too-small set fails before the model loads.
    tokenizer = given.tokenizer if given is not None else load_tokenizer(mc)
    try:
        streams = evaluation_streams(recipe, tokenizer)
    except ValueError as err:
        raise InputError(str(err)) from None
    flow.check_evaluation(streams, writes=write)
    if write:
        flow.check_writers(tokenizer, model_type, src, config)
        if given is None:
            _check_offload_dtype(mc, recipe.output)
    return Preflight(write, model_type, src, streams, _check_architecture(recipe, src, given), flow)


def check(recipe: Recipe, *, resume: bool, measurements_from: str | Path | None = None,
          given: Loaded | None = None) -> Checked:
    """:func:`preflight`, then the output lock and the resume state — everything that can be known and
    held before the model loads."""
    t0 = time.perf_counter()
    pre = preflight(recipe, given=given)
    src, streams, multiple = pre.src, pre.streams, pre.width_multiple
    flow = pre.workflow
    if not pre.write:
        return Checked(None, streams, RunState(), [], flow, width_multiple=multiple,
                       grid=output_grid(recipe, src, flow), seconds=time.perf_counter() - t0)
    out = Path(recipe.output.path).expanduser().resolve()
    reads = run_reads(recipe)
    # Before the resume state is touched: a second run must not discard the first one's.
    lock = OutputLock(out).acquire() if dist.is_main() else None
    try:  # a run that cannot resume fails at once
        state = RunState.open(out, run_key(recipe, src, streams, multiple),
                              resume=resume, reads=reads, measurements_from=measurements_from)
    except ResumeError as err:
        if lock is not None:
            lock.release()
        raise InputError(str(err)) from None
    return Checked(out, streams, state, reads, flow, lock, width_multiple=multiple, grid=output_grid(recipe, src, flow),
                   seconds=time.perf_counter() - t0)


def _fetch_hub_calibration(recipe: Recipe) -> None:
    """A Hub calibration dataset is fetched now (``datasets`` caches it for the calibration stage): offline, or a
    wrong name, is said before the model loads, not after."""
    from compressor.inputs.calibration import source_text
    from compressor.inputs.data import load_documents

    for field, part in recipe.calibration.read_sources():
        source = source_text(part)
        if source.kind() == "hub":
            with DataInput(field):
                load_documents(source, "calibration")


def _check_architecture(recipe: Recipe, src: ResolvedSource, given: Loaded | None = None) -> int:
    """What the output architecture needs before the model loads (the kind and policy rules are the
    recipe's own, :class:`~compressor.recipe.schema.Recipe`); returns the FFN width multiple."""
    mc, oc = recipe.model, recipe.output
    if oc.architecture == "standard" and mc.offload != "none" and given is None:
        raise InputError(f"output.architecture: standard rebuilds the base class in memory to save it, which an "
                         f"onloaded model (model.offload: {mc.offload}) does not fit; use model.offload: none, or "
                         "output.architecture: custom")
    block = 1
    if oc.width_multiple is None:  # what each format needs to store every kept width
        for name in oc.writers():
            block = math.lcm(block, get_writer(name).width_block(src, oc))
    m = width_multiple(oc, block=block)
    step = getattr(recipe.replacement, "step_units", None)
    if step is not None and m > 1 and m % step:
        raise InputError(f"replacement.step_units: {step} does not divide the width multiple {m} "
                         "(output.width_multiple / architecture / the output formats' quantization blocks): the "
                         f"unit-removal path would skip the widths the output can take; use a divisor of {m} or "
                         "leave it null")
    return m


def output_grid(recipe: Recipe, src: ResolvedSource, flow: Workflow | None = None) -> dict[int, str]:
    """Block → the quantized type an output stores that block's FFN down projection in, where a kind that snaps
    (``prune``) fits onto it, so the gate measures the file's weights (:mod:`compressor.fitting.snap`; a GGUF
    written at its source's quantization: :meth:`~compressor.output.base.Writer.snap_grid`). Empty for a run
    that changes no block, a kind that does not snap, or outputs that store any value."""
    from compressor.fitting.kinds import get_kind

    flow = flow or workflow_for(recipe)
    if not flow.changes_blocks or not get_kind(recipe.replacement.kind).snaps:
        return {}
    grid: dict[int, str] = {}
    for name in recipe.output.writers():
        grid.update(get_writer(name).snap_grid(src, recipe.output))
    return grid


def check_writers(recipe: Recipe, tokenizer, model_type: str, src: ResolvedSource, config=None) -> None:
    """Each requested format can represent this run's model and kind, takes its options and can carry the
    tokenizer, as the run's workflow sees it: asked before the model loads, with the alternative in the message."""
    workflow_for(recipe).check_writers(tokenizer, model_type, src, config)


def _check_offload_dtype(mc: ModelConfig, oc: OutputConfig) -> None:
    """An onloaded model is saved shard by shard in its compute dtype (see :mod:`compressor.output.hf`); a run
    that writes no Hugging Face folder (a GGUF size) saves none."""
    if mc.offload == "none" or mc.dtype == "auto" or not any(w.startswith("hf") for w in oc.writers()):
        return
    wanted = str(output_dtype(oc.dtype, resolve_source(mc.source, mc.gguf_file), revision=mc.revision))
    wanted = wanted.removeprefix("torch.")
    if wanted != mc.dtype:
        raise InputError(
            f"model.offload: {mc.offload} saves the weights in the compute dtype (model.dtype: {mc.dtype}), but "
            f"output.dtype resolves to {wanted}; set output.dtype: {mc.dtype} or model.dtype: {wanted}"
        )


def workflow_for(recipe: Recipe) -> Workflow:
    """The run's workflow, chosen once: a size plan for a recipe with ``output.size``
    (:class:`~compressor.pipeline.size.SizeWorkflow`), else structural compression
    (:class:`~compressor.pipeline.structural.StructuralWorkflow`)."""
    if recipe.output.planned is not None:
        from compressor.pipeline.size import SizeWorkflow

        return SizeWorkflow(recipe)
    from compressor.pipeline.structural import StructuralWorkflow

    return StructuralWorkflow(recipe)
