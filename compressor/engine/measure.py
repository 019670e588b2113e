"""Measure: stream calibration windows through the model and accumulate, per
FFN block, the statistics of its input → output map (never the activations).

Fit windows are run first; held-out windows after, so the held-out rows can
be partitioned into the attention-sink rows (sequence position 0), "spike"
rows (output norm above ``spike_factor`` × the fit rows' median norm) and the
bulk. The three parts sum exactly to the held-out statistics, which is what
makes outlier-dominated blocks visible.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn
from compressor.core.progress import progress

from compressor.core.archs import arch_for, find_blocks
from compressor.core.finite import check_activations_finite
from compressor.core.onload import input_device
from compressor.core.stats import LogHistogram, Moments

logger = logging.getLogger(__name__)

PARTS = ("sink", "spike", "bulk")


@dataclass
class BlockStats:
    """Everything measured for one block; merges by addition."""

    index: int
    fit: Moments
    heldout: dict[str, Moments]  # keys: PARTS
    in_norms: LogHistogram = field(default_factory=LogHistogram)
    out_norms_fit: LogHistogram = field(default_factory=LogHistogram)
    spike_threshold: float = float("inf")

    @classmethod
    def empty(cls, index: int, d_in: int, d_out: int, full_cyy: bool = False, lazy: bool = False) -> "BlockStats":
        """``lazy``: partitions allocate their sums only when rows arrive (see :meth:`materialize_`)."""
        new = Moments.placeholder if lazy else Moments
        return cls(
            index=index,
            fit=new(d_in, d_out, full_cyy),
            heldout={p: new(d_in, d_out, full_cyy) for p in PARTS},
        )

    def materialize_(self) -> "BlockStats":
        """Zero sums for partitions that never received rows (after merging lazy partials)."""
        self.fit.materialize_()
        for m in self.heldout.values():
            m.materialize_()
        return self

    def heldout_total(self) -> Moments:
        total = Moments(self.fit.d_in, self.fit.d_out, self.fit.full_cyy)
        for part in PARTS:
            total.merge_(self.heldout[part])
        return total

    def to(self, device) -> "BlockStats":
        """Move the sums to ``device`` in place (the solves run on the CPU)."""
        self.fit = self.fit.to(device)
        self.heldout = {p: m.to(device) for p, m in self.heldout.items()}
        return self

    def merge_(self, other: "BlockStats") -> "BlockStats":
        self.fit.merge_(other.fit)
        for part in PARTS:
            self.heldout[part].merge_(other.heldout[part])
        self.in_norms.merge_(other.in_norms)
        self.out_norms_fit.merge_(other.out_norms_fit)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        p = f"block{self.index}"
        sd = self.fit.state_dict(f"{p}.fit")
        for part in PARTS:
            sd.update(self.heldout[part].state_dict(f"{p}.heldout.{part}"))
        sd.update(self.in_norms.state_dict(f"{p}.in_norms"))
        sd.update(self.out_norms_fit.state_dict(f"{p}.out_norms_fit"))
        sd[f"{p}.spike_threshold"] = torch.tensor([self.spike_threshold], dtype=torch.float64)
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor], index: int) -> "BlockStats":
        p = f"block{index}"
        return cls(
            index=index,
            fit=Moments.from_state_dict(sd, f"{p}.fit"),
            heldout={part: Moments.from_state_dict(sd, f"{p}.heldout.{part}") for part in PARTS},
            in_norms=LogHistogram.from_state_dict(sd, f"{p}.in_norms"),
            out_norms_fit=LogHistogram.from_state_dict(sd, f"{p}.out_norms_fit"),
            spike_threshold=float(sd[f"{p}.spike_threshold"][0]),
        )


def set_spike_threshold(st: BlockStats, spike_factor: float) -> None:
    """Fix the spike threshold from the fit rows' output norms (call before held-out rows)."""
    median = st.out_norms_fit.quantile(0.5)
    st.spike_threshold = spike_factor * median if median == median else float("inf")


@torch.no_grad()
def accumulate(st: BlockStats, x: torch.Tensor, y: torch.Tensor, split: str, compute_dtype=torch.float32) -> None:
    """Fold one batch of FFN inputs ``x`` [B, T, d] and outputs ``y`` into ``st``.

    Held-out rows go to the sink (position 0), spike or bulk partition."""
    T = x.shape[-2] if x.dim() == 3 else 1
    x2 = x.reshape(-1, x.shape[-1])
    y2 = y.reshape(-1, y.shape[-1])
    st.in_norms.update(x2.float().norm(dim=1))
    if split == "fit":
        st.fit.update(x2, y2, compute_dtype)
        st.out_norms_fit.update(y2.float().norm(dim=1))
        return
    pos = torch.arange(x2.shape[0], device=x2.device) % T
    sink = pos == 0
    spike = ~sink & (y2.float().norm(dim=1) > st.spike_threshold)
    bulk = ~(sink | spike)
    for part, mask in (("sink", sink), ("spike", spike), ("bulk", bulk)):
        if bool(mask.any()):
            st.heldout[part].update(x2[mask], y2[mask], compute_dtype)


class _StopForward(Exception):
    """Raised after the last measured block: nothing downstream is needed."""


def _first_tensor(obj) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, (tuple, list)) and obj and isinstance(obj[0], torch.Tensor):
        return obj[0]
    raise TypeError(f"expected a tensor or a tuple starting with one, got {type(obj).__name__}")


class StatsCollector:
    """Owns the forward hooks that feed :class:`BlockStats`; always removes them.

    >>> with StatsCollector(model, blocks=[0, 3]) as c:   # doctest: +SKIP
    ...     c.run(fit_windows, split="fit"); c.run(heldout_windows, split="heldout")
    >>> c.stats[3].fit.n                                   # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: list[int] | None = None,
        *,
        spike_factor: float = 20.0,
        compute_dtype: torch.dtype = torch.float32,
        output_rank: bool = False,
        stop_early: bool = True,
    ) -> None:
        self.model = model
        _, self.spec = arch_for(model)
        self.blocks_path, block_list = find_blocks(model, self.spec)
        n = len(block_list)
        self.indices = sorted(set(range(n) if blocks is None else blocks))
        bad = [i for i in self.indices if not 0 <= i < n]
        if bad:
            raise ValueError(f"block indices {bad} out of range: the model has {n} blocks (0..{n - 1})")
        self.block_list = block_list
        self.spike_factor = spike_factor
        self.compute_dtype = compute_dtype
        self.output_rank = output_rank
        self.stop_early = stop_early
        self.stats: dict[int, BlockStats] = {}
        self.split = "fit"
        self._handles: list = []
        self._pending_x: dict[int, torch.Tensor] = {}

    # -- hooks ------------------------------------------------------------
    def __enter__(self) -> "StatsCollector":
        last = self.indices[-1] if self.indices else -1
        for i in self.indices:
            block = self.block_list[i]
            try:
                mod_in = block.get_submodule(self.spec.ffn_in)
                mod_out = block.get_submodule(self.spec.ffn_out)
            except AttributeError as e:
                self.__exit__(None, None, None)
                raise ValueError(
                    f"block {i} ({type(block).__name__}) has no FFN module at "
                    f"{self.spec.ffn_in!r}/{self.spec.ffn_out!r}: {e}"
                ) from e
            stop = self.stop_early and i == last
            if mod_in is mod_out:
                self._handles.append(
                    mod_out.register_forward_hook(self._make_hook(i, stop, same=True), with_kwargs=True)
                )
            else:
                self._handles.append(mod_in.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True))
                self._handles.append(
                    mod_out.register_forward_hook(self._make_hook(i, stop, same=False), with_kwargs=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending_x.clear()

    def _make_pre_hook(self, i: int):
        def hook(module, args, kwargs):
            self._pending_x[i] = _first_tensor(args if args else list(kwargs.values()))

        return hook

    def _make_hook(self, i: int, stop: bool, same: bool):
        def hook(module, args, kwargs, output):
            x = _first_tensor(args if args else list(kwargs.values())) if same else self._pending_x.pop(i)
            self._accumulate(i, x, _first_tensor(output))
            if stop:
                raise _StopForward

        return hook

    def _accumulate(self, i: int, x: torch.Tensor, y: torch.Tensor) -> None:
        check_activations_finite(i, "FFN input", x, x.dtype)
        check_activations_finite(i, "FFN output", y, y.dtype)
        st = self.stats.get(i)
        if st is None:
            st = self.stats[i] = BlockStats.empty(i, x.shape[-1], y.shape[-1], self.output_rank)
        accumulate(st, x, y, self.split, self.compute_dtype)

    # -- driving ----------------------------------------------------------
    def _set_split(self, split: str) -> None:
        if split not in ("fit", "heldout"):
            raise ValueError(f"split must be 'fit' or 'heldout', got {split!r}")
        if split == "heldout":
            for st in self.stats.values():
                set_spike_threshold(st, self.spike_factor)
        self.split = split

    @torch.no_grad()
    def run(self, windows: torch.Tensor, split: str, batch_size: int = 8, desc: str = "measure") -> None:
        """Forward ``windows`` [N, L] (token ids) in batches, accumulating into ``split``."""
        self._set_split(split)
        device = input_device(self.model)
        n = windows.shape[0]
        steps = range(0, n, batch_size)
        bar = progress(steps, desc=f"{desc} ({split})", unit="batch")
        for start in bar:
            batch = windows[start : start + batch_size].to(device)
            try:
                self.model(input_ids=batch, use_cache=False)
            except _StopForward:
                pass
        bar.close()


def collect(
    model: nn.Module,
    fit_windows: torch.Tensor,
    heldout_windows: torch.Tensor,
    *,
    blocks: list[int] | None = None,
    batch_size: int = 8,
    spike_factor: float = 20.0,
    precision: str = "float32",
    output_rank: bool = False,
) -> dict[int, BlockStats]:
    """One streaming pass (fit windows, then held-out windows) → per-block statistics."""
    compute_dtype = {"float32": torch.float32, "float64": torch.float64}[precision]
    was_training = model.training
    model.eval()
    try:
        with StatsCollector(
            model, blocks, spike_factor=spike_factor, compute_dtype=compute_dtype, output_rank=output_rank
        ) as c:
            c.run(fit_windows, "fit", batch_size)
            c.run(heldout_windows, "heldout", batch_size)
    finally:
        model.train(was_training)
    for st in c.stats.values():
        st.to("cpu")
    missing = [i for i in c.indices if i not in c.stats]
    if missing:
        raise RuntimeError(f"blocks {missing} were never called during the forward pass; is the model complete?")
    return c.stats
