"""What the size planner streams from a calibration text, for the tools that check its predictions:
loss gradients at every linear's output, input second moments, and every tensor priced from them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PlannerStatistics:
    fisher: object  # compressor.engine.tensorstats.output_fisher: ``grad_sq`` by module name
    moments: dict  # input second moments Ĥ by module name
    sites: list  # compressor.sizing.sites.sites: every tensor the planner prices


def planner_statistics(model, windows, batch_size: int = 4) -> PlannerStatistics:
    """One backward pass and one forward pass over ``windows`` (token ids, one row per window)."""
    from compressor.engine.tensorstats import input_moments, linear_names, output_fisher
    from compressor.output.gguf.target import gguf_namer
    from compressor.sizing.sites import sites

    fisher = output_fisher(model, windows, batch_size=batch_size)
    moments = input_moments(model, windows, linear_names(model), batch_size=batch_size)
    return PlannerStatistics(fisher, moments, sites(model, fisher, moments, gguf_namer(model)))
