"""The policy engine: profile → candidates → perplexity-gated replacement.

High R²_lin alone is not trusted. Candidates are swapped in one at a time, in
the policy's order, and each is kept only if the whole model's perplexity on
the evaluation windows stays within budget; otherwise it is rolled back. Every
block's decision and its reason end up in the report.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .archs import arch_for, find_blocks
from .data import CalibrationSet
from .fit import AffineFit, LowRankFit, score, solve_affine
from .measure import BlockStats, collect
from .profiling import BlockProfile, block_profile
from .recipe import Recipe
from .replace import build_module, count_params, ffn_path, swap
from .select import candidates, make_fit, replacement_params
from .evaluate import DomainEvaluations, Evaluator, Perplexity, gate_check

logger = logging.getLogger(__name__)


@dataclass
class BlockDecision:
    index: int
    r2_lin: float
    r2_bulk: float
    outlier_sst_share: float
    outlier_dominated: bool
    decision: str = "not a candidate"  # kept | rejected | not a candidate | not tried
    reason: str = ""
    replacement: str | None = None
    rank: int | None = None
    ffn_params: int = 0
    replacement_params: int = 0
    r2_replacement: float | None = None
    """Held-out R² of the map actually tried (low-rank and/or refitted)."""
    refit: bool = False
    swap_ppl: float | None = None
    """Perplexity with only this block replaced (single-swap sweep)."""
    ppl_when_tried: float | None = None
    delta_ppl: float | None = None
    """Perplexity increase this block caused when it was kept."""


@dataclass
class CompressionResult:
    model: nn.Module
    profiles: list[BlockProfile]
    decisions: list[BlockDecision]
    baseline: Perplexity
    final: Perplexity
    budget_ppl: float
    params_before: int
    params_after: int
    gate_passed: bool
    gate_message: str
    timings: dict[str, float] = field(default_factory=dict)
    modules: dict[int, str] = field(default_factory=dict)

    @property
    def kept(self) -> list[BlockDecision]:
        return [d for d in self.decisions if d.decision == "kept"]

    def compression_blocks(self) -> list[dict]:
        """Entries for the checkpoint's ``config.compression.blocks``."""
        out = []
        for d in self.kept:
            prof = self.profiles[d.index]
            out.append({
                "index": d.index, "module": self.modules[d.index], "replacement": d.replacement,
                "in_features": prof.d_in, "out_features": prof.d_out, "rank": d.rank,
                "r2_lin": prof.r2_lin, "r2_replacement": d.r2_replacement, "refit": d.refit,
                "delta_ppl": d.delta_ppl, "swap_ppl": d.swap_ppl,
                "ffn_params": d.ffn_params, "replacement_params": d.replacement_params,
            })
        return out

    def decisions_json(self) -> list[dict]:
        return [asdict(d) for d in self.decisions]


def budget_limit(base: float, budget: float, mode: str) -> float:
    return base * (1.0 + budget) if mode == "relative" else base + budget


def compress_model(
    model: nn.Module,
    recipe: Recipe,
    calibration: CalibrationSet,
    eval_tokens: torch.Tensor | dict[str, torch.Tensor],
    *,
    stats: dict[int, BlockStats] | None = None,
) -> CompressionResult:
    """Run measure → fit → select → replace → validate on ``model`` in place.

    ``stats`` (e.g. from the cache) skips the calibration pass. ``eval_tokens``:
    one id stream, or ``{domain name: ids}`` for the sections of
    ``recipe.evaluation_domains()`` (the gate must hold on each).
    """
    model_type, spec = arch_for(model)
    if not spec.compressible:
        raise ValueError(
            f"{model_type} models are profile-only ({spec.note}); `compress` refuses them. Use `compressor profile`."
        )
    _, block_list = find_blocks(model, spec)
    n_blocks = len(block_list)
    m, pol = recipe.measure, recipe.policy
    timings: dict[str, float] = {}

    if stats is None:
        t0 = time.perf_counter()
        stats = collect(
            model, calibration.fit, calibration.heldout, batch_size=recipe.calibration.batch_size,
            spike_factor=m.spike_factor, precision=m.precision, output_rank=m.output_rank,
        )
        timings["measure_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    profiles, fits = [], {}
    modules = {i: ffn_path(model, i) for i in range(n_blocks)}
    for i in range(n_blocks):
        prof, fit = block_profile(stats[i], outlier_share_flag=m.outlier_share_flag)
        prof.ffn_params = count_params(model.get_submodule(modules[i]))
        fits[i] = fit
        profiles.append(prof)
    replacements = {i: make_fit(fits[i], stats[i].fit, recipe.replacement, profiles[i].ffn_params) for i in range(n_blocks)}
    for i, p in enumerate(profiles):
        p.affine_params = replacement_params(replacements[i])
    timings["fit_s"] = time.perf_counter() - t0

    def ppl(desc: str) -> DomainEvaluations:
        return evaluator(model, desc)

    t0 = time.perf_counter()
    # The teacher pass (original model, before any swap) is the baseline evaluation.
    cfgs = {c.domain_name(): c for c in recipe.evaluation_domains()}
    streams = eval_tokens if isinstance(eval_tokens, dict) else {next(iter(cfgs)): eval_tokens}
    evaluator = Evaluator.build(
        model, streams, seq_len={n: cfgs[n].seq_len for n in streams}, stride={n: cfgs[n].stride for n in streams},
        batch_size={n: cfgs[n].batch_size for n in streams}, top_k=min(cfgs[n].kl_top_k for n in streams),
    )
    baseline = evaluator.baseline
    limit = budget_limit(baseline.ppl, pol.ppl_budget, pol.budget_mode)
    logger.info("baseline perplexity %.4f over %d tokens; budget ≤ %.4f", baseline.ppl, baseline.tokens, limit)
    timings["baseline_s"] = time.perf_counter() - t0

    decisions = [
        BlockDecision(
            index=p.index, r2_lin=p.r2_lin, r2_bulk=p.r2_bulk, outlier_sst_share=p.outlier_sst_share,
            outlier_dominated=p.outlier_dominated, ffn_params=p.ffn_params,
            replacement=recipe.replacement.kind, replacement_params=p.affine_params,
            rank=replacements[p.index].rank if isinstance(replacements[p.index], LowRankFit) else None,
        )
        for p in profiles
    ]

    def held_r2(f: AffineFit | LowRankFit, st: BlockStats) -> float:
        return score(st.heldout_total(), f.W, f.b).r2

    for d in decisions:
        d.r2_replacement = held_r2(replacements[d.index], stats[d.index])

    # Optional single-swap sweep: every block alone (the paper's Figure 2).
    swap_delta: dict[int, float] | None = None
    swap_evals: dict[int, DomainEvaluations] = {}
    t0 = time.perf_counter()
    if m.swap_sweep or pol.order == "swap_ppl":
        swap_delta = {}
        sweep = range(n_blocks) if m.swap_sweep else candidates(profiles, pol.model_copy(update={"order": "index"}))[0]
        for k, i in enumerate(sweep):
            s = swap(model, i, build_module(replacements[i], model.get_submodule(modules[i])))
            try:
                r = ppl(f"single-swap sweep ({k + 1}/{len(sweep)})")
            finally:
                s.undo()
            decisions[i].swap_ppl = r.ppl
            swap_evals[i] = r
            swap_delta[i] = r.ppl - baseline.ppl
            logger.info("block %d alone: perplexity %.4f (Δ %+.4f)", i, r.ppl, swap_delta[i])
    timings["sweep_s"] = time.perf_counter() - t0

    order, reasons = candidates(profiles, pol, swap_delta)
    for i, why in reasons.items():
        decisions[i].reason = why
    for i in order:
        decisions[i].decision = "not tried"
    logger.info("%d candidate block(s) in order %s", len(order), order)

    params_before = count_params(model)
    params_now = params_before
    current = baseline
    accepted: list[int] = []
    # Smallest block index kept since the last refit: only blocks after it see
    # different inputs, so only those are refitted.
    stale_from: int | None = None
    stats = dict(stats)  # refit replaces entries; never mutate the caller's dict
    t0 = time.perf_counter()

    rejected_in_a_row = 0

    def stop_reason() -> str | None:
        if pol.max_blocks is not None and len(accepted) >= pol.max_blocks:
            return f"policy.max_blocks={pol.max_blocks} reached"
        if pol.target_ratio is not None and params_now <= pol.target_ratio * params_before:
            return f"policy.target_ratio={pol.target_ratio} reached"
        if pol.patience is not None and rejected_in_a_row >= pol.patience:
            return f"policy.patience={pol.patience}: stopped after {rejected_in_a_row} rejections in a row"
        return None

    if pol.gate:
        for k, i in enumerate(order):
            d = decisions[i]
            why = stop_reason()
            if why:
                d.reason = why
                continue
            alone_ok, alone_why, _ = gate_check(baseline, swap_evals[i], pol) if i in swap_evals else (True, "", {})
            if not alone_ok:
                # Alone it already breaks the budget; on top of kept blocks it
                # would too, so the evaluation is skipped.
                d.decision = "rejected"
                d.reason = f"single swap alone exceeds the budget ({alone_why})"
                rejected_in_a_row += 1
                continue
            fit_i = replacements[i]
            if pol.refit and stale_from is not None:
                remaining = [j for j in order[k:] if decisions[j].decision == "not tried" and j > stale_from]
                if remaining:
                    logger.info("refitting blocks %s on the compressed model's activations", sorted(remaining))
                    fresh = collect(
                        model, calibration.fit, calibration.heldout, blocks=remaining,
                        batch_size=recipe.calibration.batch_size, spike_factor=m.spike_factor,
                        precision=m.precision, output_rank=m.output_rank,
                    )
                    for j in remaining:
                        stats[j] = fresh[j]
                        replacements[j] = make_fit(
                            solve_affine(fresh[j].fit), fresh[j].fit, recipe.replacement, profiles[j].ffn_params
                        )
                        decisions[j].refit = True
                        decisions[j].r2_replacement = held_r2(replacements[j], fresh[j])
                stale_from = None
                fit_i = replacements[i]
            s = swap(model, i, build_module(fit_i, model.get_submodule(modules[i])))
            r = ppl(f"gate: block {i} ({k + 1}/{len(order)})")
            d.ppl_when_tried = r.ppl
            ok, why, _ = gate_check(baseline, r, pol)
            if ok:
                d.decision, d.delta_ppl = "kept", r.ppl - current.ppl
                d.reason = why
                params_now = count_params(model)
                current = r
                accepted.append(i)
                stale_from = i if stale_from is None else min(stale_from, i)
                rejected_in_a_row = 0
                logger.info("block %d kept: perplexity %.4f (budget %.4f)", i, r.ppl, limit)
            else:
                s.undo()
                d.decision = "rejected"
                d.reason = f"{why}: rolled back"
                rejected_in_a_row += 1
                logger.info("block %d rejected: perplexity %.4f > %.4f", i, r.ppl, limit)
        final = current
    else:
        for i in order:
            why = stop_reason()
            if why:
                decisions[i].reason = why
                continue
            swap(model, i, build_module(replacements[i], model.get_submodule(modules[i])))
            params_now = count_params(model)
            accepted.append(i)
            decisions[i].decision = "kept"
            decisions[i].reason = "R²_lin threshold rule (no per-block gate)"
        final = ppl("final perplexity") if accepted else baseline
    timings["gate_s"] = time.perf_counter() - t0

    within, why, _ = gate_check(baseline, final, pol)
    if len(accepted) < pol.min_blocks:
        passed, msg = False, f"only {len(accepted)} block(s) passed the gate; policy.min_blocks={pol.min_blocks}"
    elif not within:
        passed, msg = False, f"final model {why}"
    else:
        passed, msg = True, f"{len(accepted)} block(s) replaced; {why}"
    return CompressionResult(
        model=model, profiles=profiles, decisions=decisions, baseline=baseline, final=final, budget_ppl=limit,
        params_before=params_before, params_after=count_params(model), gate_passed=passed, gate_message=msg,
        timings=timings, modules=modules,
    )
