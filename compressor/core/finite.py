"""NaN/Inf checks that name the tensor, its block and the fix.

* :func:`check_weights_finite` — the loaded checkpoint has no NaN/Inf weight
  (:class:`~compressor.core.errors.NonFiniteWeightsError`, exit 2);
* :func:`check_activations_finite` — a block's input/output stayed finite in
  the compute dtype (called by the measurement engine;
  :class:`~compressor.core.errors.NonFiniteActivationError`, exit 1).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from compressor.core.errors import NonFiniteActivationError, NonFiniteWeightsError

if TYPE_CHECKING:  # torch is imported lazily
    import torch
    from torch import nn

_BLOCK = re.compile(r"\.(?:layers|h|layer|blocks)\.(\d+)\.")


def _block_of(name: str) -> str:
    m = _BLOCK.search("." + name)
    return f" (block {m.group(1)})" if m else ""


def check_weights_finite(model: nn.Module, *, max_listed: int = 5) -> None:
    """Raise :class:`NonFiniteWeightsError` naming every parameter with NaN/Inf values.

    >>> check_weights_finite(model)      # doctest: +SKIP
    NonFiniteWeightsError: model.layers.1.mlp.up_proj.weight (block 1) has 1 NaN value(s): ...
    """
    import torch

    from compressor.core.onload import named_tensors

    bad = []
    with torch.no_grad():
        for name, p in named_tensors(model, buffers=False):  # offloaded weights are read back one at a time
            if not p.is_floating_point() or p.device.type == "meta":
                continue
            finite = torch.isfinite(p)
            if bool(finite.all()):
                continue
            nan = int(torch.isnan(p).sum())
            inf = int((~finite).sum()) - nan
            what = " and ".join(s for s in (f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else "") if s)
            bad.append(f"{name}{_block_of(name)} has {what} value(s)")
    if bad:
        shown = "; ".join(bad[:max_listed]) + (f"; and {len(bad) - max_listed} more" if len(bad) > max_listed else "")
        raise NonFiniteWeightsError(
            f"{shown}: the checkpoint is corrupt (a healthy model has only finite weights). "
            "Re-download or re-export the model; nothing was written"
        )


def check_activations_finite(block_index: int, what: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise :class:`NonFiniteActivationError` if ``t`` (block ``block_index``'s
    ``what``, e.g. "FFN input") holds NaN/Inf; ``dtype`` is the model's compute dtype."""
    import torch

    if bool(torch.isfinite(t).all()):
        return
    nan = int(torch.isnan(t).sum())
    inf = int(t.numel() - torch.isfinite(t).sum()) - nan
    if dtype in (torch.float16, torch.bfloat16):
        cause = (
            f"most likely the activations overflowed {str(dtype).removeprefix('torch.')} "
            f"(largest finite value {torch.finfo(dtype).max:.3g}); compute in float32 instead: "
            "set model.dtype: float32 (the saved weights can still be smaller, see output.dtype)"
        )
    else:
        cause = (
            "the model's weights or inputs are not finite, or the model diverges at this block; "
            "check the checkpoint (compressor checks weights when it loads them) and try another calibration text"
        )
    raise NonFiniteActivationError(
        f"block {block_index}: {what} has {nan} NaN and {inf} Inf value(s) in {str(dtype).removeprefix('torch.')};"
        f" {cause}"
    )
