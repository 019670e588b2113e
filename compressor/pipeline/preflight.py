"""The checks before anything loads: the recipe against its inputs, the model's architecture and files, the
output location and the writers (:func:`preflight`, :func:`check`). Everything found here is found before the
model loads (exit 2)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compressor.core import distributed as dist
from compressor.core.archs import ArchSpec
from compressor.core.errors import InputError
from compressor.engine.records import ResumeError
from compressor.engine.runkey import run_key
from compressor.engine.runstate import RunState
from compressor.inputs.calibration import DataInput, evaluation_streams, load_tokenizer
from compressor.inputs.data import CalibrationSet
from compressor.inputs.load import ResolvedSource, model_config, resolve_source
from compressor.inputs.safety import OutputLock
from compressor.inputs.validate import check_context, check_inputs, run_reads
from compressor.output import get_writer
from compressor.output.hf import output_dtype
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import ModelConfig, OutputConfig, Recipe, width_multiple

logger = logging.getLogger(__name__)


@dataclass
class Checked:
    """What :func:`check` established before anything heavy ran."""

    out: Path | None
    """The output folder; None when nothing is to be written (:func:`compressor.oneshot` without ``output_dir``)."""
    eval_streams: dict[str, torch.Tensor]
    state: RunState
    reads: list[tuple[str, Path]]
    lock: OutputLock | None = None
    """Held until the run ends: one run per output (rank 0 holds it under a process group)."""
    width_multiple: int = 1
    """The multiple the kept FFN widths come in (:func:`compressor.recipe.schema.width_multiple`)."""
    grid: dict[int, str] = field(default_factory=dict)
    """Block → the GGML type the GGUF output stores its down projection in (:func:`output_grid`)."""
    seconds: float = 0.0
    """Wall time of the checks."""
    keep_state: bool = False
    """Keep the run state when the run ends (``--keep-state``)."""

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


@dataclass
class Loaded:
    model: nn.Module
    tokenizer: object
    source: ResolvedSource
    model_type: str
    spec: ArchSpec


@dataclass
class Calibrated:
    cal: CalibrationSet
    info: dict
    overlap: dict = field(default_factory=dict)


def default_formats(recipe: Recipe, model_type: str | None = None, src: ResolvedSource | None = None) -> list[str]:
    """Fill in ``output.formats`` when the recipe does not set it: ``[gguf]`` with ``output.size``; ``[hf, gguf]`` for a
    GGUF source whose
    architecture the gguf writer takes (the output then goes where the source went, at its quantization),
    else ``[hf]``. Returns the formats; the recipe (and the ``recipe.yaml`` saved with the output) then
    names them. ``model_type``: the source's, when the caller has read it already."""
    oc = recipe.output
    if "formats" in oc.model_fields_set:
        return oc.formats
    from compressor.output.gguf.plan import arch_refusal
    from compressor.pipeline import size

    formats = size.sizing(recipe).default_formats()
    if formats is not None:  # a size is the file a deployer ships, and nothing else
        oc.formats, oc._defaulted = formats, True
        return oc.formats
    formats = ["hf"]
    src = src or resolve_source(recipe.model.source, recipe.model.gguf_file)
    if src.gguf_file:  # the architecture decides, not what is installed: the same recipe writes the same files
        why = arch_refusal(model_type or _model_type(recipe))
        if why is None:
            formats = ["hf", "gguf"]
        else:
            logger.info("output.formats: [hf], no GGUF: %s", why)
    oc.formats = formats
    oc._defaulted = True
    return formats


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


def preflight(recipe: Recipe, *, given: Loaded | None = None, output_required: bool = True) -> Preflight:
    """Every check that needs no model: files, data, the evaluation text's size, the formats, a size's
    rules, dtype rules, the architecture — what ``compressor validate`` runs, so it agrees with ``run``.

    ``given``: a model object handed in (:func:`from_object`); its source is not read, and with
    ``output.path`` unset nothing is to be written. ``output_required=False`` (``validate`` of a recipe
    with no ``output.path``): the output folder's own checks are left for the run that names one."""
    from compressor.pipeline import size

    write = given is None or recipe.output.path is not None
    check_inputs(recipe, need_output=write and (output_required or recipe.output.path is not None),
                 check_source=given is None)
    write = write or not output_required
    # read once: from a GGUF source it means parsing the file's metadata
    model_type = given.model_type if given is not None else _model_type(recipe)
    src = given.source if given is not None else resolve_source(recipe.model.source, recipe.model.gguf_file)
    default_formats(recipe, model_type, src)
    mc = recipe.model
    config = given.model.config if given is not None else model_config(
        src, trust_remote_code=mc.trust_remote_code, revision=mc.revision)
    check_context(recipe, config)
    from compressor.core.archs import moe_refusal

    fmt = None
    if recipe.output.size is not None:
        from compressor.output.registry import target_for

        fmt = target_for(recipe.output.formats, recipe.output.size, recipe.output).format
    if (why := moe_refusal(config, size=fmt is not None, fmt=fmt, offload=recipe.model.offload)) is not None:
        raise InputError(why)
    if write:  # where a size run's F16 goes: said before the model loads, as the output folder is
        from compressor.pipeline.size.workdir import check_workdir

        check_workdir(recipe, Path(src.path).expanduser().resolve() if src.is_local else None)
    size.sizing(recipe).check_source(config)
    if given is None and write:  # a size run that would not fit memory onloads (or is refused) before loading
        size.sizing(recipe).fit_memory(config)
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
    _check_confirmation(recipe, streams)
    size.sizing(recipe).check_output(writes=write)
    if write:
        check_writers(recipe, tokenizer, model_type, src, config)
        if given is None:
            _check_offload_dtype(mc, recipe.output)
    return Preflight(write, model_type, src, streams, _check_architecture(recipe, src, given))


def check(recipe: Recipe, *, resume: bool, measurements_from: str | Path | None = None,
          given: Loaded | None = None) -> Checked:
    """:func:`preflight`, then the output lock and the resume state — everything that can be known and
    held before the model loads."""
    t0 = time.perf_counter()
    pre = preflight(recipe, given=given)
    src, streams, multiple = pre.src, pre.streams, pre.width_multiple
    if not pre.write:
        return Checked(None, streams, RunState(), [], width_multiple=multiple, grid=output_grid(recipe, src),
                       seconds=time.perf_counter() - t0)
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
    return Checked(out, streams, state, reads, lock, width_multiple=multiple, grid=output_grid(recipe, src),
                   seconds=time.perf_counter() - t0)


def _check_confirmation(recipe: Recipe, streams: dict[str, torch.Tensor]) -> None:
    """``policy.confirm_fraction`` leaves at least two windows (a standard error) on each side of every
    domain's split; said before the model loads."""
    from compressor.evaluation.gate import confirmation_windows
    from compressor.evaluation.perplexity import window_count

    from compressor.pipeline import size

    f = recipe.policy.confirm_fraction
    if not f or not size.sizing(recipe).structural:  # a size plan's files are gated on every window: nothing to confirm
        return
    for e in recipe.evaluation_domains():
        tokens = e.written_tokens() if e.self_written() else streams[e.domain_name()].numel()
        windows = window_count(tokens, e.seq_len, e.stride)
        held = len(confirmation_windows(windows, f))
        if min(held, windows - held) < 2:
            raise InputError(
                f"policy.confirm_fraction: {f:g} of evaluation domain {e.domain_name()!r}'s {windows} windows "
                f"(seq_len {e.seq_len}) leaves {held} held out for confirmation and {windows - held} for the search; "
                "each needs at least 2 (a standard error). Give more evaluation text (evaluation.max_tokens), "
                "shorter windows (evaluation.seq_len), another fraction, or policy.confirm_fraction: 0 (no "
                "confirmation)")


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
    if "gguf" in oc.formats and getattr(oc, "gguf_quant", "source") == "source" and oc.width_multiple is None:
        block = _gguf_source_block(src)
    return width_multiple(oc, source_block=block)


def output_grid(recipe: Recipe, src: ResolvedSource) -> dict[int, str]:
    """Block → the quantized GGML type a GGUF written at its source's quantization stores that block's FFN
    down projection in: a kind that snaps (``prune``) fits onto it, so the gate measures the file's
    weights (:mod:`compressor.fitting.snap`). Empty for float types, another output, or a kind that
    does not snap."""
    from compressor.fitting.kinds import get_kind

    from compressor.pipeline import size

    oc = recipe.output
    if (not src.gguf_file or not size.sizing(recipe).structural or "gguf" not in oc.formats
            or getattr(oc, "gguf_quant", "source") != "source" or not get_kind(recipe.replacement.kind).snaps):
        return {}
    try:
        from compressor.core.ggml import GGMLType
        from compressor.output.gguf.read import source_tensor_types
    except ImportError:  # no gguf-py: the gguf writer's own check names the missing package
        return {}
    grid = {}
    for name, t in source_tensor_types(Path(src.path) / src.gguf_file).items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2:] == ["ffn_down", "weight"]:
            known = GGMLType.known(t)
            if known is not None and known.quantized:
                grid[int(parts[1])] = known.name
    return grid


def _gguf_source_block(src: ResolvedSource) -> int:
    """The quantization block of a GGUF source's FFN down projections (1 for a Hugging Face source):
    written at the source's own types, a width must be a whole number of those blocks."""
    if not src.gguf_file:
        return 1
    try:
        from compressor.output.gguf.read import source_down_block

        return source_down_block(Path(src.path) / src.gguf_file)
    except ImportError:  # no gguf-py: the gguf writer's own check names the missing package
        return 1


def check_writers(recipe: Recipe, tokenizer, model_type: str, src: ResolvedSource, config=None) -> None:
    """Each requested format can represent this architecture and kind, takes its options and can carry
    the tokenizer: asked before the model loads, with the alternative in the message."""
    from compressor.pipeline import size

    oc = recipe.output
    options = writer_options(oc)
    size.sizing(recipe).check(model_type, src, config=config)
    kind = recipe.replacement.kind if size.sizing(recipe).structural else "none"  # a size replaces no block
    for name in oc.writers():
        writer = get_writer(name)
        why = (writer.unsupported(model_type, kind) or writer.check_options(options)
               or writer.check_tokenizer(tokenizer, src))
        why = size.sizing(recipe).writer_refusal(name, why, model_type, src)
        if why:
            raise InputError(f"output.formats: {name}: {why}{_defaulted_because(oc, name)}")


def _defaulted_because(oc: OutputConfig, name: str) -> str:
    """Why a format the recipe did not name is in ``output.formats``, and how to leave it out."""
    if not oc._defaulted:
        return ""
    if oc.size is not None:
        return f" ({name} is the format output.size {oc.size} plans; name another in output.formats, or another size)"
    return (f" ({name} is in output.formats by default for a GGUF source; set output.formats: [hf] to write only the "
            "Hugging Face folder)")


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


def writer_options(oc: OutputConfig, result: CompressionResult | None = None) -> dict:
    """The recipe's format-specific output fields, as the writers read them; with ``result``, the bytes of
    the fits snapped onto the GGUF's grid (``stored``: GGUF tensor name → (type name, bytes)), which the
    gguf writer stores as they are."""
    opts = {"quant": oc.gguf_quant, "unquantizable": oc.gguf_unquantizable}
    stored = {f"blk.{i}.ffn_down.weight": f.stored["out.weight"]
              for i, f in ((result.fitted or {}) if result is not None else {}).items() if "out.weight" in f.stored}
    if stored:
        opts["stored"] = stored
    return opts
