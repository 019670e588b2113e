"""What the policy decided: per block (:class:`BlockDecision`), for the run (:class:`CompressionResult`),
and, when no cut passed, why (:func:`no_cut_message`, the exit-3 message)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from torch import nn

from compressor.engine.profiling import BlockProfile
from compressor.evaluation.gate import DomainEvaluations
from compressor.fitting.kinds import Fitted


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
class GateSplits:
    """The gate's two window sets (``policy.confirm_fraction``): the search's, and the held-out
    confirmation windows its final choice was measured on once."""

    fraction: float
    search_baseline: DomainEvaluations
    search_final: DomainEvaluations
    baseline: DomainEvaluations
    """The original model on the confirmation windows."""
    final: DomainEvaluations
    """The chosen model on the confirmation windows."""
    confirmations: int = 0
    """Confirmation evaluations made (one more for each step back)."""
    notes: list[str] = field(default_factory=list)
    """Each step back the confirmation caused, in words."""


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
    """allocate: every global target tried, with its perplexity and verdict (confirmations marked)."""
    teachers: dict = field(default_factory=dict, repr=False)
    """Per domain, the original's :class:`~compressor.evaluation.teacher.TeacherCache` on the evaluation
    windows (its NLL per window, its top-k distributions): what a comparison made outside the policy (the size
    planner's file in llama.cpp) pairs with, window by window, for the change and for the KL."""
    splits: GateSplits | None = None
    """The search and confirmation windows' numbers (None: ``policy.confirm_fraction: 0``); ``baseline``
    and ``final`` are then of every window, both sets together."""

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


def no_cut_message(attempts: list[dict], baseline_ppl: float, budget: float, mode: str, *,
                   self_written: bool = False, kl_budget: float | None = None,
                   baselines: dict[str, float] | None = None, left_out: list[int] | None = None,
                   headroom: float = 0.0) -> str:
    """Why nothing was written when every allocated cut failed: the smallest cut tried and what it
    cost, every attempt, and what would let a cut through. ``self_written``: the calibration is the
    model's own writing, which need not be the domain the gate measures (on Qwen2.5-Coder-1.5B it was
    mathematics, and the cost of a cut on the gate's Python text was up to 153x its cost on that text:
    docs/checkpoints.md). ``baselines``: each evaluation domain's baseline perplexity; with more than
    one, an attempt's cost is that of the domain it did worst on, named (``baseline_ppl`` is the first
    domain's). When one block narrowed alone failed, the message names it and how to leave it out;
    ``left_out``: the blocks the search already left out for that (``policy.drop_failing_blocks``).
    ``budget`` / ``kl_budget``: the recipe's; the gate holds the bound to them less ``headroom``."""
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
    def amount(share: float) -> str:
        return (f"KL {kl_budget * share:g} nats/token" if kl_budget is not None else
                f"+{100 * budget * share:.1f} %" if mode == "relative" else f"+{budget * share:g} perplexity")

    allowed = f"the budget of {amount(1.0)}"
    if headroom:
        allowed = (f"the gate's limit of {amount(1.0 - headroom)} ({allowed} less policy.headroom {headroom:.0%}, "
                   "kept for text unlike the gate's)")
    tried = (f"; tried: {'; '.join(cost(a) for a in attempts)}" if len(attempts) > 1 else
             " (the only cut the search tried)")
    on = "" if kl_budget is not None or several else " perplexity on the gate's text"
    field = "kl_budget" if kl_budget is not None else "ppl_budget"
    if self_written:
        first = ("The calibration is the model's own writing (calibration.dataset: self), which may not be the "
                 "domain the gate measures: calibrate on text of the domain you use the model for (a file or dataset)")
    else:
        first = "This model gives up little of its FFN at this budget: calibrate on more text of the gate's domain"
    return (
        f"no cut passed the gate: even the smallest tried ({cost(smallest)}{on}) is over {allowed} at the gate's"
        " confidence (the upper bound of the change decides,"
        f" policy.confidence){tried}.{_left_out(left_out)}{_one_block_fails(attempts, cost, left_out)} {first}, or"
        f" raise policy.{field} above a cost listed above{' divided by 1 − headroom' if headroom else ''}"
        " by its margin"
        " (report.json: evaluation) (a run with --keep-state lets later runs at other budgets take its measurements:"
        " --measurements-from)"
    )


def blocks_phrase(indices) -> str:
    """"block 27" or "blocks 5, 27"."""
    indices = list(indices)
    return f"block{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _left_out(left_out: list[int] | None) -> str:
    if not left_out:
        return ""
    return (f" The search left out {blocks_phrase(left_out)} "
            "(its smallest step alone failed) and searched again (policy.drop_failing_blocks).")


def _one_block_fails(attempts: list[dict], cost, left_out: list[int] | None = None) -> str:
    """A sentence naming the block when an attempt that narrowed one block alone failed (every
    smaller cut the search could try narrows it too: it is the allocation's first step), else ''.
    ``left_out``: blocks already left out, added to the ``policy.exclude`` it suggests."""
    alone = [a for a in attempts if len(a.get("blocks") or {}) == 1 and not a.get("passed")]
    if not alone:
        return ""
    a = alone[-1]
    (index, width), = a["blocks"].items()
    in_all = all(index in (b.get("blocks") or {}) for b in attempts if b.get("left_out") == a.get("left_out"))
    exclude = ", ".join(map(str, sorted({int(index), *(left_out or [])})))
    return (f" Block {index} narrowed alone (to {width:,} units) fails: {cost(a)}"
            f"{'; every cut tried narrowed it' if in_all else ''}. Leave it out (policy.exclude: [{exclude}]) and "
            "run again — with this run's --keep-state, --measurements-from reuses its measurements.")
