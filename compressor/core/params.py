"""Counting a module's parameters the way a checkpoint stores them."""

from __future__ import annotations

from torch import nn


def count_params(module: nn.Module) -> int:
    """Unique parameters (tied weights counted once; ``parameters()`` already yields a tied
    parameter once, and offloaded ``meta`` placeholders all share data pointer 0, so identity
    is the parameter object, with storage as a second check for real tensors)."""
    seen: dict[int, int] = {}
    storages: set[int] = set()
    for p in module.parameters():
        if p.device.type != "meta":
            ptr = p.data_ptr()
            if ptr in storages:
                continue
            storages.add(ptr)
        seen[id(p)] = p.numel()
    return sum(seen.values())


def tied_head(model: nn.Module) -> bool:
    """Whether the output head's weight is the input embedding's (one tensor stored once, two roles)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight
