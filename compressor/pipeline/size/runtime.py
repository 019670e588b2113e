"""Expected seconds of a size run's parts, for the run-time estimate said before a run
(:mod:`compressor.pipeline.estimate`; :meth:`compressor.pipeline.size.SizeWorkflow.estimate`), with the constants
measured on the 2-core machine."""

from __future__ import annotations

import torch

from compressor.recipe.schema import Recipe


def estimate(recipe: Recipe, model, fwd: float) -> dict[str, float]:
    """Expected seconds of the size stage's parts: baseline, the statistics (a backward
    pass over :data:`~.prices.FISHER_TOKENS`, the input moments of every window), pricing (large tensors on
    a sample of rows), error-compensating rounding (GPTQ's pricing, and the chosen plan's, and the anchor's
    where the run makes it, over all rows, on the moments the pricing kept), and the file and its anchor
    checked where they run."""
    from compressor.pipeline.size.prices import FISHER_TOKENS, StatisticsPrecision
    from compressor.output.registry import target_for
    from compressor.sizing.sites import priced_rows

    cal = recipe.calibration.max_tokens
    evals = sum(e.max_tokens for e in recipe.evaluation_domains())
    params = sum(p.numel() for p in model.parameters())
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
