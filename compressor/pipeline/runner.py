"""``run``: a whole recipe as a short composition of the named stages in :mod:`.stages`."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from compressor.core import distributed as dist
from compressor.core.errors import EXIT_GATE, EXIT_OK, exit_code_for
from compressor.pipeline import stages
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    exit_code: int
    report: dict
    output: Path | None = None
    result: CompressionResult | None = field(default=None, repr=False)


def run(recipe: Recipe, *, use_cache: bool | None = None, resume: bool = False, keep_state: bool = False,
        measurements_from: str | Path | None = None) -> RunResult:
    """Run a whole recipe. Raises :class:`~compressor.core.errors.RecipeError` /
    :class:`~compressor.core.errors.InputError` for bad input.

    Returns a :class:`RunResult`; ``exit_code`` is :data:`EXIT_GATE` when the
    perplexity gate failed (then nothing is written).

    Every finished layer and evaluation is checkpointed beside the output
    (:mod:`compressor.engine.resume`); ``resume=True`` continues a run that was
    interrupted, with the same result as an uninterrupted one. Without it, an
    earlier run's state for this output is discarded. The state is deleted when
    the run ends unless ``keep_state``; a later run whose recipe differs only in
    the policy's gate settings then takes its measurements (pass A, loss
    gradients, baseline) with ``measurements_from=<this output>``, or with
    ``resume=True`` on the same output, and runs only its gate.

    Under a process group (``torchrun``; see :mod:`compressor.core.distributed`) every
    rank calls it: calibration and evaluation are sharded, the decisions come out
    the same on every rank, and rank 0 alone writes; the others wait for it and
    return its report, or raise :class:`~compressor.core.distributed.RankFailed`.

    >>> import compressor                                                          # doctest: +SKIP
    >>> res = compressor.run(compressor.load_recipe("recipes/smollm2-135m.yaml"))  # doctest: +SKIP
    >>> res.exit_code, res.output                                                  # doctest: +SKIP
    """
    t_start = time.perf_counter()
    use_cache = recipe.measure.cache if use_cache is None else use_cache
    checked = stages.check(recipe, resume=resume, measurements_from=measurements_from)
    checked.keep_state = keep_state
    try:
        return _run_checked(recipe, checked, use_cache, t_start)
    finally:
        checked.release()


def _run_checked(recipe: Recipe, checked: stages.Checked, use_cache: bool, t_start: float) -> RunResult:
    t = time.perf_counter()
    loaded = stages.load(recipe.model)
    load_s = time.perf_counter() - t
    stages.check_loaded(recipe, loaded)
    fp = stages.expect(recipe, loaded, use_cache=use_cache, checked=checked)
    calibrated = stages.calibrate(recipe, loaded, checked, use_cache=use_cache, model_fp=fp)
    result = stages.compress(recipe, loaded, calibrated, checked)
    result.timings = {"check_s": checked.seconds, "load_s": load_s, **result.timings}
    report = stages.report(recipe, loaded, calibrated, checked, result)
    if not result.gate_passed:
        report.update(status="rejected", exit_code=EXIT_GATE, message=result.gate_message, output=None)
        logger.error("perplexity gate failed: %s; nothing was written", result.gate_message)
        _end_state(checked)
        return RunResult(EXIT_GATE, report, None, result)
    if not dist.is_main():
        return _wait_for_main(result)
    sizing = None
    try:
        request = stages.write_request(recipe, loaded, checked, result, report)
        if recipe.output.size is not None:
            sizing = sized(recipe, request, calibrated, checked, report)
        tmp = stages.write(recipe.output, request, checked, report["timings"])
        if sizing is not None:
            tmp = fit_budget(sizing, recipe, request, checked, report, tmp)
        stages.verify(recipe.output, request, tmp, report)
        if sizing is not None:
            stages.size_gate(recipe, report, tmp)
        out = stages.publish_output(tmp, checked.out, report, t_start)
    except BaseException as err:
        dist.broadcast_object(((exit_code_for(err), f"{type(err).__name__}: {err}"), None))
        raise
    finally:
        if sizing is not None:
            sizing.cleanup()
    dist.broadcast_object((None, report))
    _end_state(checked)
    logger.info("saved compressed model to %s", out)
    logger.info("%s", result.gate_message)
    return RunResult(EXIT_OK, report, out, result)


def sized(recipe: Recipe, request, calibrated: stages.Calibrated, checked: stages.Checked, report: dict):
    """The size stage (:mod:`compressor.pipeline.sizing`): plan every tensor's type; the writers get the plan."""
    import torch

    from compressor.pipeline.sizing import plan_size

    t0 = time.perf_counter()
    cal = calibrated.cal
    sizing = plan_size(recipe, request, torch.cat([cal.fit, cal.heldout]), checked.out)
    request.options.update(sizing.writer_options())
    report["size_plan"] = sizing.to_json()
    report["timings"]["size_plan_s"] = time.perf_counter() - t0
    return sizing


def fit_budget(sizing, recipe: Recipe, request, checked: stages.Checked, report: dict, tmp: Path) -> Path:
    """Re-plan and write again while the GGUF is over its budget (its non-tensor bytes were estimated)."""
    from compressor.pipeline.sizing import replan

    for _ in range(3):
        if not replan(sizing, (tmp / "model.gguf").stat().st_size):
            break
        stages._remove(tmp)
        request.options.update(sizing.writer_options())
        report["size_plan"] = sizing.to_json()
        tmp = stages.write(recipe.output, request, checked, report["timings"])
    return tmp


def _end_state(checked: stages.Checked) -> None:
    """The run ended: delete its state, or keep it (``keep_state``) for runs at other budgets."""
    state = checked.state
    if not checked.keep_state:
        state.discard()
    elif dist.is_main() and state.enabled:
        size = sum(p.stat().st_size for p in state.folder.iterdir() if p.is_file())
        logger.info("run state kept at %s (%.1f GB): a run of this recipe with other gate settings (policy.ppl_budget, "
                    "ffn_keep, …) takes its measurements with --measurements-from %s; delete the folder when done",
                    state.folder, size / 1e9, checked.out)


def _wait_for_main(result: CompressionResult) -> RunResult:
    """A rank other than 0: wait for rank 0's write and return its report (or its failure)."""
    failed, report = dist.broadcast_object()
    if failed is not None:
        raise dist.RankFailed(*failed)
    return RunResult(EXIT_OK, report, Path(report["output"]), result)
