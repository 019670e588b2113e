"""The size stage's run: the original's baseline on the gate's domains (no block changes), then plan →
allocate → write → verify → gate → back off (:func:`ship`), in a work folder removed on every exit. Called by
:class:`compressor.pipeline.size.SizeWorkflow`."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from compressor.core.params import count_params
from compressor.evaluation.gate import Evaluator, gate_ppl_limit
from compressor.evaluation.teacher import complete_rows
from compressor.output.base import WriteRequest
from compressor.pipeline.products import Checked
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)


def baseline_only(model, recipe: Recipe, streams: dict[str, torch.Tensor]) -> CompressionResult:
    """With a size, the blocks stay as they are: the original model's evaluation on the gate's domains
    (teacher caches), as a :class:`CompressionResult` whose final is its baseline."""
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    t0 = time.perf_counter()
    ev = Evaluator.build(model, streams, seq_len={n: cfgs[n].seq_len for n in streams},
                         stride={n: cfgs[n].stride for n in streams},
                         batch_size={n: cfgs[n].batch_size for n in streams},
                         top_k=min(c.kl_top_k for c in cfgs.values()))
    base = ev.baseline
    for teacher in ev.teachers:  # rank 0 scores the planned files on every window alone (torchrun)
        complete_rows(teacher)
    params = count_params(model)
    return CompressionResult(
        model=model, profiles=[], decisions=[], baseline=base, final=base,
        budget_ppl=gate_ppl_limit(base.ppl, recipe.policy), params_before=params, params_after=params,
        gate_passed=True, gate_message="no structural change (output.size plans the tensor types)",
        strategy="size", timings={"baseline_s": time.perf_counter() - t0},
        teachers={t.name: t for t in ev.teachers})


def ship(recipe: Recipe, request: WriteRequest, windows: torch.Tensor, checked: Checked, report: dict,
         result: CompressionResult, *, use_cache: bool = True) -> Path:
    """plan → allocate → write → verify → gate → back off; returns the verified staging folder of the chosen file
    (:class:`~compressor.core.errors.GateFailed` when none passes). Each attempt hands its plan to the format's
    writer (:class:`~.stage.SizeRun`). ``use_cache``: the run's cache setting (False: ``--no-cache``, prices
    measured afresh whatever ``measure.cache`` says).

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
    from compressor.output.registry import target_for

    if use_cache != recipe.measure.cache:  # the prices read measure.cache: --no-cache must reach them
        recipe = recipe.model_copy(update={"measure": recipe.measure.model_copy(update={"cache": use_cache})})
    workdir, need, since = work.work_folder(recipe, checked.out), None, time.time()
    try:  # the folder is made inside: a stop right after it is made still removes it
        work.make_work_folder(recipe, checked.out, workdir)
        t0 = time.perf_counter()
        target = target_for(recipe.output.formats, recipe.output.size, recipe.output)
        need = work.disk_need(recipe, request, target)
        work.check_disk(need, workdir, checked.out)
        budget = target.budget(recipe.output.planned, request, workdir)
        need = work.budget_need(need, recipe, request, budget, target.format)  # the budget itself, before pricing
        work.check_disk(need, workdir, checked.out)
        timings = {"budget_s": time.perf_counter() - t0}
        logger.info("output.size %s: %s bytes of %s (%s%s bytes are not planned)", budget.size,
                    f"{budget.limit:,}", target.what, f"measured beside {budget.preset['name']}; " if budget.preset
                    else "", f"{budget.overhead:,}")
        with unfused_experts(request.model):  # a routed expert's statistics are its own (compressor.core.moe)
            measured = measure_and_price(recipe, request.model, windows, timings, target, spill=workdir)
        # the anchor made with the run's own statistics (a GGUF's importance matrix) may set the budget's bytes
        target.measured(budget, measured.priced, recipe.calibration, windows, workdir)
        planner = Planner(measured.units, measured.priced, budget)
        check_floor(planner, budget)
        report["timings"]["size_plan_s"] = time.perf_counter() - t0
        compensator = Compensator.of(request, measured, windows, recipe.calibration.batch_size, timings, target,
                                     spill=workdir)
        run = SizeRun(recipe, request, checked, report, result, planner, workdir, compensator, target,
                      head={"prices_from_cache": measured.cached, "timings": timings,
                            "rounding": recipe.output.rounding, "statistics_precision": measured.precision.name,
                            **target.report(), **_ranks(measured.shares)})
        return run.search()
    except Exception as exc:  # noqa: BLE001 - a full disk says which file, what is free and what the run needs
        full = work.disk_full_error(exc, workdir, checked.out, need, since)
        if full is None:
            raise
        raise full from exc
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _ranks(shares) -> dict:
    """``ranks``: how the prices and the rounding were shared under torchrun (its lists are filled as the run goes
    and read when the report is written); nothing from one process."""
    return {"ranks": shares.to_json()} if shares is not None and shares.split else {}
