"""What a size run needs, checked before the model loads: its format and architecture, a float source, the
memory (onloading by itself where its format streams), and an output to write. Called by
:class:`compressor.pipeline.size.SizeWorkflow`."""

from __future__ import annotations

import logging

from compressor.core.errors import InputError
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)


def check(recipe: Recipe, model_type: str, src, *, given=None, config=None) -> None:
    """What a size needs, before the model loads: one sized format in ``output.formats`` (the one the size's
    name belongs to), a model held in memory unless that format streams (:attr:`~.target.SizeTarget.streams`:
    a GGUF is planned one onloaded layer at a time), and an architecture that format can be planned for."""
    from compressor.output.registry import target_for, targets

    oc = recipe.output
    target = target_for(oc.formats, oc.size, oc)
    if recipe.model.offload != "none" and given is None and not target.streams:
        streamed = sorted(f for f, cls in targets().items() if cls.streams)
        raise InputError(f"output.size: a {target.format} file is planned from a model held in memory, and "
                         f"model.offload is {recipe.model.offload}; use model.offload: none (the model in "
                         f"float32 must fit in memory), or plan {_streamed_fix(streamed)}, which onloads one "
                         "layer at a time")
    why = target.refusal(model_type, src, config)
    if why:
        raise InputError(f"output.size: {why}; remove output.size to write only a Hugging Face folder "
                         "(output.formats: [hf])")


def check_moe(recipe: Recipe, config) -> None:
    """A mixture of experts is planned only into a format that holds its experts one by one
    (:attr:`~compressor.sizing.target.SizeTarget.plans_experts`), held in memory."""
    from compressor.core.archs import moe_refusal
    from compressor.output.registry import target_for

    target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
    why = moe_refusal(config, size=True, fmt=target.format, plans_experts=target.plans_experts,
                      offload=recipe.model.offload)
    if why is not None:
        raise InputError(why)


def check_source(recipe: Recipe, config) -> None:
    """A size plans from float weights: a checkpoint whose weights are already integer codes (a
    compressed-tensors folder, llm-compressor's or compressor's own) is refused before it loads, naming what
    to give instead (the plan would otherwise fail after loading on the codes' scale tensors)."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    raise InputError(f"output.size: {recipe.model.source} is a quantized checkpoint ("
                     f"{method or 'quantization_config'} in its config.json): its weights are integer codes and "
                     "scales, not the float weights a size is planned from; give the float (bf16/fp16/fp32) "
                     "checkpoint it was made from, or a GGUF of it (model.source: FILE.gguf)")


def fit_memory(recipe: Recipe, config) -> None:
    """Before the model loads: a size run whose model, held in memory in its compute dtype, with its statistics,
    does not fit the memory available (:func:`~compressor.core.hostmem.available_bytes`) onloads its layers
    (``model.offload: disk``, said in the log) when its format streams, else is refused naming what it needs.
    Never the kernel's OOM killer half-way through."""
    from compressor.core.hostmem import LIMIT_ENV, available_bytes
    from compressor.engine.memory import size_peak_of
    from compressor.output.registry import target_for, targets

    mc = recipe.model
    avail = available_bytes()
    target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
    if mc.offload != "none":
        _warn_onloaded(config, mc.dtype, avail, target)
        return
    need = size_peak_of(config, offload="none", dtype=mc.dtype, reload_check=target.reload_check)
    if avail is None or need is None or need <= avail:
        return
    held = (f"held in memory ({mc.dtype}) the size plan needs about {need / 1e9:.1f} GB, {avail / 1e9:.1f} GB are "
            "available")
    from compressor.core.archs import moe_refusal

    if target.streams and moe_refusal(config, size=True, fmt=target.format, plans_experts=target.plans_experts,
                                      offload="disk") is not None:
        raise InputError(f"output.size: {held}, and a mixture of experts is planned held in memory (its experts "
                         "are not onloaded); run on a machine with more memory")
    if target.streams:
        onloaded = size_peak_of(config, offload="disk", dtype=mc.dtype, reload_check=target.reload_check)
        logger.warning("output.size: %s: onloading the decoder layers from disk (model.offload: disk, about "
                       "%.1f GB); set model.offload to choose", held, onloaded / 1e9)
        mc.offload = "disk"
        _warn_onloaded(config, mc.dtype, avail, target)
        return
    streamed = sorted(f for f, cls in targets().items() if cls.streams)
    raise InputError(f"output.size: {held} (within {LIMIT_ENV} or the container's limit, where set), and a "
                     f"{target.format} size is planned from a model held in memory; run on a machine with more "
                     f"memory, or plan {_streamed_fix(streamed)}, which onloads one layer at a time")


def _streamed_fix(streamed: list[str]) -> str:
    """The formats that stream, as settings that are not refused in turn: the format and a size of its own (a
    compressed-tensors size name with ``output.formats: [gguf]`` is refused as another format's size)."""
    from compressor.output.registry import targets

    def sizes(f: str) -> str:
        presets = targets()[f].presets
        example = "Q4_K_M" if "Q4_K_M" in presets else (presets[0] if presets else "750MB")
        return f"output.size: one of its sizes, e.g. {example}, or bytes"

    return " or ".join(f"{f} (output.formats: [{f}], {sizes(f)})" for f in streamed)


def _warn_onloaded(config, dtype: str, avail: int | None, target) -> None:
    """Said before loading when even the onloaded run's estimated peak (resident embedding and head, one layer,
    its statistics; a compressed-tensors checkpoint's reload) passes the memory available: an estimate, so a
    warning, with what to change."""
    from compressor.engine.memory import size_peak_of

    need = size_peak_of(config, offload="disk", dtype=dtype, reload_check=target.reload_check)
    if avail is not None and need is not None and need > avail:
        logger.warning("output.size: the onloaded run needs about %.1f GB at its peak (memory model: "
                       "compressor.engine.memory.size_components), %.1f GB are available; it may be stopped for "
                       "memory: free memory, or give fewer calibration tokens", need / 1e9, avail / 1e9)


def check_output(recipe: Recipe, *, writes: bool) -> None:
    """A size plans the file a deployer ships: a run that writes nothing (``oneshot`` with a model object and
    no ``output_dir``) would plan nothing and change nothing, so it is refused before anything runs."""
    if not writes:
        raise InputError(f"output.size: {recipe.output.size} plans the file you ship, but this run writes no output: "
                         "pass output_dir= to compressor.oneshot (or overrides={'output.path': DIR}); the model in "
                         "memory is never changed by a size plan")


def writer_refusal(recipe: Recipe, name: str, why: str | None, model_type: str, src) -> str | None:
    """A writer's refusal, as a size plan sees it: the planned format's target decides (a GGUF source is
    re-quantized in its own architecture, so the gguf writer's architecture table does not apply)."""
    from compressor.output.registry import targets

    if why and name in targets():
        return targets()[name]().writer_refusal(why, src)
    return why
