"""The main pass: one layer-sequential walk of the engine feeds every per-layer part.

The engine (:class:`compressor.engine.walker.LayerWalker`) measures each
layer's statistics exactly as ``compressor profile`` does; its ``observe`` hook
hands the same batches (FFN input ``x``, output ``y``) to the parts — the
bilinear probe, the cross-feeding hooks, the ``--data`` subset — which keep
statistics of their own for that layer only. When the layer is done, each part
solves and frees its statistics, and the trained-linear part trains on the
engine's fit statistics. Memory stays one layer's statistics (of each part).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch import nn

from compressor.analysis.corpora import SubsetPart
from compressor.analysis.crossfeed import CrossFeedPart
from compressor.analysis.probe import ProbePart
from compressor.analysis.trained import trained_block
from compressor.engine.profiling import BlockProfile, block_profile
from compressor.engine.walker import LayerWalker
from compressor.inputs.data import CalibrationSet


@dataclass
class MainPass:
    """What the main pass produced, per block."""

    profiles: list[BlockProfile] = field(default_factory=list)
    probe: list[dict] = field(default_factory=list)
    trained: list[dict] = field(default_factory=list)
    crossfeed: dict | None = None
    subset_r2: list[float] = field(default_factory=list)
    subset_fit_rows: int = 0
    seconds: dict = field(default_factory=dict)


def first_window(walker: LayerWalker) -> dict[int, int]:
    """Global batch index → index (within its split) of the batch's first window."""
    out = {}
    for _, first, end in walker.splits:
        start = 0
        for b in range(first, end):
            out[b] = start
            start += walker.batches[b][1].shape[0]
    return out


def main_pass(model: nn.Module, cal: CalibrationSet, *, batch_size: int = 8, compute_dtype=torch.float32,
              probe: ProbePart | None = None, crossfeed: dict | None = None, subset: SubsetPart | None = None,
              trained: dict | None = None) -> MainPass:
    """Profile every block and run the per-layer parts given.

    ``crossfeed``: keyword arguments of :class:`CrossFeedPart` (built here, on the walker's layers);
    ``trained``: ``{"steps", "adam_lr"}`` (the trained-linear part)."""
    t_start = time.perf_counter()
    walker = LayerWalker(model, {"fit": cal.fit, "heldout": cal.heldout}, batch_size=batch_size)
    starts = first_window(walker)
    out = MainPass()
    clock = {"probe": 0.0, "crossfeed": 0.0, "subset": 0.0, "trained": 0.0}
    with ExitStack() as stack:
        cf = None
        if crossfeed is not None:
            cf = stack.enter_context(CrossFeedPart(walker.layers, walker.model_type, walker.spec.ffn_in,
                                                   compute_dtype=compute_dtype, **crossfeed))
        parts = [p for p in (probe, cf, subset) if p is not None]

        def observe(i: int, split: str, b: int, x: torch.Tensor, y: torch.Tensor) -> None:
            for p in parts:
                t0 = time.perf_counter()
                if p is probe:
                    p.observe(i, split, x, y)
                else:
                    p.observe(i, split, starts[b], x, y)
                clock[p.name] += time.perf_counter() - t0

        def on_layer(i: int, st) -> None:
            prof, fit = block_profile(st.xy)
            out.profiles.append(prof)
            held = st.xy.heldout_total()
            t0 = time.perf_counter()
            if probe is not None:
                out.probe.append(probe.finish(i, prof.r2_lin))
            t1 = time.perf_counter()
            if cf is not None:
                cf.finish(i)
            t2 = time.perf_counter()
            if subset is not None:
                out.subset_r2.append(subset.finish(i, held))
                out.subset_fit_rows = subset.n_fit
            t3 = time.perf_counter()
            if trained is not None:
                out.trained.append(trained_block(i, st.xy.fit, held, prof.r2_lin, prof.input_condition_number,
                                                 closed_form=(fit.W, fit.b), **trained))
            clock["probe"] += t1 - t0
            clock["crossfeed"] += t2 - t1
            clock["subset"] += t3 - t2
            clock["trained"] += time.perf_counter() - t3

        walker.walk(on_layer, observe=observe, compute_dtype=compute_dtype, desc="analyze")
        total = time.perf_counter() - t_start
    if cf is not None:
        out.crossfeed = cf.result()
    out.seconds = {"main_pass": total, **{f"{k}_in_main_pass": v for k, v in clock.items()}}
    return out
