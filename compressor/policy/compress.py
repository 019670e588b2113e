"""The policy engine: one layer-sequential pass → fits → a strategy → the gate.

* pass A (:class:`~compressor.engine.walker.LayerWalker`): per layer, the statistics
  the kind needs, the R²_lin profile, and either the kind's fit at its
  configured level (``greedy``) or its error curve (``allocate``);
* ``greedy`` (:mod:`compressor.policy.greedy`): whole-block swaps tried one at a time;
* ``allocate`` (:mod:`compressor.policy.allocate`): one global FFN-parameter target
  split across blocks, validated, backed off by bisection until the gate holds;
  with ``output.architecture: standard`` the split is one width for every block
  (the base class's ``intermediate_size``), bisected over the widths on the grid.

Widths: the prune/hybrid kinds offer only the FFN widths the outputs can take,
multiples of :func:`compressor.recipe.schema.width_multiple` (see
:mod:`compressor.fitting.kinds.hidden`), so the allocation chooses among them.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from torch import nn

from compressor.core.errors import InputError
from compressor.policy.allocate import BlockCurve, allocate, uniform_widths, widths_params
from compressor.inputs.data import CalibrationSet
from compressor.engine.walker import LayerStats, LayerWalker
from compressor.policy.greedy import greedy_gate
from compressor.fitting.kinds import BlockData, Fitted, Level, get_kind
from compressor.engine.profiling import BlockProfile, block_profile
from compressor.recipe.schema import Recipe, width_multiple as output_width_multiple
from compressor.engine.resume import RunState
from compressor.fitting.replace import count_params, ffn_path
from compressor.core.archs import find_blocks
from compressor.core.onload import is_offloaded
from compressor.engine.sensitivity import output_grad_moments
from compressor.engine.spill import BlockStore
from compressor.evaluation.evaluate import DomainEvaluations, Evaluator, gate_check, ppl_limit
from compressor.engine.resume import register_record

logger = logging.getLogger(__name__)

# Keep every block's statistics in RAM for the allocate strategy (a back-off
# step re-solves instead of re-running calibration) while they take less than
# this share of the available memory; beyond it they are spilled to disk.
KEEP_STATS_MEMORY_SHARE = 0.3
# Calibration windows that feed the loss-gradient statistics (a diagonal
# second moment settles long before the fit statistics do).
FISHER_MAX_WINDOWS = 128
# allocate without policy.ffn_keep: the bisection searches kept fractions above this.
MIN_FFN_KEEP = 0.3
# The hidden-unit kinds re-solve the down projection on the kept units: with fewer fit rows per
# unit than this, its error on unseen text is visibly inflated by overfitting (n / (n − p)).
MIN_ROWS_PER_UNIT = 5


def scarce_rows_message(rows: int, units: int, max_tokens: int, heldout_fraction: float,
                        ridge: float = 0.0) -> str | None:
    """A warning when ``rows`` fit rows are few for an exact re-solve on up to ``units`` hidden units, or None
    (also None with ``replacement.ridge`` > 0, which is what keeps such a re-solve from fitting noise).

    Least squares on ``n`` rows and ``p`` regressors errs on unseen rows at least ``n / (n − p)`` times
    as much as it would with unlimited rows (the classical out-of-sample inflation of OLS); on real
    blocks it is far more (Qwen2.5-Coder-1.5B at 1.6 rows per unit: held-out error 43× the fit rows',
    ``tools/results/resolve_rows_qwen2.5_coder_1.5b.json``)."""
    if ridge > 0 or rows >= MIN_ROWS_PER_UNIT * units:
        return None
    p = max(units - 256, units // 2)  # a small cut: where the allocation starts
    need = math.ceil(MIN_ROWS_PER_UNIT * units / (1 - heldout_fraction) / 1024) * 1024
    effect = (f"at least {rows / (rows - p):.1f}× the error the same units would have with unlimited text (at "
              f"{p:,} units; measured on real blocks: far more)" if rows > p else
              "underdetermined (fewer rows than units)")
    return (f"calibration: {rows:,} fit rows for FFNs of {units:,} hidden units ({rows / units:.1f} per unit) and "
            f"replacement.ridge 0. An exact re-solve of the down projection on the kept units then errs on unseen "
            f"text by {effect}, so even small cuts look costly to the gate. Keep the default replacement.ridge (1), "
            f"or give ≥ {MIN_ROWS_PER_UNIT} rows per unit: calibration.max_tokens ≥ {need:,} (now {max_tokens:,})")


@dataclass
class BlockDecision:
    index: int
    module: str
    r2_lin: float
    r2_bulk: float
    outlier_sst_share: float
    outlier_dominated: bool
    decision: str = "not a candidate"  # kept | rejected | not a candidate | not tried | not replaced
    reason: str = ""
    kind: str | None = None
    size: int | None = None
    """Kept hidden units (prune, hybrid) or rank (low_rank) of the replacement."""
    ffn_params: int = 0
    replacement_params: int = 0
    r2_replacement: float | None = None
    """Held-out R² of the replacement's output."""
    swap_ppl: float | None = None
    """Perplexity with only this block replaced (single-swap sweep)."""
    ppl_when_tried: float | None = None
    delta_ppl: float | None = None
    """Perplexity increase this block caused when it was kept (greedy)."""
    predicted_cost: float | None = None
    """Sensitivity-weighted error the allocation expected (allocate)."""


@dataclass
class CompressionResult:
    model: nn.Module
    profiles: list[BlockProfile]
    decisions: list[BlockDecision]
    baseline: DomainEvaluations
    final: DomainEvaluations
    budget_ppl: float
    params_before: int
    params_after: int
    gate_passed: bool
    gate_message: str
    strategy: str = "greedy"
    timings: dict[str, float] = field(default_factory=dict)
    fitted: dict[int, Fitted] = field(default_factory=dict)
    attempts: list[dict] = field(default_factory=list)
    """allocate: every global target tried, with its perplexity and verdict."""

    @property
    def kept(self) -> list[BlockDecision]:
        return [d for d in self.decisions if d.decision == "kept"]

    def compression_blocks(self) -> list[dict]:
        """Entries for the checkpoint's ``config.compression.blocks``."""
        out = []
        for d in self.kept:
            entry = self.fitted[d.index].entry(d.module)
            entry.update({"r2_lin": self.profiles[d.index].r2_lin, "ffn_params": d.ffn_params,
                          "delta_ppl": d.delta_ppl, "swap_ppl": d.swap_ppl})
            out.append(entry)
        return out

    def decisions_json(self) -> list[dict]:
        return [asdict(d) for d in self.decisions]


@dataclass
class LayerResult:
    """What one layer's step of a walk produced; serialisable (:mod:`compressor.engine.resume`
    checkpoints it, and a resumed run takes it instead of measuring the layer again)."""

    index: int
    profile: BlockProfile | None = None
    fitted: Fitted | None = None
    curve: BlockCurve | None = None
    data: BlockData | None = None
    """allocate: the block's statistics kept for re-solves at other levels (None when memory is short)."""


def checkpointed_walk(walker: LayerWalker, state: RunState, desc: str,
                      step: Callable[[int, LayerStats], LayerResult],
                      apply: Callable[..., nn.Module | None], **kwargs) -> None:
    """One layer walk: ``step`` turns a layer's statistics into a :class:`LayerResult`,
    which is recorded, then ``apply(result, reload)`` takes it in (and may return a replacement to
    install); ``reload()`` reads the record back from disk (None when the run records nothing).
    Layers an interrupted run finished are not measured again: their records are applied."""
    records = state.walk(desc)

    def reloader(i: int) -> Callable[[], LayerResult] | None:
        return (lambda: records.load(i)) if records.on_disk else None

    def on_layer(i: int, st: LayerStats):
        result = step(i, st)
        records.save(i, result)
        return apply(result, reloader(i))

    walker.walk(on_layer, done=records.done, replay=lambda i: apply(records.load(i), reloader(i)), desc=desc,
                **kwargs)


def _activation(model: nn.Module, spec) -> str | None:
    cfg = model.config
    for attr in spec.act_attrs:
        value = getattr(cfg, attr, None)
        if isinstance(value, str):
            return value
    return None


def block_weight(mode: str, st: LayerStats, grad_moment: torch.Tensor | None) -> float:
    """The block's sensitivity: cost per unit of held-out relative output error (see compressor.policy.allocate)."""
    if mode == "fisher":
        if grad_moment is None:
            raise ValueError("fisher allocation needs the loss-gradient statistics")
        return float((grad_moment * st.xy.fit.cyy_diag).sum()) / max(st.xy.fit.n, 1)
    if mode == "residual":
        bulk = st.xy.heldout["bulk"]
        energy = float(bulk.cyy_diag.sum()) / max(bulk.n, 1)
        return energy / st.resid_energy if st.resid_energy > 0 else 1.0
    return 1.0


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
    *, state: RunState | None = None, width_multiple: int | None = None,
) -> CompressionResult:
    """Run measure → fit → select → replace → validate on ``model`` in place.

    ``eval_tokens``: one id stream, or ``{domain name: ids}`` for the
    recipe's evaluation domains (the gate must hold on each). ``state``
    checkpoints every finished layer and evaluation, and skips those an
    interrupted run recorded (:mod:`compressor.engine.resume`).
    ``width_multiple``: the multiple the kept FFN widths of the prune/hybrid kinds come in
    (default: :func:`compressor.recipe.schema.width_multiple` of the recipe's output, which needs
    the caller's help only for a GGUF source written at its own quantization)."""
    state = state or RunState()
    rc, m, pol = recipe.replacement, recipe.measure, recipe.policy
    kind = get_kind(rc.kind)
    strategy = recipe.strategy()
    timings: dict[str, float] = {}
    standard = recipe.output.architecture == "standard"
    multiple = 1
    if kind.needs_hidden:
        multiple = width_multiple if width_multiple is not None else output_width_multiple(recipe.output)
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[m.precision]

    t0 = time.perf_counter()
    walker = LayerWalker(model, {"fit": calibration.fit, "heldout": calibration.heldout},
                         batch_size=recipe.calibration.batch_size)
    spec, n_blocks = walker.spec, len(walker.layers)
    if kind.needs_hidden and not (spec.ffn_up and spec.ffn_down):
        raise ValueError(f"replacement kind {rc.kind} needs the FFN's hidden units, which "
                         f"compressor/archs.py does not locate for {walker.model_type}")
    act = _activation(model, spec)
    # The width rule, passed to the hidden-unit kinds only when it restricts something (the
    # default calls stay exactly what they were).
    widths = {"multiple": multiple} if multiple > 1 else {}
    intercept = not standard or keeps_intercept(model, spec)
    if standard:
        logger.info("output.architecture: standard: one FFN width for every block, in multiples of %d; the down "
                    "projection is re-solved %s", multiple, "with its intercept" if intercept else
                    f"without an intercept ({walker.model_type}'s MLP has no bias)")

    def fit_at(data: BlockData, size: int) -> Fitted:
        return kind.fit(data, rc, size, **widths, **({} if intercept else {"intercept": False}))

    modules = {i: ffn_path(model, i) for i in range(n_blocks)}
    ffn_params = {i: count_params(model.get_submodule(modules[i])) for i in range(n_blocks)}
    profiles: list[BlockProfile | None] = [None] * n_blocks
    fitted: dict[int, Fitted] = {}
    curves: list[BlockCurve] = []
    # allocate re-solves blocks from their statistics: in RAM while they fit, else spilled to
    # disk (always when the model is onloaded: memory then stays flat in depth).
    kept_data = BlockStore(n_blocks, spill=True if is_offloaded(model) else None,
                           memory_share=KEEP_STATS_MEMORY_SHARE, folder=state.scratch_folder())

    grad_moments: dict[int, torch.Tensor] = {}
    needs_grad = strategy == "allocate" and pol.allocation == "fisher" or getattr(rc, "selection", "obs") == "loss"
    if needs_grad and is_offloaded(model):
        logger.warning("the loss-gradient pass (allocation: fisher / selection: loss) holds every layer's weights "
                       "for its backward, so an onloaded model is materialised whole for it; for models larger "
                       "than memory use policy.allocation: residual")
    if needs_grad:
        t1 = time.perf_counter()
        grad_moments = state.once("sensitivity", "loss-gradient statistics", lambda: output_grad_moments(
            model, calibration.fit[:FISHER_MAX_WINDOWS], modules, batch_size=recipe.calibration.batch_size))
        timings["sensitivity_s"] = time.perf_counter() - t1

    def block_data(i: int, st: LayerStats) -> BlockData:
        return BlockData(i, model.get_submodule(modules[i]), spec, act, st.xy.fit, st.xy.heldout_total(),
                         st.zfit, st.zheld, output_weight=grad_moments.get(i))

    warned: list[bool] = []

    def step(i: int, st: LayerStats) -> LayerResult:
        """Pass A on one layer: its profile, and its fit (greedy) or error curve (allocate)."""
        prof, _ = block_profile(st.xy, outlier_share_flag=m.outlier_share_flag)
        prof.ffn_params, prof.affine_params = ffn_params[i], prof.d_in * prof.d_out + prof.d_out
        data = block_data(i, st)
        if kind.needs_hidden and not warned and data.zfit is not None:
            warned.append(True)
            msg = scarce_rows_message(int(data.zfit.n), data.d_ff, recipe.calibration.max_tokens,
                                      recipe.calibration.heldout_fraction, getattr(rc, "ridge", 0.0))
            if msg:
                logger.warning("%s", msg)
        if strategy == "greedy":
            return LayerResult(i, prof, fitted=fit_at(data, kind.default_level(data, rc, **widths)))
        levels = kind.levels(data, rc, **widths)
        weight = block_weight(pol.allocation, st, grad_moments.get(i))
        data.zheld = None  # the curve holds what the held-out rows had to say
        return LayerResult(i, prof, curve=BlockCurve(i, ffn_params[i], levels, weight), data=data)

    def take(r: LayerResult, reload: Callable[[], LayerResult] | None = None) -> None:
        profiles[r.index] = r.profile
        if r.fitted is not None:
            fitted[r.index] = kept_data.keep_fit(r.fitted)
        if r.curve is not None:
            curves.append(r.curve)
        if r.data is not None:
            r.data.ffn, r.data.spec = model.get_submodule(modules[r.index]), spec  # not recorded: live objects
            if reload is None:
                kept_data[r.index] = r.data
            else:  # the record holds the statistics already: a spilling store reads them from there
                kept_data.keep_recorded(r.index, r.data, lambda: reload().data)
        return None

    # A width rule changes the recorded curves: its own description keeps a resume from mixing them.
    walk_desc = "calibrate" + (f" (FFN widths in multiples of {multiple})" if multiple > 1 else "")
    checkpointed_walk(walker, state, walk_desc, step, take, hidden=kind.needs_hidden, spike_factor=m.spike_factor,
                      compute_dtype=compute_dtype)
    timings["measure_s"] = time.perf_counter() - t0 - timings.get("sensitivity_s", 0.0)  # pass A alone

    t0 = time.perf_counter()
    # The teacher pass over the evaluation windows (original model: nothing is
    # installed yet) is the baseline; later evaluations compare with it.
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    streams = eval_tokens if isinstance(eval_tokens, dict) else {next(iter(cfgs)): eval_tokens}
    evaluator = Evaluator(state.once("baseline", "baseline evaluation (teacher caches)", lambda: Evaluator.build(
        model, streams, seq_len={n: cfgs[n].seq_len for n in streams}, stride={n: cfgs[n].stride for n in streams},
        batch_size={n: cfgs[n].batch_size for n in streams}, top_k=min(cfgs[n].kl_top_k for n in streams),
    ).teachers))
    baseline = evaluator.baseline
    state.begin_gate()  # what follows depends on the budget too
    limit = ppl_limit(baseline.ppl, pol.ppl_budget, pol.budget_mode)
    logger.info("baseline perplexity %.4f over %d tokens; budget ≤ %.4f", baseline.ppl, baseline.tokens, limit)
    timings["baseline_s"] = time.perf_counter() - t0

    def evaluate(desc: str) -> DomainEvaluations:
        t = time.perf_counter()
        try:
            return state.evaluation(desc, lambda: evaluator(model, desc))
        finally:
            timings["gate_evaluations_s"] = timings.get("gate_evaluations_s", 0.0) + time.perf_counter() - t
            timings["gate_evaluations"] = timings.get("gate_evaluations", 0) + 1

    def check(candidate: DomainEvaluations) -> tuple[bool, str]:
        ok, why, _ = gate_check(baseline, candidate, pol)
        return ok, why

    decisions = [
        BlockDecision(index=p.index, module=modules[p.index], r2_lin=p.r2_lin, r2_bulk=p.r2_bulk,
                      outlier_sst_share=p.outlier_sst_share, outlier_dominated=p.outlier_dominated,
                      ffn_params=p.ffn_params, kind=rc.kind)
        for p in profiles
    ]
    params_before = count_params(model)
    t0 = time.perf_counter()
    attempts: list[dict] = []
    if strategy == "greedy":
        for d in decisions:
            f = fitted[d.index]
            d.size, d.replacement_params, d.r2_replacement = f.config.get("units", f.config.get("rank")), f.params, f.heldout_r2
        final, accepted = greedy_gate(model, fitted, profiles, decisions, pol, baseline, evaluate, check,
                                      sweep_all=m.swap_sweep)
    else:
        final, accepted, attempts = _allocate_and_gate(
            model, walker, kind, rc, pol, curves, kept_data, block_data, modules, decisions, fitted,
            baseline, evaluate, check, compute_dtype, m.spike_factor, state, fit_at=fit_at, multiple=multiple,
            standard=standard, timings=timings)
    timings["gate_s"] = time.perf_counter() - t0
    kept_data.close()

    within, why = check(final)
    if not accepted and attempts:
        passed, msg = False, no_cut_message(attempts, baseline.ppl, pol.ppl_budget, pol.budget_mode,
                                            self_written=recipe.calibration.dataset == "self",
                                            kl_budget=pol.kl_budget if pol.metric == "kl" else None,
                                            baselines={n: ev.ppl for n, ev in getattr(baseline, "domains", {}).items()})
    elif len(accepted) < pol.min_blocks:
        passed, msg = False, f"only {len(accepted)} block(s) passed the gate; policy.min_blocks={pol.min_blocks}"
    elif not within:
        passed, msg = False, f"final model {why}" + ("" if pol.gate else " (gate off)")
    else:
        passed, msg = True, f"{len(accepted)} block(s) replaced; {why}"
    return CompressionResult(
        model=model, profiles=profiles, decisions=decisions, baseline=baseline, final=final, budget_ppl=limit,
        params_before=params_before, params_after=count_params(model), gate_passed=passed, gate_message=msg,
        strategy=strategy, timings=timings, fitted={i: fitted[i] for i in accepted}, attempts=attempts,
    )


def smallest_cut(failed: float, steps: int, next_keep: Callable[[float], float | None]) -> float | None:
    """The kept fraction a bisection of ``steps`` steps reaches when every step fails, starting from the
    failing ``failed`` (the floor) with the original model passing; None when it takes no step."""
    last = None
    for _ in range(steps):
        mid = next_keep(failed)
        if mid is None:
            break
        failed = last = mid
    return last


def no_cut_message(attempts: list[dict], baseline_ppl: float, budget: float, mode: str, *,
                   self_written: bool = False, kl_budget: float | None = None,
                   baselines: dict[str, float] | None = None) -> str:
    """Why nothing was written when every allocated cut failed: the smallest cut tried and what it
    cost, every attempt, and what would let a cut through. ``self_written``: the calibration is the
    model's own writing, which need not be the domain the gate measures (on Qwen2.5-Coder-1.5B it was
    mathematics, and the cost of a cut on the gate's Python text was up to 153x its cost on that text:
    docs/checkpoints.md). ``baselines``: each evaluation domain's baseline perplexity; with more than
    one, an attempt's cost is that of the domain it did worst on, named (``baseline_ppl`` is the first
    domain's). When one block narrowed alone failed, the message names it and how to leave it out."""
    several = baselines is not None and len(baselines) > 1

    def worst(a: dict) -> tuple[str, float]:
        if not several:
            return "", a["ppl"] / baseline_ppl - 1
        changes = {n: d["ppl"] / baselines[n] - 1 for n, d in a["domains"].items()}
        name = max(changes, key=changes.get)
        return f" on {name}", changes[name]

    def cost(a: dict) -> str:
        kept = f"keep {100 * a['ffn_params_kept'] / a['ffn_params_total']:.1f} % → "
        if kl_budget is not None:  # policy.metric kl: the gate's own words (the KL of the worst domain)
            return kept + a.get("gate", "over the KL budget")
        where, change = worst(a)
        return kept + f"{100 * change:+.1f} %{where}"

    smallest = max(attempts, key=lambda a: a["ffn_params_kept"])
    allowed = (f"KL {kl_budget:g} nats/token" if kl_budget is not None else
               f"+{100 * budget:.1f} %" if mode == "relative" else f"+{budget:g} perplexity")
    tried = (f"; tried: {'; '.join(cost(a) for a in attempts)}" if len(attempts) > 1 else
             " (the only cut the search tried)")
    on = "" if kl_budget is not None or several else " perplexity on the gate's text"
    field = "kl_budget" if kl_budget is not None else "ppl_budget"
    if self_written:
        first = ("The calibration is the model's own writing (calibration.dataset: self), which may not be the "
                 "domain the gate measures: calibrate on text of the domain you use the model for (a file or dataset)")
    else:
        first = "This model gives up little of its FFN at this budget: calibrate on more text of the gate's domain"
    return (f"no cut passed the gate: even the smallest tried ({cost(smallest)}{on}) is over "
            f"the budget of {allowed} at the gate's confidence (the upper bound of the change decides, "
            f"policy.confidence){tried}.{_one_block_fails(attempts, cost)} {first}, or raise policy.{field} above "
            "a cost listed above by its margin (report.json: evaluation) (a run with --keep-state lets later runs "
            "at other budgets take its measurements: --measurements-from)")


def _one_block_fails(attempts: list[dict], cost) -> str:
    """A sentence naming the block when an attempt that narrowed one block alone failed (every
    smaller cut the search could try narrows it too: it is the allocation's first step), else ''."""
    alone = [a for a in attempts if len(a.get("blocks") or {}) == 1 and not a.get("passed")]
    if not alone:
        return ""
    a = alone[-1]
    (index, width), = a["blocks"].items()
    in_all = all(index in (b.get("blocks") or {}) for b in attempts)
    return (f" Block {index} narrowed alone (to {width:,} units) fails: {cost(a)}"
            f"{'; every cut tried narrowed it' if in_all else ''}. Leave it out (policy.exclude: [{index}]) and "
            "run again — with this run's --keep-state, --measurements-from reuses its measurements.")


def _allocate_and_gate(model, walker, kind, rc, pol, curves, kept_data, block_data, modules, decisions, fitted,
                       baseline, evaluate, check, compute_dtype, spike_factor, state, *, fit_at, multiple=1,
                       standard=False, timings=None):
    """Allocate a global FFN target, validate, bisect the target until the gate holds.

    ``standard``: the target is met by one width for every block (no block is left out: the base
    class has one ``intermediate_size``), and the bisection runs over the widths on the grid."""
    excluded = set(pol.exclude)
    flagged = [d.index for d in decisions if d.outlier_dominated]
    if pol.skip_outlier_dominated and not standard:
        excluded |= set(flagged)
    elif pol.skip_outlier_dominated and flagged:
        logger.info("blocks %s are outlier-dominated; output.architecture: standard prunes them to the one width "
                    "too (policy.skip_outlier_dominated does not apply)", flagged)
    for d in decisions:
        if d.index in excluded:
            d.decision = "not a candidate"
            d.reason = "excluded by policy.exclude" if d.index in pol.exclude else (
                "outlier-dominated; set policy.skip_outlier_dominated: false to allow it")
    active = [c for c in curves if c.index not in excluded]
    ffn_total = sum(c.ffn_params for c in active)
    originals = {i: model.get_submodule(modules[i]) for i in range(len(decisions))}

    def restore() -> None:
        for i, mod in originals.items():
            model.set_submodule(modules[i], mod)

    grid_widths = uniform_widths(active) if standard else []
    if standard and not grid_widths:
        raise InputError(f"output.architecture: standard: no FFN width in multiples of {multiple} is both offered by "
                         "every block and smaller than the original FFN; this model's FFN is too narrow for that grid "
                         "(set output.width_multiple, or use output.architecture: custom)")

    def choose(keep: float) -> dict[int, Level | None]:
        if not standard:
            return allocate(active, int(keep * ffn_total), pol.allocation)
        fitting = [w for w in grid_widths if widths_params(active, w) <= keep * ffn_total] or grid_widths[:1]
        return {c.index: next(lv for lv in c.levels if lv.size == fitting[-1]) for c in active}

    def describe(keep: float) -> str:
        if standard:
            return f"FFN width {next(iter(choose(keep).values())).size} in every block"
        return f"keep {keep:.1%} of FFN parameters" + (f" (widths in multiples of {multiple})" if multiple > 1 else "")

    def next_keep(failed: float, passed: float) -> float | None:
        """The next target of the bisection: halfway, or for one width, the middle grid width between."""
        if not standard:
            return (failed + passed) / 2
        inside = [k for k in (widths_params(active, w) / ffn_total for w in grid_widths) if failed < k < passed]
        return inside[len(inside) // 2] if inside else None

    # (block, units) → its independent fit, solved once: a block keeps its width across bisection steps,
    # and the chosen target is installed again at the end (large models only, whose fits are on disk).
    solved: dict[tuple[int, int], Fitted] = {}

    def install(keep: float, target: str) -> tuple[dict[int, Level | None], dict[int, Fitted]]:
        restore()
        choice = choose(keep)
        fits: dict[int, Fitted] = {}
        if target == "none" and all(i in kept_data for i, lv in choice.items() if lv is not None):
            for i, lv in choice.items():
                if lv is not None:
                    f = solved.get((i, lv.size))
                    if f is None:
                        f = kept_data.keep_fit(fit_at(kept_data[i], lv.size))
                    if kept_data.spill:  # fits on disk: kept for the next attempt that wants this width
                        solved[i, lv.size] = f
                    model.set_submodule(modules[i], f.build(originals[i]))
                    fits[i] = f
        else:
            def step(i: int, st: LayerStats) -> LayerResult:
                return LayerResult(i, fitted=fit_at(block_data(i, st), choice[i].size))

            def take(r: LayerResult, reload=None) -> nn.Module:
                mod = r.fitted.build(originals[r.index])
                fits[r.index] = kept_data.keep_fit(r.fitted)
                return mod

            checkpointed_walk(walker, state, f"fit ({target}) at ffn_keep {keep!r}" + (
                                  f", {describe(keep)}" if standard or multiple > 1 else ""), step, take,
                              hidden=kind.needs_hidden, target=target, spike_factor=spike_factor,
                              compute_dtype=compute_dtype, layers=[i for i, lv in choice.items() if lv is not None])
        return choice, fits

    attempts: list[dict] = []

    def attempt(keep: float, target: str = "none"):
        t = time.perf_counter()
        choice, fits = install(keep, target)
        if timings is not None:  # re-solves from statistics, or (a teacher target) one more calibration pass
            key = "refit_s" if target == "none" else "teacher_pass_s"
            timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
        r = evaluate(f"gate: {describe(keep)}")
        kept_params = sum(c.ffn_params if choice[c.index] is None else choice[c.index].params for c in active)
        ok, why = check(r)
        row = {"width": next(iter(choice.values())).size} if standard else {}
        attempts.append({**row, "ffn_keep_target": keep, "target": target, "ffn_params_kept": kept_params,
                         "ffn_params_total": ffn_total, "blocks_replaced": sum(lv is not None for lv in choice.values()),
                         "blocks": {str(i): lv.size for i, lv in sorted(choice.items()) if lv is not None},
                         "ppl": r.ppl, "passed": ok, "gate": why,
                         "domains": {n: {"ppl": ev.ppl, "kl": ev.kl} for n, ev in r.domains.items()}})
        logger.info("keep %.1f%% of FFN parameters (%d blocks replaced%s): %s", 100 * kept_params / ffn_total,
                    attempts[-1]["blocks_replaced"], f", width {row['width']}" if standard else "", why)
        return r, ok, choice, fits

    # One gate attempt per allocation: targets a width step apart can allocate the same widths, and
    # such a target takes the measured attempt (with the target it was measured at) instead of another.
    tried: dict[tuple, tuple] = {}

    def allocation(keep: float) -> tuple:
        return tuple(sorted((i, lv.size) for i, lv in choose(keep).items() if lv is not None))

    def measured(keep: float):
        sig = allocation(keep)
        if sig not in tried:
            tried[sig] = (keep, *attempt(keep))
        return tried[sig]

    # Bisection on the kept fraction: `failed` is the largest known failing
    # target (or the floor), `passed` the smallest known passing one (1.0:
    # the original model passes trivially).
    best = None
    failed, passed = MIN_FFN_KEEP, 1.0
    if pol.ffn_keep is not None:
        at, r, ok, choice, fits = measured(pol.ffn_keep)
        if ok or not pol.gate:
            best = (at, r, choice, fits)
        else:
            failed = pol.ffn_keep
    if pol.gate and best is None:
        # The smallest cut the bisection can reach is tried first. When it passes, the bisection runs
        # as it would have and reuses that attempt, so it ends on the same cut. When it fails, no
        # larger cut can pass: the bisection runs below it instead (between it and the original model),
        # down to one width step of one block at most.
        floor = smallest_cut(failed, pol.max_backoff, lambda f: next_keep(f, 1.0))
        floor_passed = measured(floor)[2] if floor is not None and pol.max_backoff > 1 else None
        if floor_passed is False:
            logger.warning("the smallest cut of the bisection (%s) is over the gate's budget (%s); searching "
                           "smaller cuts (at most %d attempts)", describe(floor), attempts[-1]["gate"],
                           pol.max_backoff)
            failed = floor
        for _ in range(pol.max_backoff):
            mid = next_keep(failed, passed)
            if mid is None or not allocation(mid):  # no grid width left between, or a cut below one width step
                break
            at, r, ok, choice, fits = measured(mid)
            if ok:
                best, passed = (at, r, choice, fits), mid
            else:
                failed = mid
    if best is None:
        restore()
        for d in decisions:
            if d.index not in excluded:
                d.decision, d.reason = "rejected", "no allocated target tried passed the gate"
        return baseline, [], attempts
    keep, r, choice, fits = best
    target = "none"
    if getattr(rc, "target", "none") != "none":  # whole-block kinds (affine) have no teacher target
        # The search ran on independent fits (each step a re-solve, no
        # calibration pass); the teacher-target fit, one more pass over the
        # calibration data, is tried at the level found and kept if it passes.
        r_t, ok, choice_t, fits_t = attempt(keep, rc.target)
        if ok or not pol.gate:
            r, choice, fits, target = r_t, choice_t, fits_t, rc.target
        else:
            logger.warning("target %s at ffn_keep %.3f failed the gate (%s); keeping the independent fits",
                           rc.target, keep, attempts[-1]["gate"])
    last = attempts[-1]
    if (last["ffn_keep_target"], last["target"]) != (keep, target):
        choice, fits = install(keep, target)  # deterministic: the same fits as when it was measured
    gate_said = next(a["gate"] for a in reversed(attempts) if (a["ffn_keep_target"], a["target"]) == (keep, target))
    fitted.clear()
    fitted.update(fits)
    curve_of = {c.index: c for c in active}
    for d in decisions:
        if d.index in excluded:
            continue
        lv = choice.get(d.index)
        if lv is None:
            d.decision, d.reason = "not replaced", f"allocation kept the original at ffn_keep {keep:.3f}"
            continue
        f = fits[d.index]
        d.decision = "kept"
        d.reason = (f"every block at width {lv.size} (output.architecture: standard)" if standard else
                    f"allocated {lv.size} units at ffn_keep {keep:.3f}") + f" (target {target}); {gate_said}"
        d.size, d.replacement_params = lv.size, f.params
        d.r2_replacement = f.heldout_r2 if f.heldout_r2 == f.heldout_r2 else 1.0 - lv.heldout_rel_error
        d.predicted_cost = curve_of[d.index].weight * lv.heldout_rel_error
    return r, sorted(fits), attempts


register_record(LayerResult)
