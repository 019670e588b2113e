"""The size plan's statistics, one decoder layer resident at a time: F at every linear's output, Ĥ at its input.

:func:`compressor.engine.tensorstats.output_fisher` runs one forward + backward through the whole model: autograd
keeps every layer's weights alive until the backward reaches them, so an onloaded model (``model.offload``) would
be materialised whole. Here the same quantity is measured with recomputation, as activation checkpointing does,
per layer:

1. one forward with no graph, which keeps each layer's input hidden states and arguments (masks, position
   embeddings) for every batch, and the last layer's output;
2. what comes after the layers (final norm, head, an architecture's soft-capping: the model run from
   ``inputs_embeds`` with its layer list emptied), the summed next-token loss, backward to the last hidden state;
3. from the top layer down: the layer's forward recomputed from its kept input, backward with the gradient from
   above; its input's gradient goes to the layer below. accelerate's hooks read the layer's weights when it runs,
   and autograd frees them after its backward, so one layer's weights and activations are alive at a time;
4. the embedding's gradient from layer 0's input gradient.

Every batch and layer computes what the whole-model pass computes, batch by batch in the same order, so each
module's sum is added up in the same order (``tests/test_size_stream.py`` compares the two).

Ĥ (:func:`layer_moments`) is measured the way the layer-sequential engine walks (:class:`~compressor.engine.walker.
LayerWalker`): every calibration window's hidden states go through layer ``i``, its linears' inputs are summed,
and the layer's moments are handed to the caller (priced, spilled) before layer ``i + 1`` runs; one pass over the
layers, where measuring in groups of layers re-runs every layer below each group. Cross-fitted prices' two halves
(the even and the odd windows) are two splits of the same walk, each summed in its own taps.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core.archs import arch_for, find_blocks
from compressor.core.onload import execution_device
from compressor.core.progress import progress
from compressor.engine.measure import _first_tensor
from compressor.engine.sensitivity import backward_rows, frozen
from compressor.engine.tensorstats import EMBEDDING, Fisher, GradSquares, MomentTaps, _AllSeen, linear_names
from compressor.engine.walker import LayerWalker, _Stop

LinearMoments = dict[str, torch.Tensor]
"""Ĥ of some linears by name (:meth:`~compressor.engine.tensorstats.MomentTaps.moments`)."""
FoldMoments = tuple[LinearMoments, LinearMoments]
"""Ĥ over the even and over the odd calibration windows (:func:`layer_moments` with ``folds``)."""


@contextmanager
def _without_layers(model: nn.Module, path: str):
    """``model`` with its decoder-layer list emptied (restored on exit): a forward from ``inputs_embeds`` runs
    only what comes after the layers."""
    parent_path, _, leaf = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layers = getattr(parent, leaf)
    setattr(parent, leaf, nn.ModuleList())
    try:
        yield
    finally:
        setattr(parent, leaf, layers)


@torch.no_grad()
def _layer_inputs(model: nn.Module, layers: nn.ModuleList, emb: torch.Tensor):
    """Every layer's ``(hidden input, other args, kwargs)`` and the last layer's output, from one forward."""
    inputs: list = []
    last: dict = {}

    def pre(module, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        inputs.append((h.detach(), tuple(args[1:]) if args else (),
                       {k: v for k, v in kwargs.items() if k != "hidden_states"}))

    def post(module, args, kwargs, output):
        last["h"] = _first_tensor(output).detach()
        raise _Stop

    handles = [layer.register_forward_pre_hook(pre, with_kwargs=True) for layer in layers]
    handles.append(layers[-1].register_forward_hook(post, with_kwargs=True))
    try:
        model(inputs_embeds=emb, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return inputs, last["h"]


def _head_backward(model: nn.Module, path: str, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The summed next-token loss from the last hidden state ``h``, backward: the gradient at ``h``."""
    h = h.detach().requires_grad_(True)
    with _without_layers(model, path):
        logits = model(inputs_embeds=h, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    del logits
    loss.backward()
    return h.grad


def _layer_backward(layer: nn.Module, saved, grad: torch.Tensor) -> torch.Tensor:
    """Layer ``layer`` recomputed from its saved input, backward with ``grad`` at its output: its input's gradient."""
    h, args, kwargs = saved
    x = h.detach().requires_grad_(True)
    out = _first_tensor(layer(x, *args, **kwargs))
    torch.autograd.backward(out, grad)
    return x.grad


def _embedding_backward(model: nn.Module, layers: nn.ModuleList, emb: torch.Tensor, grad: torch.Tensor):
    """The gradient at the token embeddings ``emb`` from ``grad`` at layer 0's input (whatever the model does
    between them, recomputed)."""
    emb = emb.detach().requires_grad_(True)
    got: dict = {}

    def pre(module, args, kwargs):
        got["h"] = args[0] if args else kwargs["hidden_states"]
        raise _Stop

    handle = layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        model(inputs_embeds=emb, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    torch.autograd.backward(got["h"], grad)
    return emb.grad


def output_fisher_sequential(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8,
                             names: list[str] | None = None, counted: torch.Tensor | None = None,
                             parallel: bool = False) -> Fisher:
    """:func:`~compressor.engine.tensorstats.output_fisher`, measured one decoder layer at a time (the same
    arguments and result): for a model whose layers are onloaded (:mod:`compressor.core.onload`). Holds every
    layer's input hidden states of ``windows`` (float32: ``layers × tokens × d × 4`` bytes; 8,192 tokens of
    an 8B are 4.3 GB) besides one layer's weights and activations."""
    names = linear_names(model) if names is None else names
    _, spec = arch_for(model)
    path, layers = find_blocks(model, spec)
    embed = model.get_input_embeddings()
    device = execution_device(embed)
    rows = backward_rows(model, windows.shape[1], batch_size)
    starts = range(0, windows.shape[0], rows)
    with frozen(model), GradSquares(model, names, len(starts), parallel) as squares:
        mine = squares.items  # this rank's batches (all of them in one process)
        batches = [windows[starts[b]:starts[b] + rows].to(device) for b in mine]
        embs, saved, grads = [], [], []
        for ids in progress(batches, desc="price: loss gradients (forward)", unit="batch"):
            with torch.no_grad():
                embs.append(embed(ids))
            inputs, last = _layer_inputs(model, layers, embs[-1])
            saved.append(inputs)
            grads.append(last)
        for k, ids in enumerate(batches):  # the head: one batch at a time, in order
            squares.begin(mine[k])
            grads[k] = _head_backward(model, path, grads[k], ids)
        for i in progress(range(len(layers) - 1, -1, -1), desc="price: loss gradients (backward)", unit="layer"):
            for k in range(len(batches)):
                squares.begin(mine[k])
                grads[k] = _layer_backward(layers[i], saved[k][i], grads[k])
                saved[k][i] = None  # this layer's input is no longer needed
        for k in range(len(batches)):
            squares.begin(mine[k])
            squares.add(EMBEDDING, _embedding_backward(model, layers, embs[k], grads[k]))
        return squares.fisher(windows.numel(), windows if counted is None else counted)


def layer_moments(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 8, names: list[str] | None = None,
                  parallel: bool = False, folds: bool = False, tokens: dict[str, int] | None = None,
                  ) -> Iterator[tuple[list[str], LinearMoments | FoldMoments]]:
    """:func:`~compressor.engine.tensorstats.input_moments` of every linear in ``names`` (default: all), one
    decoder layer at a time: yields ``(that layer's linears, their moments)`` layer by layer, then the linears
    that run after the layers (the output head, fed the final norm of the last layer's output). The same
    batches and sums as the whole-model passes. Holds the hidden states of every window (float32) and one
    layer's weights and moments.

    ``folds``: the moments over the even and over the odd windows apart, in the same pass — each item is
    ``(linears, (even, odd))``, the same bits as ``input_moments`` of ``windows[0::2]`` and of ``windows[1::2]``
    (:func:`~compressor.pipeline.size.prices.fold_moments`): each half is its own split of the walk, batched
    and numbered from 0 within it, its sums in its own tree.

    ``tokens``: filled with the tokens each linear read, over every split (fewer than all for a routed expert),
    as each layer is measured.

    >>> for linears, (even, odd) in layer_moments(model, windows, folds=True): ...   # doctest: +SKIP
    """
    names = linear_names(model) if names is None else names
    splits = {"even": windows[0::2], "odd": windows[1::2]} if folds else {"calibration": windows}
    walker = LayerWalker(model, splits, batch_size=batch_size, parallel=parallel)
    path = walker.blocks_path
    position = {b: p for p, b in enumerate(walker.local)}
    stream = walker.inputs

    def measured(linears: list[str], run, stop: bool = False) -> list[LinearMoments]:
        """Each split's moments of ``linears``: ``run(positions, end_batch)`` runs the split's batches (this
        rank's, at those positions of the stream, in its tree's order) and calls ``end_batch(b)`` after each
        with the walker's batch index ``b`` (the taps number the split's batches from 0)."""
        out = []
        for split, first, end in walker.splits:
            with MomentTaps(model, linears, end - first, stop=stop, parallel=parallel) as taps:
                run([position[first + j] for j in taps.items], lambda b, first=first: taps.end_batch(b - first))
            out.append(taps.moments(splits[split].numel()))  # a collective with ``parallel``: every rank, in order
            if tokens is not None:
                for name, rows in taps.rows.items():
                    tokens[name] = tokens.get(name, 0) + rows
        return out

    for i in range(len(walker.layers)):
        mine = [n for n in names if n.startswith(f"{path}.{i}.")]
        following: list[torch.Tensor | None] = [None] * len(stream)

        def run(positions: list[int], end_batch) -> None:
            outs = walker.forward_layer(i, stream, positions=positions, on_batch=lambda b, y: end_batch(b))
            for p, y in zip(positions, outs):  # the next layer's stream in the walker's order
                following[p] = y

        moments = measured(mine, run)
        stream = following
        yield mine, tuple(moments) if folds else moments[0]
    rest = [n for n in names if not n.startswith(f"{path}.")]
    if rest:
        device = execution_device(model.get_input_embeddings())

        def head(positions: list[int], end_batch) -> None:
            with _without_layers(model, path), torch.no_grad():
                for p in positions:
                    try:
                        model(inputs_embeds=stream[p].to(device), use_cache=False)
                    except _AllSeen:
                        pass
                    end_batch(walker.local[p])

        moments = measured(rest, head, stop=True)
        yield rest, tuple(moments) if folds else moments[0]
