"""The policy engine: plan → allocate → gate → apply, over one layer-sequential pass.

* plan (:mod:`compressor.policy.plan`): pass A (:class:`~compressor.engine.walker.LayerWalker`),
  per layer the statistics the kind needs, the R²_lin profile, and either the kind's fit at its
  configured level (``greedy``) or its error curve (``allocate``);
* ``greedy`` (:mod:`compressor.policy.greedy`): whole-block swaps tried one at a time;
* ``allocate``: the curves' options split one global FFN-parameter target across blocks
  (:mod:`compressor.policy.allocate`); the gate (:mod:`compressor.policy.gate`) searches the target
  (:mod:`compressor.policy.search`) and installs the fits (:mod:`compressor.policy.apply`); with
  ``output.architecture: standard`` the split is one width for every block (the base class's
  ``intermediate_size``), bisected over the widths on the grid.

Widths: the prune/hybrid kinds offer only the FFN widths the outputs can take,
multiples of :func:`compressor.recipe.schema.width_multiple` (see
:mod:`compressor.fitting.kinds.hidden`), so the allocation chooses among them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from compressor.core.archs import find_blocks
from compressor.core.onload import is_offloaded
from compressor.engine.runstate import RunState
from compressor.engine.sensitivity import output_grad_moments
from compressor.engine.spill import BlockStore
from compressor.engine.walker import LayerWalker
from compressor.evaluation.gate import DomainEvaluations, Evaluator, gate_check, gate_ppl_limit, headroom_note
from compressor.fitting.kinds import get_kind
from compressor.fitting.replace import count_params, ffn_path
from compressor.inputs.data import CalibrationSet
from compressor.policy.apply import Installer
from compressor.policy.confirm import Confirmation
from compressor.policy.gate import run_allocate
from compressor.policy.greedy import greedy_gate
from compressor.policy.plan import Blocks, Plan, activation, checkpointed_walk, measure
from compressor.policy.plan import scarce_rows_message  # noqa: F401  (its home before the split)
from compressor.policy.result import BlockDecision, CompressionResult, GateSplits, blocks_phrase, no_cut_message
from compressor.policy.search import smallest_cut  # noqa: F401  (its home before the split)
from compressor.recipe.schema import Recipe, width_multiple as output_width_multiple

logger = logging.getLogger(__name__)

# Keep every block's statistics in RAM for the allocate strategy (a back-off
# step re-solves instead of re-running calibration) while they take less than
# this share of the available memory; beyond it they are spilled to disk.
KEEP_STATS_MEMORY_SHARE = 0.3
# Calibration windows that feed the loss-gradient statistics (a diagonal
# second moment settles long before the fit statistics do).
FISHER_MAX_WINDOWS = 128


def keeps_intercept(model: nn.Module, spec) -> bool:
    """Whether the base class can carry the intercept (bias) of a re-solved down projection: its down
    projection has a bias (GPT-2, GPT-NeoX), or its config switches MLP biases on (Llama's ``mlp_bias``,
    a bias on gate, up and down). Otherwise (Qwen2, Qwen3, Mistral, Gemma 3) an
    ``output.architecture: standard`` fit is solved without one."""
    _, blocks = find_blocks(model, spec)
    down = blocks[0].get_submodule(spec.ffn_out).get_submodule(spec.ffn_down)
    if getattr(down, "bias", None) is not None:
        return True
    return "mlp_bias" in inspect.signature(type(model.config).__init__).parameters


def compress_model(
    model: nn.Module, recipe: Recipe, calibration: CalibrationSet, eval_tokens: torch.Tensor | dict[str, torch.Tensor],
    *, state: RunState | None = None, width_multiple: int | None = None, grid: dict[int, str] | None = None,
) -> CompressionResult:
    """Run measure → fit → select → replace → validate on ``model`` in place: plan (pass A), then
    the strategy (greedy swaps, or allocate → gate → apply).

    ``eval_tokens``: one id stream, or ``{domain name: ids}`` for the
    recipe's evaluation domains (the gate must hold on each). ``state``
    checkpoints every finished layer and evaluation, and skips those an
    interrupted run recorded (:mod:`compressor.engine.runstate`).
    ``width_multiple``: the multiple the kept FFN widths of the prune/hybrid kinds come in
    (default: :func:`compressor.recipe.schema.width_multiple` of the recipe's output, which needs
    the caller's help only for a GGUF source written at its own quantization). ``grid``: block → the
    GGML type the output file stores its down projection in; a kind that snaps (``prune``) fits onto it,
    so the gate measures what the file holds (:mod:`compressor.fitting.snap`)."""
    state = state or RunState()
    m, pol, strategy = recipe.measure, recipe.policy, recipe.strategy()
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    walker = LayerWalker(model, {"fit": calibration.fit, "heldout": calibration.heldout},
                         batch_size=recipe.calibration.batch_size)
    blocks, multiple = _blocks(model, recipe, walker, width_multiple)
    blocks.grid = dict(grid or {})
    if blocks.grid and blocks.kind.snaps:
        logger.info("fits snapped onto the output file's types (%s), so the gate measures what it holds",
                    ", ".join(sorted(set(blocks.grid.values()))))
    # allocate re-solves blocks from their statistics: in RAM while they fit, else spilled to
    # disk (always when the model is onloaded: memory then stays flat in depth).
    kept = BlockStore(len(blocks.modules), spill=True if is_offloaded(model) else None,
                      memory_share=KEEP_STATS_MEMORY_SHARE, folder=state.scratch_folder())
    blocks.grad_moments = _gradients(model, recipe, calibration, blocks.modules, state, timings)
    walk = functools.partial(checkpointed_walk, walker, state, hidden=blocks.kind.needs_hidden,
                             spike_factor=m.spike_factor, compute_dtype=_dtype(recipe))
    # A width rule changes the recorded curves: its own description keeps a resume from mixing them.
    plan = measure(blocks, recipe, strategy, walk, kept,
                   "calibrate" + (f" (FFN widths in multiples of {multiple})" if multiple > 1 else ""))
    timings["measure_s"] = time.perf_counter() - t0 - timings.get("sensitivity_s", 0.0)  # pass A alone

    gate = _gate_evaluations(model, recipe, eval_tokens, state, timings)
    baseline, evaluate, confirmation = gate.search_baseline, gate.evaluate, gate.confirmation

    def check(candidate: DomainEvaluations) -> tuple[bool, str]:
        ok, why, _ = gate_check(baseline, candidate, pol)
        return ok, why

    decisions = _decisions(plan, blocks.modules, recipe.replacement.kind)
    params_before = count_params(model)
    t0 = time.perf_counter()
    attempts: list[dict] = []
    if strategy == "greedy":
        for d in decisions:
            f = plan.fitted[d.index]
            d.size, d.replacement_params, d.r2_replacement = (
                f.config.get("units", f.config.get("rank")),
                f.params,
                f.heldout_r2,
            )
        final, accepted = greedy_gate(model, plan.fitted, plan.profiles, decisions, pol, baseline, evaluate, check,
                                      sweep_all=m.swap_sweep, confirmation=confirmation)
    else:
        final, plan.fitted, attempts = run_allocate(
            Installer(blocks, kept, walk), plan.curves, decisions, pol, baseline, evaluate, check, timings,
            target=getattr(recipe.replacement, "target", "none"), standard=recipe.output.architecture == "standard",
            multiple=multiple, confirmation=confirmation)
        accepted = sorted(plan.fitted)
    timings["gate_s"] = time.perf_counter() - t0
    kept.close()
    passed, msg = _verdict(recipe, baseline, final, accepted, attempts, check, confirmation)
    splits = gate.splits(final, accepted)
    return CompressionResult(
        model=model, profiles=plan.profiles, decisions=decisions, baseline=gate.baseline,
        final=_whole(gate, final, accepted), budget_ppl=gate.limit, params_before=params_before,
        params_after=count_params(model), gate_passed=passed, gate_message=msg, strategy=strategy, timings=timings,
        fitted={i: plan.fitted[i] for i in accepted}, attempts=attempts, splits=splits,
    )


def _dtype(recipe: Recipe) -> torch.dtype:
    return {"float32": torch.float32, "float64": torch.float64}[recipe.measure.precision]


def _blocks(model: nn.Module, recipe: Recipe, walker: LayerWalker, width_multiple: int | None) -> tuple[Blocks, int]:
    """The FFN blocks and how the kind fits them; with the multiple the kept widths come in."""
    rc = recipe.replacement
    kind, spec, standard = get_kind(rc.kind), walker.spec, recipe.output.architecture == "standard"
    multiple = 1
    if kind.needs_hidden:
        multiple = width_multiple if width_multiple is not None else output_width_multiple(recipe.output)
    if kind.needs_hidden and not (spec.ffn_up and spec.ffn_down):
        raise ValueError(f"replacement kind {rc.kind} needs the FFN's hidden units, which "
                         f"compressor/archs.py does not locate for {walker.model_type}")
    intercept = not standard or keeps_intercept(model, spec)
    if standard:
        logger.info("output.architecture: standard: one FFN width for every block, in multiples of %d; the down "
                    "projection is re-solved %s", multiple, "with its intercept" if intercept else
                    f"without an intercept ({walker.model_type}'s MLP has no bias)")
    modules = {i: ffn_path(model, i) for i in range(len(walker.layers))}
    ffn_params = {i: count_params(model.get_submodule(path)) for i, path in modules.items()}
    # The width rule, passed to the hidden-unit kinds only when it restricts something (the
    # default calls stay exactly what they were).
    widths = {"multiple": multiple} if multiple > 1 else {}
    return Blocks(model, spec, kind, rc, modules, ffn_params, activation(model, spec), widths, intercept), multiple


def _gradients(model: nn.Module, recipe: Recipe, calibration: CalibrationSet, modules: dict[int, str],
               state: RunState, timings: dict[str, float]) -> dict[int, torch.Tensor]:
    """The loss-gradient statistics at every block's output, when the allocation or the selection needs them."""
    needs = (recipe.strategy() == "allocate" and recipe.policy.allocation == "fisher"
             or getattr(recipe.replacement, "selection", "obs") == "loss")
    if not needs:
        return {}
    if is_offloaded(model):
        logger.warning("the loss-gradient pass (allocation: fisher / selection: loss) holds every layer's weights "
                       "for its backward, so an onloaded model is materialised whole for it; for models larger "
                       "than memory use policy.allocation: residual")
    t = time.perf_counter()
    moments = state.once("sensitivity", "loss-gradient statistics", lambda: output_grad_moments(
        model, calibration.fit[:FISHER_MAX_WINDOWS], modules, batch_size=recipe.calibration.batch_size))
    timings["sensitivity_s"] = time.perf_counter() - t
    return moments


@dataclass
class GateEvaluations:
    """The gate's measurements: every window's baseline, the search's windows (baseline, ``evaluate``)
    and the held-out confirmation (:class:`~compressor.policy.confirm.Confirmation`; disabled with
    ``policy.confirm_fraction: 0``, when the search's windows are every window)."""

    baseline: DomainEvaluations
    search_baseline: DomainEvaluations
    evaluate: Callable[[str], DomainEvaluations]
    confirmation: Confirmation
    limit: float
    fraction: float = 0.0

    def splits(self, final: DomainEvaluations, accepted: list[int]) -> GateSplits | None:
        """Both window sets' numbers of the model chosen (``final``: its search windows' evaluation)."""
        c = self.confirmation
        if not c.enabled:
            return None
        confirmed = c.final if accepted and c.final is not None else c.baseline
        return GateSplits(self.fraction, self.search_baseline, final, c.baseline, confirmed, c.count, list(c.notes))


def _whole(gate: GateEvaluations, final: DomainEvaluations, accepted: list[int]) -> DomainEvaluations:
    """The chosen model on every window: its search and confirmation windows' evaluations pooled."""
    c = gate.confirmation
    if not c.enabled:
        return final
    if not accepted or c.final is None:  # nothing replaced (or nothing measured): the original model
        return gate.baseline
    return final.pooled(c.final)


def _gate_evaluations(model: nn.Module, recipe: Recipe, eval_tokens, state: RunState,
                      timings: dict[str, float]) -> GateEvaluations:
    """The baseline (one teacher pass over every window), split into the search's windows and the
    held-out confirmation windows (``policy.confirm_fraction``), and their ``evaluate(desc)``."""
    t0, pol = time.perf_counter(), recipe.policy
    # The teacher pass over the evaluation windows (original model: nothing is
    # installed yet) is the baseline; later evaluations compare with it. It covers every window,
    # whatever the split: the split is the gate's, and a change of it keeps the measurements.
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    streams = eval_tokens if isinstance(eval_tokens, dict) else {next(iter(cfgs)): eval_tokens}
    evaluator = Evaluator(state.once("baseline", "baseline evaluation (teacher caches)", lambda: Evaluator.build(
        model, streams, seq_len={n: cfgs[n].seq_len for n in streams}, stride={n: cfgs[n].stride for n in streams},
        batch_size={n: cfgs[n].batch_size for n in streams}, top_k=min(cfgs[n].kl_top_k for n in streams),
    ).teachers))
    search, held = evaluator.split(pol.confirm_fraction)
    baseline = evaluator.baseline
    state.begin_gate()  # what follows depends on the budget too
    limit = gate_ppl_limit(baseline.ppl, pol)
    logger.info("baseline perplexity %.4f over %d tokens; the gate holds the bound ≤ %.4f%s", baseline.ppl,
                baseline.tokens, limit, headroom_note(pol.headroom))
    if held is not None:
        logger.info("gate windows: the search measures %s; %s held out to confirm its choice",
                    ", ".join(f"{len(t.windows)} of {t.name}" for t in search.teachers),
                    ", ".join(str(len(t.windows)) for t in held.teachers))
    timings["baseline_s"] = time.perf_counter() - t0

    def measure(which: Evaluator, desc: str) -> DomainEvaluations:
        t = time.perf_counter()
        try:
            return state.evaluation(desc, lambda: which(model, desc))
        finally:
            timings["gate_evaluations_s"] = timings.get("gate_evaluations_s", 0.0) + time.perf_counter() - t
            timings["gate_evaluations"] = timings.get("gate_evaluations", 0) + 1

    confirmation = Confirmation(held.baseline if held is not None else None,
                                functools.partial(measure, held) if held is not None else None, pol)
    return GateEvaluations(baseline, search.baseline, functools.partial(measure, search), confirmation, limit,
                           pol.confirm_fraction)


def _decisions(plan: Plan, modules: dict[int, str], kind: str) -> list[BlockDecision]:
    return [BlockDecision(index=p.index, module=modules[p.index], r2_lin=p.r2_lin, r2_bulk=p.r2_bulk,
                          outlier_sst_share=p.outlier_sst_share, outlier_dominated=p.outlier_dominated,
                          ffn_params=p.ffn_params, kind=kind)
            for p in plan.profiles]


def _verdict(recipe: Recipe, baseline: DomainEvaluations, final: DomainEvaluations, accepted: list[int],
             attempts: list[dict], check: Callable[[DomainEvaluations], tuple[bool, str]],
             confirmation: Confirmation | None = None) -> tuple[bool, str]:
    """(whether the gate passed, the run's message; exit 3 when it did not). ``baseline`` and
    ``final``: the search windows'; a choice must also have passed ``confirmation``."""
    pol = recipe.policy
    within, why = check(final)
    confirming = confirmation is not None and confirmation.enabled
    if not accepted and confirming and confirmation.failures:
        return False, confirmation.failed_message()
    searched = [a for a in attempts if not a.get("confirmation")]
    left_out = searched[-1].get("left_out", []) if searched else []
    if not accepted and searched:
        return False, no_cut_message(searched, baseline.ppl, pol.ppl_budget, pol.budget_mode, left_out=left_out,
                                     self_written=recipe.calibration.dataset == "self",
                                     kl_budget=pol.kl_budget if pol.metric == "kl" else None, headroom=pol.headroom,
                                     baselines={n: ev.ppl for n, ev in getattr(baseline, "domains", {}).items()})
    if len(accepted) < pol.min_blocks:
        return False, f"only {len(accepted)} block(s) passed the gate; policy.min_blocks={pol.min_blocks}"
    if not within:
        return False, f"final model {why}" + ("" if pol.gate else " (gate off)")
    if confirming and accepted and not confirmation.passed:
        return False, f"final model on the held-out confirmation windows {confirmation.why}" + (
            "" if pol.gate else " (gate off)")
    confirmed = f"; confirmed on the held-out windows: {confirmation.why}" if confirming and accepted else ""
    stepped = f" ({'; '.join(confirmation.notes)})" if confirming and confirmation.notes else ""
    left = (f"; left out because its smallest step alone failed the gate (policy.drop_failing_blocks): "
            f"{blocks_phrase(left_out)}" if left_out else "")
    return True, f"{len(accepted)} block(s) replaced; {why}{confirmed}{stepped}{left}"
