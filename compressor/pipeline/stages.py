"""The named stages of :func:`compressor.run`, in order:

check inputs → load → calibrate → compress → report → write → verify → publish.

Each stage is one function that takes what it needs (its config section and
the previous stages' products) and returns what the next ones need. Input
problems surface as :class:`~compressor.core.errors.InputError` (exit 2), as
early as they can be known: everything :func:`check` finds, it finds before
the model loads.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from compressor.core import distributed as dist
from compressor.core.archs import ArchSpec, arch_for
from compressor.core.errors import EXIT_GATE, InputError, UnsupportedModelError
from compressor.core.finite import check_weights_finite
from compressor.core.modeling import COMPRESSION_FORMAT
from compressor.core.version import __version__
from compressor.engine.resume import ResumeError, RunState, run_key
from compressor.inputs.calibration import (DataInput, build_calibration, evaluation_streams, load_tokenizer,
                                          self_evaluation_domains, self_evaluation_streams)
from compressor.inputs.data import CalibrationSet, OverlapError, check_disjoint
from compressor.inputs.load import ResolvedSource, load_model, model_config, object_source, resolve_source
from compressor.inputs.safety import OutputLock
from compressor.inputs.validate import check_context, check_inputs, run_reads
from compressor.output import VerificationError, WriteRequest, get_writer, publish, staging_folder
from compressor.output.hf import output_dtype, source_weight_bytes
from compressor.policy.compress import CompressionResult, compress_model
from compressor.recipe.schema import ModelConfig, OutputConfig, Recipe, width_multiple
from compressor.reports.render import model_card
from compressor.reports.report import build_report, evaluation_report

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
    """Fill in ``output.formats`` when the recipe does not set it: ``[gguf]`` with ``output.size``; ``[hf, gguf]`` for a GGUF source whose
    architecture the gguf writer takes (the output then goes where the source went, at its quantization),
    else ``[hf]``. Returns the formats; the recipe (and the ``recipe.yaml`` saved with the output) then
    names them. ``model_type``: the source's, when the caller has read it already."""
    oc = recipe.output
    if "formats" in oc.model_fields_set:
        return oc.formats
    from compressor.output.gguf import arch_refusal
    from compressor.pipeline import size

    formats = size.default_formats(oc)
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
        from compressor.pipeline.size.target import target_for

        fmt = target_for(recipe.output.formats, recipe.output.size, recipe.output).format
    if (why := moe_refusal(config, size=fmt is not None, fmt=fmt, offload=recipe.model.offload)) is not None:
        raise InputError(why)
    if write:  # where a size run's F16 goes: said before the model loads, as the output folder is
        from compressor.pipeline.size.workdir import check_workdir

        check_workdir(recipe, Path(src.path).expanduser().resolve() if src.is_local else None)
    size.check_source(recipe, config)
    if given is None and write:  # a size run that would not fit memory onloads (or is refused) before loading
        size.fit_memory(recipe, config)
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
    size.check_output(recipe, writes=write)
    if write:
        _check_writers(recipe, tokenizer, model_type, src, config)
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
    from compressor.evaluation.evaluate import confirmation_windows, window_count

    from compressor.pipeline import size

    f = recipe.policy.confirm_fraction
    if not f or not size.structural(recipe):  # a size plan's files are gated on every window: nothing to confirm
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
    from compressor.inputs.calibration import calibration_text
    from compressor.inputs.data import load_documents

    source = calibration_text(recipe)
    if source.kind() == "hub":
        with DataInput("calibration.dataset"):
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
    if (not src.gguf_file or not size.structural(recipe) or "gguf" not in oc.formats
            or getattr(oc, "gguf_quant", "source") != "source" or not get_kind(recipe.replacement.kind).snaps):
        return {}
    try:
        from compressor.core.ggml import GGMLType
        from compressor.output.gguf import source_tensor_types
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
        from compressor.output.gguf import source_down_block

        return source_down_block(Path(src.path) / src.gguf_file)
    except ImportError:  # no gguf-py: the gguf writer's own check names the missing package
        return 1


def _check_writers(recipe: Recipe, tokenizer, model_type: str, src: ResolvedSource, config=None) -> None:
    """Each requested format can represent this architecture and kind, takes its options and can carry
    the tokenizer: asked before the model loads, with the alternative in the message."""
    from compressor.pipeline import size

    oc = recipe.output
    options = writer_options(oc)
    size.check(recipe, model_type, src, config=config)
    kind = recipe.replacement.kind if size.structural(recipe) else "none"  # a size replaces no block
    for name in oc.writers():
        writer = get_writer(name)
        why = (writer.unsupported(model_type, kind) or writer.check_options(options)
               or writer.check_tokenizer(tokenizer, src))
        why = size.writer_refusal(recipe, name, why, model_type, src)
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


def load(mc: ModelConfig) -> Loaded:
    """Load the model and tokenizer; refuse corrupt weights and architectures that cannot be compressed."""
    model, tokenizer, src = load_model(
        mc.source, gguf_file=mc.gguf_file, dtype=mc.dtype, device=mc.device, offload=mc.offload,
        trust_remote_code=mc.trust_remote_code, revision=mc.revision,
    )
    return _loaded(model, tokenizer, src)


def from_object(model: nn.Module, tokenizer) -> Loaded:
    """A model object handed in (:func:`compressor.oneshot`) in place of :func:`load`: used as it is
    (its dtype and placement, ``device_map`` included); the same refusals as a loaded one."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise InputError(f"model: expected a transformers PreTrainedModel (e.g. from "
                         f"AutoModelForCausalLM.from_pretrained) or a source string, got {type(model).__name__}")
    src = object_source(model)
    if tokenizer is None:
        if src.path == "in-memory":
            raise InputError("tokenizer: required with a model object that names no checkpoint; pass "
                             "tokenizer=AutoTokenizer.from_pretrained(...)")
        from compressor.inputs.load import load_tokenizer as load_source_tokenizer

        tokenizer = load_source_tokenizer(src)
    model.eval()
    return _loaded(model, tokenizer, src)


def _loaded(model: nn.Module, tokenizer, src: ResolvedSource) -> Loaded:
    check_weights_finite(model)
    try:
        model_type, spec = arch_for(model, structural=False)  # a structural MoE run is refused before loading
    except UnsupportedModelError as e:
        raise InputError(str(e)) from None
    if not spec.causal_lm:
        raise InputError(
            f"{model_type} models are profile-only ({spec.note}); `compress` refuses them. Use `compressor profile`."
        )
    return Loaded(model, tokenizer, src, model_type, spec)


def check_loaded(recipe: Recipe, loaded: Loaded) -> None:
    """What needs the model's shape but no calibration: blocks named by the policy exist, and some are left."""
    from compressor.core.archs import find_blocks

    _, blocks = find_blocks(loaded.model, loaded.spec)
    n = len(blocks)
    pol = recipe.policy
    for name, given in (("policy.include", pol.include), ("policy.exclude", pol.exclude)):
        bad = sorted(i for i in given if i >= n)
        if bad:
            raise InputError(f"{name}: block(s) {bad} do not exist; this model has {n} blocks (0..{n - 1})")
    if set(range(n)) <= set(pol.exclude):
        raise InputError(f"policy.exclude names every block (0..{n - 1}): nothing is left to compress; "
                         "exclude fewer blocks")


def expect(recipe: Recipe, loaded: Loaded, *, use_cache: bool, checked: Checked | None = None) -> str | None:
    """Say how long the run is expected to take (logged; see :mod:`.estimate`). Returns the model's
    fingerprint when it was needed to look up cached calibration text (the calibration reuses it)."""
    from compressor.engine.cache import model_fingerprint
    from compressor.fitting.kinds import get_kind
    from compressor.pipeline.estimate import say_estimate

    writes = recipe.calibration.dataset in ("self", "mix") or self_evaluation_domains(recipe)
    fp = model_fingerprint(loaded.model) if writes and use_cache and dist.is_main() else None
    if dist.is_main():
        cached, to_write = _text_to_write(recipe, loaded, fp)
        say_estimate(recipe, loaded.model, self_text_cached=cached, hidden=get_kind(recipe.replacement.kind).needs_hidden,
                     recorded=checked.state.recorded() if checked is not None else None, self_eval_tokens=to_write)
    return fp


def _text_to_write(recipe: Recipe, loaded: Loaded, fp: str | None) -> tuple[bool, int]:
    """Whether the self-written calibration text is in the cache, and how many tokens of ``self`` evaluation
    text are not (``fp``: the model's fingerprint; None: no cache, everything is written)."""
    from compressor.inputs.calibration import self_evaluation_settings, self_settings
    from compressor.inputs.selfcal import is_cached

    written = self_evaluation_domains(recipe)
    if fp is None:
        return False, sum(e.max_tokens for e in written)
    tok, vocab = loaded.tokenizer, loaded.model.get_input_embeddings().weight.shape[0]
    cal_cached = recipe.calibration.dataset not in ("self", "mix") or is_cached(fp, tok, self_settings(recipe))
    return cal_cached, sum(e.max_tokens for e in written
                           if not is_cached(fp, tok, self_evaluation_settings(recipe, e, tok, vocab)))


def self_evaluation(recipe: Recipe, loaded: Loaded, checked: Checked, *, use_cache: bool,
                    model_fp: str | None = None) -> float:
    """Write the ``self`` evaluation domains' text with the original model (before anything is replaced) into
    ``checked.eval_streams``, in the recipe's domain order; returns the seconds it took."""
    t0 = time.perf_counter()
    streams = {**checked.eval_streams,
               **self_evaluation_streams(recipe, loaded.model, loaded.tokenizer, use_cache, model_fp)}
    checked.eval_streams = {e.domain_name(): streams[e.domain_name()] for e in recipe.evaluation_domains()}
    return time.perf_counter() - t0


def calibrate(recipe: Recipe, loaded: Loaded, checked: Checked, *, use_cache: bool,
              model_fp: str | None = None) -> Calibrated:
    """The text the model writes (the ``self`` evaluation domains, :func:`self_evaluation`; self-written
    calibration), then the calibration windows, checked disjoint from the evaluation text."""
    written_s = self_evaluation(recipe, loaded, checked, use_cache=use_cache, model_fp=model_fp)
    t0 = time.perf_counter()
    with DataInput("calibration.dataset"):
        cal, info = build_calibration(recipe, loaded.model, loaded.tokenizer, use_cache, model_fp)
    info["calibration_s"] = time.perf_counter() - t0
    if self_evaluation_domains(recipe):
        info["self_evaluation_s"] = written_s
    try:
        overlap = check_disjoint(cal, checked.eval_streams)
        checked.state.bind_calibration(calibration_key(recipe, cal, checked.eval_streams))
    except (OverlapError, ResumeError) as err:
        raise InputError(str(err)) from None
    return Calibrated(cal, info, overlap)


def calibration_key(recipe: Recipe, cal: CalibrationSet, streams: dict[str, torch.Tensor]) -> str:
    """What a resumed run must find unchanged once the model has written text: the calibration windows, and
    the ``self`` evaluation domains' ids (the text read from sources is in the key already, :func:`check`)."""
    from compressor.engine.resume import tokens_fingerprint

    written = {e.domain_name(): streams[e.domain_name()] for e in recipe.evaluation_domains() if e.self_written()}
    return cal.fingerprint() if not written else f"{cal.fingerprint()}+{tokens_fingerprint(written)}"


def compress(recipe: Recipe, loaded: Loaded, calibrated: Calibrated, checked: Checked) -> CompressionResult:
    """The policy engine: measure, fit, select and gate (:func:`compressor.policy.compress.compress_model`).
    With ``output.size`` the blocks stay as they are and the size stage plans the file instead."""
    from compressor.pipeline import size

    result = size.baseline_only(loaded.model, recipe, checked.eval_streams)
    if result is not None:
        result.timings = {**_text_timings(calibrated), **result.timings}
        return result
    try:
        result = compress_model(loaded.model, recipe, calibrated.cal, checked.eval_streams, state=checked.state,
                                width_multiple=checked.width_multiple, grid=checked.grid)
    except ResumeError as err:  # a saved state out of step with this run
        raise InputError(str(err)) from None
    result.timings = {**_text_timings(calibrated), **result.timings}
    return result


def _text_timings(calibrated: Calibrated) -> dict[str, float]:
    """The calibrate stage's seconds, moved from its info into the run's timings."""
    return {k: calibrated.info.pop(k) for k in ("self_evaluation_s", "calibration_s") if k in calibrated.info}


def report(recipe: Recipe, loaded: Loaded, calibrated: Calibrated, checked: Checked,
           result: CompressionResult) -> dict:
    """The run report (``report.json``) as far as it is known before writing."""
    cache_info = {"enabled": False, "hit": False, "key": None}  # the engine measures as it goes
    rep = build_report(recipe, loaded.source, loaded.model_type, result, calibrated.cal, cache_info, checked.out)
    rep["calibration"].update(calibrated.info)
    from compressor.inputs.provenance import source_metadata

    rep["model"].update(source_metadata(loaded.source))
    rep["resumed"] = checked.state.resumed
    # which fits the gate measured on the output file's grid (compressor.fitting.snap)
    rep["snapped"] = {str(i): f.stored["out.weight"][0] for i, f in sorted((result.fitted or {}).items())
                      if "out.weight" in f.stored}
    rep["evaluation"] = evaluation_report(recipe, result, checked.eval_streams, calibrated.overlap)
    for w in rep["evaluation"]["warnings"]:
        logger.warning("%s", w)
    dtype = save_dtype(recipe, loaded)
    rep["size"] = {"source_bytes": source_weight_bytes(loaded.source), "output_bytes": None,
                   "output_dtype": str(dtype).removeprefix("torch."),
                   "output_dtype_is_source": recipe.output.dtype == "source" and not loaded.source.gguf_file}
    return rep


def save_dtype(recipe: Recipe, loaded: Loaded) -> torch.dtype:
    """``output.dtype`` resolved: ``source`` is the source checkpoint's dtype, or a model object's own."""
    if recipe.output.dtype == "source" and loaded.source.in_memory:
        return next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), torch.float32)
    return output_dtype(recipe.output.dtype, loaded.source, revision=recipe.model.revision)


@dataclass
class Reference:
    """What only the original model can say, taken before anything is replaced: its greedy
    continuations of a few evaluation prompts, and its task scores (``evaluation.tasks``)."""

    continuations: object
    tasks: dict | None = None


def reference(recipe: Recipe, loaded: Loaded, checked: Checked) -> Reference:
    """The original model's greedy continuations (:mod:`compressor.evaluation.agreement`) and, when the
    recipe names ``evaluation.tasks``, its task scores (:mod:`compressor.evaluation.tasks`)."""
    from compressor.evaluation.agreement import continuation_reference

    from compressor.pipeline import size

    e = recipe.evaluation_domains()[0]
    # a size plan leaves the model in memory as it is: its continuations would be compared with themselves (and
    # generating them token by token reads an onloaded model's every layer per token)
    conts = (continuation_reference(loaded.model, checked.eval_streams[e.domain_name()], seq_len=e.seq_len)
             if size.structural(recipe) else None)
    tasks = None
    section = recipe.task_section()
    if section is not None:
        from compressor.evaluation.tasks import run_tasks

        t0 = time.perf_counter()
        tasks = run_tasks(loaded.model, loaded.tokenizer, section)
        logger.info("tasks on the original model (%.0f s): %s", time.perf_counter() - t0,
                    {t: r.get(r.get("primary")) for t, r in tasks.items()})
    return Reference(conts, tasks)


def compare(recipe: Recipe, loaded: Loaded, ref: Reference, result: CompressionResult, rep: dict) -> None:
    """The compressed model against the original's :class:`Reference`: greedy agreement (next tokens
    from the gate's last evaluation, continuations now) into ``rep["agreement"]``; task scores side by
    side into ``rep["tasks"]``, with ``policy.task_budget`` applied (over it fails the gate)."""
    from compressor.evaluation.agreement import continuation_agreement

    final = result.final
    domains = getattr(final, "domains", None) or {"": final}
    rep["agreement"] = {
        "next_token": getattr(final, "agreement", None), "next_token_se": getattr(final, "agreement_se", None),
        "domains": {n: getattr(ev, "agreement", None) for n, ev in domains.items()},
        "continuations": (continuation_agreement(loaded.model, ref.continuations)
                          if ref.continuations is not None else None),
    }
    if ref.tasks is None:
        return
    from compressor.evaluation.tasks import compare_tasks, run_tasks

    t0 = time.perf_counter()
    after = run_tasks(loaded.model, loaded.tokenizer, recipe.task_section())
    rep["timings"]["tasks_s"] = time.perf_counter() - t0
    rep["tasks"] = compare_tasks(ref.tasks, after, recipe.policy.task_budget)
    if result.gate_passed and not rep["tasks"]["passed"]:
        result.gate_passed = False
        result.gate_message = f"task budget exceeded: {rep['tasks']['message']}"
        rep.update(status="rejected", exit_code=EXIT_GATE, message=result.gate_message)


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


def adopt(model: nn.Module, compression: dict) -> None:
    """Make the compressed model in memory what a reload of its folder gives: its config becomes the
    ``compressed_<type>`` one carrying ``compression`` (so its own ``save_pretrained`` folder reloads with
    compressor imported), its class the registered compressed class (same forward, same weights)."""
    from compressor.output.hf import adopt_compressed

    adopt_compressed(model, compression)


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


def write(oc: OutputConfig, request: WriteRequest, checked: Checked, timings: dict | None = None) -> Path:
    """Every requested format into one staging folder beside the output; returns the folder.

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
    try:
        for name in oc.writers():
            t0 = time.perf_counter()
            get_writer(name).write(request, tmp)
            if timings is not None:
                timings[f"write_{name}_s"] = time.perf_counter() - t0
    except BaseException:
        remove_tree(tmp)
        raise
    return tmp


def verify(oc: OutputConfig, request: WriteRequest, tmp: Path, rep: dict) -> None:
    """Each writer reloads its own output and compares it with the in-memory model; a mismatch
    removes the staging folder and raises (nothing is published)."""
    from compressor.output.gguf import GGUFGateMissed

    try:
        for name in oc.writers():
            t0 = time.perf_counter()
            try:
                check = get_writer(name).verify(request, tmp)
            except GGUFGateMissed as missed:
                rep.setdefault("verification", {})[name] = missed.check
                raise _gguf_gate_failed(rep, str(missed)) from None
            rep["timings"][f"verify_{name}_s"] = time.perf_counter() - t0
            rep.setdefault("verification", {})[name] = check
            if name in ("hf", "hf-standard"):
                rep["reload_check"] = check  # the field report.json readers know
    except BaseException:
        remove_tree(tmp)
        raise


def _gguf_gate_failed(rep: dict, message: str):
    """The report and exception of a GGUF over the gate in llama.cpp (exit 3, nothing written)."""
    from compressor.core.errors import GateFailed

    rep.update(status="rejected", exit_code=3, message=message, output=None)
    return GateFailed(message, report=rep)


def publish_output(tmp: Path, out: Path, rep: dict, t_start: float, recipe: Recipe | None = None) -> Path:
    """Write ``report.json`` into the verified staging folder, with the resolved ``recipe.yaml`` and the model
    card (``README.md``) where no writer wrote them, and rename it into place."""
    try:
        rep["size"].update(output_sizes(tmp, rep["size"]))
        rep["size"]["like_with_like"] = like_with_like(rep)
        rep["timings"]["total_s"] = time.perf_counter() - t_start
        if recipe is not None:  # what a writer did not write itself (a GGUF-only folder)
            for name, text in (("recipe.yaml", recipe.to_yaml()), ("README.md", model_card(rep))):
                if not (tmp / name).exists():
                    (tmp / name).write_text(text)
        # what this run wrote: a later --overwrite replaces these and keeps whatever else is put beside them
        rep["files"] = sorted({p.name for p in tmp.iterdir()} | {"report.json"})
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
    size, gguf = rep["size"], (rep.get("verification") or {}).get("gguf") or {}
    src = size.get("source_bytes")
    if not src:
        return None
    if rep["model"]["resolved"].endswith(".gguf"):
        if size.get("gguf_bytes") is None or gguf.get("quant") != "source":
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


__all__ = ["Calibrated", "Checked", "Loaded", "Reference", "VerificationError", "adopt", "calibrate", "check",
           "check_loaded", "compare", "compress", "compression_section", "from_object", "load", "publish_output",
           "reference", "remove_tree", "report", "verify", "write", "write_request"]
