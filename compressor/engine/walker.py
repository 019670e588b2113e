"""Layer-sequential calibration: the one place where decoder layers are walked.

The pattern of GPTQ's ``llama_sequential`` and llm-compressor's sequential
pipeline. The inputs of layer 0 are captured once for every calibration
window (with the keyword arguments each layer receives: masks, position
embeddings; captured per layer, since some architectures give layers of
different types different ones). Then, for each layer in turn:

1. the **teacher** stream (the original model's hidden states) runs through
   the original layer; taps on its FFN collect the statistics of that layer
   only (``x → y`` and, when asked, ``z = [x, h] → y``);
2. with a teacher target, the **student** stream (hidden states of the model
   as compressed so far) runs through the original layer too, and the target
   is taken from the teacher (:data:`TARGETS`);
3. ``on_layer`` fits, decides and returns a replacement for the FFN (or None);
4. the replacement is installed in the model, and the student stream runs
   through the layer as replaced; the layer's statistics are freed.

Only one layer's statistics (and, with ``model.offload``, one layer's weights) are alive at a time; hidden
states live on the CPU. Under a process group each rank walks its own batches, and each split's statistics are
reduced in one fixed tree order (:class:`compressor.core.distributed.TreeReduce`): the same bits for any number
of ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Collection

import torch
from torch import nn

from compressor.core.progress import progress
from compressor.core.archs import ArchSpec, arch_for, find_blocks
from compressor.core.distributed import TreeReduce, gather_items
from compressor.engine.measure import BlockStats, _first_tensor, accumulate, set_spike_threshold
from compressor.core.onload import execution_device
from compressor.core.stats import Moments

logger = logging.getLogger(__name__)

TARGETS = ("none", "teacher_output", "teacher_residual")
"""What the replacement of block i is fitted toward.

* ``none``: block i's own output, on the original model's inputs (independent fits);
* ``teacher_output``: on the student's inputs, toward the original block's
  output at the same tokens;
* ``teacher_residual``: on the student's inputs, toward the teacher's residual
  stream after the block minus the student's residual before the FFN
  (ReplaceMe's target form), i.e. what the FFN must add to land on the teacher.
"""


class _Stop(Exception):
    """Raised by a hook to end a forward once what it needed has run (the layers above are not run)."""


@dataclass
class LayerStats:
    """Statistics of one layer's FFN (``y`` may be a teacher target)."""

    index: int
    xy: BlockStats
    zfit: Moments | None = None
    zheld: Moments | None = None
    resid_energy: float = float("nan")
    """Mean ‖r‖² of the teacher's residual stream after the layer (positions ≥ 1)."""


class _Taps:
    """Forward hooks on one layer's FFN that record x (input), h (down-projection
    input) and y (output) of the latest call; always removed on exit."""

    def __init__(self, layer: nn.Module, spec: ArchSpec, hidden: bool) -> None:
        self.ffn = layer.get_submodule(spec.ffn_in)
        self.out = layer.get_submodule(spec.ffn_out)
        self.down = self.ffn.get_submodule(spec.ffn_down) if hidden else None
        self.x = self.h = self.y = None
        self._handles: list = []

    def __enter__(self) -> "_Taps":
        def grab(name):
            def pre(module, args, kwargs):
                setattr(self, name, _first_tensor(args if args else list(kwargs.values())))
            return pre

        def post(module, args, kwargs, output):
            self.y = _first_tensor(output)

        self._handles.append(self.ffn.register_forward_pre_hook(grab("x"), with_kwargs=True))
        if self.down is not None:
            self._handles.append(self.down.register_forward_pre_hook(grab("h"), with_kwargs=True))
        self._handles.append(self.out.register_forward_hook(post, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class LayerWalker:
    """Captured layer-0 inputs for a set of windows and the per-layer call arguments. Under a process group
    each rank holds its share of the batches; ``parallel=False``: this process holds them all (a step one rank
    runs alone), the reductions in the same order.

    >>> walker = LayerWalker(model, {"fit": fit_windows, "heldout": held_windows})   # doctest: +SKIP
    >>> for i, stats in walker.walk(on_layer=lambda i, st: None): ...                 # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, windows: dict[str, torch.Tensor], *, batch_size: int = 8,
                 store_dtype: torch.dtype | None = None, parallel: bool = True) -> None:
        self.model, self.parallel = model, parallel
        self.model_type, self.spec = arch_for(model)
        self.blocks_path, self.layers = find_blocks(model, self.spec)
        self.batch_size = batch_size
        self.store_dtype = store_dtype
        # batches: (split, window ids [B, T]), every rank's; kwargs per (B, T) shape per layer
        self.batches: list[tuple[str, torch.Tensor]] = []
        self.splits: list[tuple[str, int, int]] = []  # (split, first batch, end)
        for split, w in windows.items():
            first = len(self.batches)
            for start in range(0, w.shape[0], batch_size):
                self.batches.append((split, w[start:start + batch_size]))
            self.splits.append((split, first, len(self.batches)))
        # This rank's batches (all of them in one process): whole subtrees of each
        # split's reduction tree, so every batch is summed in the same order for any
        # number of ranks (see compressor.core.distributed). Streams hold these only.
        self.local: list[int] = [first + j for _, first, end in self.splits for j in self._tree(first, end).items]
        self._layer_args: dict[tuple[int, int], list[tuple[tuple, dict]]] = {}
        self.inputs: list[torch.Tensor] = self._capture()

    def _tree(self, first: int, end: int) -> TreeReduce:
        def merge(a, b):
            a[0].merge_(b[0])
            return a[0], (a[1].merge_(b[1]) if a[1] is not None else None)

        def portable(p):  # what goes through all_gather lives on the CPU
            return p[0].to("cpu"), None if p[1] is None else p[1].to("cpu")

        return TreeReduce(end - first, merge, portable=portable, ranks=self.parallel)

    # -- capture ------------------------------------------------------------
    @torch.no_grad()
    def _capture(self) -> list[torch.Tensor]:
        model, layers = self.model, self.layers
        device = execution_device(model.get_input_embeddings())
        n = len(layers)
        state = {"shape": None, "record_all": False, "h0": None, "args": None}

        def make_hook(i):
            def hook(module, args, kwargs):
                if i == 0:
                    state["h0"] = _first_tensor(args if args else list(kwargs.values())).detach()
                if state["record_all"]:
                    rest = tuple(args[1:]) if args else ()
                    kw = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                    state["args"].append((rest, kw))
                    if i == n - 1:
                        raise _Stop
                else:
                    raise _Stop
            return hook

        handles = [layer.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
        inputs = []
        was_training = model.training
        model.eval()
        try:
            for b in progress(self.local, desc="engine: capture layer-0 inputs", unit="batch"):
                ids = self.batches[b][1]
                shape = tuple(ids.shape)
                state["record_all"] = shape not in self._layer_args
                state["args"] = []
                try:
                    model(input_ids=ids.to(device), use_cache=False)
                except _Stop:
                    pass
                if state["record_all"]:
                    if len(state["args"]) != n:
                        raise RuntimeError(
                            f"captured arguments of {len(state['args'])} of {n} layers; is the model complete?"
                        )
                    self._layer_args[shape] = state["args"]
                h0 = state["h0"]
                inputs.append(h0.to("cpu", self.store_dtype or h0.dtype))
        finally:
            for h in handles:
                h.remove()
            model.train(was_training)
        return inputs

    def layer_args(self, b: int, i: int) -> tuple[tuple, dict]:
        return self._layer_args[tuple(self.batches[b][1].shape)][i]

    # -- one layer ------------------------------------------------------------
    @torch.no_grad()
    def forward_layer(self, i: int, stream: list[torch.Tensor], taps: _Taps | None = None,
                      on_batch: Callable[[int, torch.Tensor], None] | None = None,
                      positions: list[int] | None = None) -> list[torch.Tensor]:
        """Run layer ``i`` on this rank's batches of ``stream`` (those at ``positions``, default all);
        returns its outputs (CPU). ``on_batch`` receives the global batch index."""
        layer = self.layers[i]
        device = execution_device(layer)
        out = []
        for p in range(len(stream)) if positions is None else positions:
            b, h = self.local[p], stream[p]
            args, kwargs = self.layer_args(b, i)
            y = _first_tensor(layer(h.to(device), *args, **kwargs))
            if on_batch is not None:
                on_batch(b, y)
            out.append(y.to("cpu", h.dtype))
        return out

    # -- the walk -------------------------------------------------------------
    def walk(
        self,
        on_layer: Callable[[int, LayerStats], nn.Module | None],
        *,
        hidden: bool = False,
        target: str = "none",
        spike_factor: float = 20.0,
        compute_dtype: torch.dtype = torch.float32,
        layers: list[int] | None = None,
        desc: str = "engine",
        output_rank: bool = False,
        done: Collection[int] = (),
        replay: Callable[[int], nn.Module | None] | None = None,
        observe: Callable[[int, str, int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> None:
        """Walk the layers; ``on_layer(i, stats)`` may return a replacement for layer i's
        FFN, which is installed in the model before the walk moves on.

        Layers in ``done`` were finished by an interrupted run (:mod:`compressor.engine.runstate`):
        they are not measured; ``replay(i)`` gives the replacement that run installed
        (or None), and the streams only run forward through them. Past the last layer
        left to measure, nothing runs at all.

        ``observe(i, split, batch, x, y)``, if given, sees every measured batch (this
        rank's) after the engine's own statistics took it: FFN input ``x`` and target
        ``y`` as the engine accumulated them, so a caller can keep statistics of its
        own in the same pass (:mod:`compressor.analysis` does) without storing rows."""
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        if target == "teacher_residual" and not self.spec.residual_direct:
            raise ValueError(
                f"target teacher_residual is not defined for {self.model_type}: {self.spec.note}. "
                "Use teacher_output or none."
            )
        teacher = self.inputs
        student = self.inputs if target != "none" else None
        wanted = set(range(len(self.layers)) if layers is None else layers)
        last = max(wanted) if wanted else -1
        if done and replay is None:
            raise ValueError("walk: layers given as done need replay= to install what they produced")
        last_measured = max(wanted - set(done), default=-1)
        bar = progress(range(len(self.layers)), desc=desc, unit="layer")
        for i in bar:
            if i > last:
                break
            if i not in wanted:
                if i < last_measured:
                    teacher = self.forward_layer(i, teacher)
                    if student is not None:
                        student = self.forward_layer(i, student)
                continue
            bar.set_description(f"{desc}: layer {i + 1}/{len(self.layers)}")
            if i in done:
                if i < last_measured:
                    teacher = self.forward_layer(i, teacher)
                replacement = replay(i)
            else:
                result = self._layer_stats(i, teacher, student, hidden, target, spike_factor, compute_dtype,
                                           output_rank, observe)
                teacher = result["teacher_next"]
                replacement = on_layer(i, result["stats"])
                del result
            if replacement is not None:
                self.model.set_submodule(f"{self.blocks_path}.{i}.{self.spec.ffn_in}", replacement)
            if student is not None and i < last_measured:
                student = self.forward_layer(i, student)
        bar.close()

    def _layer_stats(self, i, teacher, student, hidden, target, spike_factor, compute_dtype, output_rank=False,
                     observe=None) -> dict:
        """Statistics of layer ``i``, split by split: each split's per-batch partials are
        reduced over all ranks (tree order) before the next split starts, because the
        held-out rows are partitioned with a spike threshold taken from *all* fit rows."""
        layer = self.layers[i]
        threshold = float("inf")
        energy: dict[int, tuple[float, int]] = {}
        reduced: dict[str, tuple[BlockStats, Moments | None]] = {}
        position = {b: p for p, b in enumerate(self.local)}

        def partial(x: torch.Tensor, h: torch.Tensor | None, y: torch.Tensor, split: str):
            st = BlockStats.empty(i, x.shape[-1], y.shape[-1], output_rank, lazy=True)
            st.spike_threshold = threshold
            accumulate(st, x, y, split, compute_dtype)
            if not hidden:
                return st, None
            z = torch.cat([x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1])], dim=1)
            m = Moments(z.shape[1], y.shape[-1])
            m.update(z, y.reshape(-1, y.shape[-1]), compute_dtype)
            return st, m

        def resid(b: int, out: torch.Tensor) -> None:
            r = out[:, 1:].float() if out.dim() == 3 else out.float()
            energy[b] = (float((r * r).sum()), r.numel() // r.shape[-1])

        with _Taps(layer, self.spec, hidden) as taps:
            teacher_next: list[torch.Tensor | None] = [None] * len(self.local)
            ys: dict[int, torch.Tensor] = {}
            if target != "none":
                def on_teacher(b, out):
                    resid(b, out)
                    ys[b] = taps.y.to("cpu")
                teacher_next = self.forward_layer(i, teacher, on_batch=on_teacher)
            for split, first, end in self.splits:
                if split == "heldout" and end > first:
                    fit = reduced.get("fit")
                    probe = fit[0] if fit else BlockStats.empty(i, 1, 1)
                    set_spike_threshold(probe, spike_factor)
                    threshold = probe.spike_threshold
                tree = self._tree(first, end)
                positions = [position[first + j] for j in tree.items]

                def on_batch(b, out):
                    if target == "none":
                        resid(b, out)
                        y = taps.y
                    elif target == "teacher_output":
                        y = ys[b].to(out.device, out.dtype)
                    else:  # what the FFN must add to the student's residual to land on the teacher's
                        y = taps.y + (teacher_next[position[b]].to(out.device, out.dtype) - out)
                    tree.push(b - first, partial(taps.x, taps.h, y, split))
                    if observe is not None:
                        observe(i, split, b, taps.x, y)

                if target == "none":
                    outs = self.forward_layer(i, teacher, on_batch=on_batch, positions=positions)
                    for p, o in zip(positions, outs):
                        teacher_next[p] = o
                else:
                    self.forward_layer(i, student, on_batch=on_batch, positions=positions)
                reduced[split] = tree.result()
        xy: BlockStats | None = None
        zm: dict[str, Moments] = {}
        for split, (st, z) in ((s, r) for s, r in reduced.items() if r is not None):
            xy = st if xy is None else xy.merge_(st)
            if z is not None:
                zm[split] = z.to("cpu")
        if xy is None:
            raise RuntimeError(f"layer {i}'s FFN was never called; is the model complete?")
        xy.materialize_().to("cpu")
        # summed in batch order on every rank: the same bits for any number of ranks
        total, rows = 0.0, 0
        for s, c in gather_items(energy, len(self.batches)):
            total += s
            rows += c
        return {"teacher_next": teacher_next,
                "stats": LayerStats(i, xy, zm.get("fit"), zm.get("heldout"), total / max(rows, 1))}
