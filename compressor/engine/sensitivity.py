"""How much the language-model loss cares about each FFN's output.

One forward + backward pass per calibration batch accumulates, per block,
the diagonal of ``M = E[g gᵀ]`` with ``g = ∂ loss / ∂ y`` the gradient of the
next-token loss at the FFN output (the empirical Fisher of the block output,
Hassibi & Stork's curvature proxy). Two uses:

* **loss-aware selection** (``replacement.selection: loss``): the OBS cost of
  dropping unit ``j`` becomes ``Σ_o M_oo B_jo² / [S⁻¹]_jj`` — least squares
  gives the same coefficients under any output weighting, but *which* units
  to keep depends on it;
* **allocation** (``policy.allocation: fisher``): a block's sensitivity is
  ``Σ_o M_oo Var(y_o)``, the expected loss change per unit of relative
  output error.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from compressor.core import distributed as dist
from compressor.core.onload import input_device
from compressor.core.progress import progress


#: Bytes of backward activations one pass may hold (see :func:`backward_rows`): a fixed number, so the
#: micro-batching, and with it every bit of the result, is the same on every machine.
BACKWARD_BUDGET_BYTES = 6 << 30


def backward_rows(model: nn.Module, seq_len: int, batch_size: int) -> int:
    """Windows per forward + backward, at most ``batch_size``: what the saved activations of every layer
    (about ``4·d_ff + 10·d`` floats per token per layer) and the logits' softmax and gradient (about
    ``4·vocab`` per token) of that many windows fit in :data:`BACKWARD_BUDGET_BYTES`. Measured on
    Qwen2.5-Coder-1.5B: 16 windows of 128 tokens held 16.8 GB (1.05 GB a window; this estimate: 1.04),
    so the whole batch at once took the process to 23 GB of a 24 GB machine."""
    cfg = getattr(model.config, "text_config", None) or model.config
    d = int(getattr(cfg, "hidden_size", 0) or 0)
    ff = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * d)
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    vocab = int(getattr(cfg, "vocab_size", 0) or 0)
    per_window = 4 * seq_len * (layers * (4 * ff + 10 * d) + 4 * vocab)
    return max(1, min(batch_size, BACKWARD_BUDGET_BYTES // max(per_window, 1)))


@contextmanager
def frozen(model: nn.Module):
    """Eval mode with no parameter gradients for a backward pass to the activations; restored after."""
    was_training, req = model.training, {n: p.requires_grad for n, p in model.named_parameters()}
    model.eval()
    model.requires_grad_(False)
    try:
        yield model
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(req[n])
        model.train(was_training)


def summed_loss_backward(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Forward from the token embeddings and backward of the next-token loss *summed* over tokens (so the
    gradient at token t is that of the total loss); hooks see the activations' gradients. Returns the
    gradient at the embedding output."""
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    del logits
    loss.backward()
    return emb.grad


def output_grad_moments(model: nn.Module, windows: torch.Tensor, modules: dict[int, str], *,
                        batch_size: int = 8) -> dict[int, torch.Tensor]:
    """Per block index: mean of ``g²`` over calibration tokens (float64, [d_out], CPU).

    Under a process group each rank runs a contiguous share of the batches; the
    per-batch sums are gathered and added in batch order, as one process would.
    A batch whose backward would not fit :data:`BACKWARD_BUDGET_BYTES` runs in
    consecutive slices of :func:`backward_rows` windows (the sums are the same)."""
    per_batch: dict[int, dict[int, torch.Tensor]] = {}  # batch → block → Σ g²
    sums: dict[int, torch.Tensor] = {}  # the current batch's
    handles = []

    def make_hook(i: int):
        def fwd(module, args, output):
            out = output[0] if isinstance(output, tuple) else output

            def grad_hook(g):
                g2 = g.detach().double().pow(2).sum(dim=tuple(range(g.dim() - 1))).cpu()
                sums[i] = g2 if i not in sums else sums[i] + g2
            out.register_hook(grad_hook)
        return fwd

    for i, path in modules.items():
        handles.append(model.get_submodule(path).register_forward_hook(make_hook(i)))
    device = input_device(model)
    starts = range(0, windows.shape[0], batch_size)
    rows = backward_rows(model, windows.shape[1], batch_size)
    try:
        with frozen(model):
            for b in progress(dist.shard(len(starts)), desc="sensitivity: loss gradients", unit="batch"):
                sums = per_batch[b] = {}
                batch = windows[starts[b]:starts[b] + batch_size]
                for first in range(0, batch.shape[0], rows):
                    summed_loss_backward(model, batch[first:first + rows].to(device))
    finally:
        for h in handles:
            h.remove()
    total: dict[int, torch.Tensor] = {}
    for batch in dist.gather_items(per_batch, len(starts)):
        for i, g2 in batch.items():
            total[i] = g2 if i not in total else total[i] + g2
    return {i: s / max(windows.numel(), 1) for i, s in total.items()}
