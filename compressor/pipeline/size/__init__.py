"""The size stage (``output.size``): the file users ship, planned to a byte budget.

plan → allocate → write → gate → back off, in one package:

* :mod:`.target` — what a size plans into, one registered entry per format: :mod:`.gguf_target` (GGML
  types for llama.cpp) and :mod:`.ctensors_target` (integer schemes of a compressed-tensors checkpoint);
* :mod:`.budget` — the size resolved for this model: for a GGUF the F16 file written once (the file a
  deployer would quantize), llama.cpp's preset of that name made from it, and the exact bytes of any plan;
* :mod:`.prices` — one backward pass and the input moments of every linear layer, then every tensor
  priced in every option of the target (cached with the statistics);
* :mod:`.planner` — the least predicted loss within a byte budget (:mod:`compressor.policy.quantplan`);
* :mod:`.stage` — the loop: each plan written and measured by its writer where it runs (llama.cpp),
  judged by the gate's rule (:mod:`.gate`), ``smallest`` searched with the gate's own search.

The pipeline calls the functions below; each does nothing (returns None) for a recipe without a size,
so no other module asks whether there is one.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from compressor.core.errors import InputError
from compressor.core.params import count_params
from compressor.evaluation.evaluate import Evaluator, gate_ppl_limit
from compressor.output.base import WriteRequest
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import OutputConfig, Recipe
from compressor.pipeline.size import ctensors_target, gguf_target  # noqa: F401  (register the size targets)

logger = logging.getLogger(__name__)

def default_formats(oc: OutputConfig) -> list[str] | None:
    """``output.formats`` when the recipe names a size and no formats: the format whose anchor the size names
    (``W4A16``: compressed-tensors), else ``[gguf]``. None without a size."""
    from compressor.pipeline.size.target import default_format

    return [default_format(oc.size)] if oc.size is not None else None


def check(recipe: Recipe, model_type: str, src, *, given=None, config=None) -> None:
    """What a size needs, before the model loads: one sized format in ``output.formats`` (the one the size's
    name belongs to), a model held in memory unless that format streams (:attr:`~.target.SizeTarget.streams`:
    a GGUF is planned one onloaded layer at a time), and an architecture that format can be planned for."""
    from compressor.pipeline.size.target import target_for, targets

    oc = recipe.output
    if oc.size is None:
        return
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


def check_source(recipe: Recipe, config) -> None:
    """A size plans from float weights: a checkpoint whose weights are already integer codes (a
    compressed-tensors folder, llm-compressor's or compressor's own) is refused before it loads, naming what
    to give instead (the plan would otherwise fail after loading on the codes' scale tensors)."""
    if recipe.output.size is None:
        return
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
    from compressor.pipeline.size.target import target_for, targets

    mc = recipe.model
    if recipe.output.size is None:
        return
    avail = available_bytes()
    if mc.offload != "none":
        _warn_onloaded(config, mc.dtype, avail)
        return
    need = size_peak_of(config, offload="none", dtype=mc.dtype)
    if avail is None or need is None or need <= avail:
        return
    target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
    held = (f"held in memory ({mc.dtype}) the size plan needs about {need / 1e9:.1f} GB, {avail / 1e9:.1f} GB are "
            "available")
    from compressor.core.archs import moe_refusal

    if target.streams and moe_refusal(config, size=True, fmt=target.format, offload="disk") is not None:
        raise InputError(f"output.size: {held}, and a mixture of experts is planned held in memory (its experts "
                         "are not onloaded); run on a machine with more memory")
    if target.streams:
        onloaded = size_peak_of(config, offload="disk", dtype=mc.dtype)
        logger.warning("output.size: %s: onloading the decoder layers from disk (model.offload: disk, about "
                       "%.1f GB); set model.offload to choose", held, onloaded / 1e9)
        mc.offload = "disk"
        _warn_onloaded(config, mc.dtype, avail)
        return
    streamed = sorted(f for f, cls in targets().items() if cls.streams)
    raise InputError(f"output.size: {held} (within {LIMIT_ENV} or the container's limit, where set), and a "
                     f"{target.format} size is planned from a model held in memory; run on a machine with more "
                     f"memory, or plan {_streamed_fix(streamed)}, which onloads one layer at a time")


def _streamed_fix(streamed: list[str]) -> str:
    """The formats that stream, as settings that are not refused in turn: the format and a size of its own (a
    compressed-tensors size name with ``output.formats: [gguf]`` is refused as another format's size)."""
    from compressor.pipeline.size.target import targets

    def sizes(f: str) -> str:
        presets = targets()[f].presets
        example = "Q4_K_M" if "Q4_K_M" in presets else (presets[0] if presets else "750MB")
        return f"output.size: one of its sizes, e.g. {example}, or bytes"

    return " or ".join(f"{f} (output.formats: [{f}], {sizes(f)})" for f in streamed)


def _warn_onloaded(config, dtype: str, avail: int | None) -> None:
    """Said before loading when even the onloaded run's estimated peak (resident embedding and head, one layer,
    its statistics) passes the memory available: an estimate, so a warning, with what to change."""
    from compressor.engine.memory import size_peak_of

    need = size_peak_of(config, offload="disk", dtype=dtype)
    if avail is not None and need is not None and need > avail:
        logger.warning("output.size: the onloaded run needs about %.1f GB at its peak (memory model: "
                       "compressor.engine.memory.size_components), %.1f GB are available; it may be stopped for "
                       "memory: free memory, or give fewer calibration tokens", need / 1e9, avail / 1e9)


def check_output(recipe: Recipe, *, writes: bool) -> None:
    """A size plans the file a deployer ships: a run that writes nothing (``oneshot`` with a model object and
    no ``output_dir``) would plan nothing and change nothing, so it is refused before anything runs."""
    if recipe.output.size is not None and not writes:
        raise InputError(f"output.size: {recipe.output.size} plans the file you ship, but this run writes no output: "
                         "pass output_dir= to compressor.oneshot (or set output.path); the model in memory is "
                         "never changed by a size plan")


def size_refusal(recipe: Recipe, model_type: str, src) -> str | None:
    """Why a size cannot be planned for this architecture and source (None when it can, or without a size)."""
    from compressor.pipeline.size.target import target_for

    if recipe.output.size is None:
        return None
    return target_for(recipe.output.formats, recipe.output.size).refusal(model_type, src)


def writer_refusal(recipe: Recipe, name: str, why: str | None, model_type: str, src) -> str | None:
    """A writer's refusal, as a size plan sees it: the planned format's target decides (a GGUF source is
    re-quantized in its own architecture, so the gguf writer's architecture table does not apply)."""
    from compressor.pipeline.size.target import targets

    if why and recipe.output.size is not None and name in targets():
        return targets()[name]().writer_refusal(why, src)
    return why


def baseline_only(model, recipe: Recipe, streams: dict[str, torch.Tensor]) -> CompressionResult | None:
    """With a size, the blocks stay as they are: the original model's evaluation on the gate's domains
    (teacher caches), as a :class:`CompressionResult` whose final is its baseline. None without a size."""
    if recipe.output.size is None:
        return None
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    t0 = time.perf_counter()
    ev = Evaluator.build(model, streams, seq_len={n: cfgs[n].seq_len for n in streams},
                         stride={n: cfgs[n].stride for n in streams},
                         batch_size={n: cfgs[n].batch_size for n in streams},
                         top_k=min(c.kl_top_k for c in cfgs.values()))
    base = ev.baseline
    params = count_params(model)
    return CompressionResult(
        model=model, profiles=[], decisions=[], baseline=base, final=base,
        budget_ppl=gate_ppl_limit(base.ppl, recipe.policy), params_before=params, params_after=params,
        gate_passed=True, gate_message="no structural change (output.size plans the tensor types)",
        strategy="size", timings={"baseline_s": time.perf_counter() - t0},
        teachers={t.name: t for t in ev.teachers})


def ship(recipe: Recipe, request: WriteRequest, windows: torch.Tensor, checked, report: dict,
         result: CompressionResult, *, write: Callable[[], Path], use_cache: bool = True) -> Path | None:
    """plan → allocate → write → gate → back off; returns the verified staging folder of the chosen file
    (:class:`~compressor.core.errors.GateFailed` when none passes). None without a size. ``write()``: the
    pipeline's write and verify stages for ``request`` as it stands (each attempt sets its plan on it), the
    staging folder they made. ``use_cache``: the run's cache setting (False: ``--no-cache``, prices measured
    afresh whatever ``measure.cache`` says).

    The F16 and the preset live in a work folder beside the output (or under ``output.workdir``), removed on
    every exit, Ctrl-C and SIGTERM included (and reclaimed after a kill). The disk it needs is checked before
    the F16 is written; a write that fails for want of space says which file and what is free
    (:mod:`.workdir`)."""
    from compressor.core.moe import unfused_experts
    from compressor.pipeline.size import workdir as work
    from compressor.pipeline.size.planner import Planner
    from compressor.pipeline.size.prices import measure_and_price
    from compressor.pipeline.size.rounding import Compensator
    from compressor.pipeline.size.stage import SizeRun, check_floor
    from compressor.pipeline.size.target import target_for

    if recipe.output.size is None:
        return None
    if use_cache != recipe.measure.cache:  # the prices read measure.cache: --no-cache must reach them
        recipe = recipe.model_copy(update={"measure": recipe.measure.model_copy(update={"cache": use_cache})})
    workdir, need, since = work.work_folder(recipe, checked.out), None, time.time()
    try:  # the folder is made inside: a stop right after it is made still removes it
        work.make_work_folder(recipe, checked.out, workdir)
        t0 = time.perf_counter()
        target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
        need = work.disk_need(recipe, request, target.format)
        work.check_disk(need, workdir, checked.out)
        budget = target.budget(recipe.output.size, request, workdir)
        timings = {"budget_s": time.perf_counter() - t0}
        logger.info("output.size %s: %s bytes of %s (%s%s bytes are not planned)", budget.size,
                    f"{budget.limit:,}", target.what, f"measured beside {budget.preset['name']}; " if budget.preset
                    else "", f"{budget.overhead:,}")
        with unfused_experts(request.model):  # a routed expert's statistics are its own (compressor.core.moe)
            measured = measure_and_price(recipe, request.model, windows, timings, target, spill=workdir)
        planner = Planner(measured.units, measured.priced, budget)
        check_floor(planner, budget)
        report["timings"]["size_plan_s"] = time.perf_counter() - t0
        compensator = Compensator(request, measured.priced, windows, recipe.calibration.batch_size, timings, target,
                                  moments=measured.moments, rounded=measured.rounded, units=measured.units,
                                  precision=measured.precision)
        run = SizeRun(recipe, request, checked, report, result, planner, workdir, write, compensator, target,
                      head={"prices_from_cache": measured.cached, "timings": timings,
                            "rounding": recipe.output.rounding, "statistics_precision": measured.precision.name,
                            **target.report()})
        return run.search()
    except (OSError, RuntimeError) as exc:  # a full disk says which file, what is free and what the run needs
        full = work.disk_full_error(exc, workdir, checked.out, need, since)
        if full is None:
            raise
        raise full from exc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def structural(recipe: Recipe) -> bool:
    """Whether the run changes the model's blocks (its search is confirmed, its fits may snap onto the
    output's grid, and the model in memory becomes the compressed class after it): not with a size, which
    plans the file's tensor types and changes no weight of the model."""
    return recipe.output.size is None


def estimate(recipe: Recipe, model, cal: int, evals: int, fwd: float, params: int) -> dict[str, float] | None:
    """Expected seconds of the size stage's parts (None without a size): baseline, the statistics (a backward
    pass over :data:`~.prices.FISHER_TOKENS`, the input moments of every window), pricing (large tensors on
    a sample of rows), error-compensating rounding (GPTQ's pricing, and the chosen plan's, and the anchor's
    where the run makes it, over all rows, on the moments the pricing kept), and the file and its anchor
    checked where they run."""
    from compressor.pipeline.size.prices import FISHER_TOKENS, StatisticsPrecision
    from compressor.pipeline.size.target import target_for
    from compressor.policy.quantplan import priced_rows

    if recipe.output.size is None:
        return None
    weights = [p for p in {id(p): p for p in model.parameters()}.values() if p.dim() == 2]
    priced = sum(min(p.shape[0], priced_rows(p.shape[1])) * p.shape[1] for p in weights)
    fisher, moments = STATISTICS_FACTORS[StatisticsPrecision.resolve(recipe.output.size_precision, model).name]
    out = {"baseline": evals * fwd,
           "statistics": fwd * (fisher * min(cal, FISHER_TOKENS) + moments * cal),
           "pricing": priced * 8 * PRICE_SECONDS, "write + verify": 4 * evals * fwd + params * 1e-7}
    if recipe.output.rounding == "gptq":
        target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
        linears = [m.weight.shape for m in model.modules() if isinstance(m, torch.nn.Linear)]
        folds = 2 if target.heldout_prices else 1
        # per layer: one Ĥ factor (in³) per fold, then GPTQ (rows·in²) per option on the priced rows; the
        # rounding reads the moments the pricing kept (in memory, or spilled to the work folder)
        out["pricing"] += folds * sum(FACTOR_SECONDS * i ** 3 + GPTQ_SECONDS * target.gptq_options * i * i * min(
            o, priced_rows(i)) for o, i in linears)
        # a target that keeps pricing's full-row roundings rounds again only the tensors priced on a sample
        out["rounding"] = sum(
            FACTOR_SECONDS * i ** 3 + GPTQ_SECONDS * target.full_roundings * o * i * i for o, i in linears
            if not (target.keeps_priced_roundings and o <= priced_rows(i)))
    return out


#: Seconds per ``rows·in²`` of GPTQ rounding and per ``in³`` of its Ĥ factor on the 2-core machine: on the
#: off-grid Qwen2.5-Coder-1.5B, pricing six schemes took 8 min and rounding the plan 7.5 min besides its
#: moments; SmolLM2-135M's GPTQ pricing of nine GGML types about 45 s.
GPTQ_SECONDS = 5e-11
FACTOR_SECONDS = 1e-11
#: Seconds per weight per GGML type to price (quantize, decode, cost) on the 2-core machine: SmolLM2-135M's
#: 108 M priced weights in about 8 types each took 46 s (``report.json`` → ``size_plan.timings``).
PRICE_SECONDS = 5.3e-8
#: Per statistics precision (:class:`~.prices.StatisticsPrecision`): the loss-gradient pass per token, over a
#: float32 forward's, with its hooks; and the input moments of every linear per token (the forward and the
#: ``XᵀX`` products). SmolLM2-135M (a forward 0.87 ms a token): float32 16.5 s for 4,096 tokens and 37.5 s for
#: 14,336; bfloat16 4.4 s for 2,048 and 15.4 s for 14,336.
STATISTICS_FACTORS = {"float32": (4.6, 3.0), "bfloat16": (2.5, 1.25)}

__all__ = ["baseline_only", "check", "check_output", "check_source", "default_formats", "estimate", "fit_memory",
           "ship", "structural", "size_refusal", "writer_refusal"]
