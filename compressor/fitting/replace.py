"""Replace: swap FFN blocks for their closed-form replacements, and back.

Names are resolved first, then the parent is found with ``get_submodule`` and
the child replaced with ``setattr`` (via ``set_submodule``); the replacement
takes the device and dtype of the module it replaces.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from compressor.core.archs import arch_for, find_blocks
from compressor.core.params import count_params  # noqa: F401  (re-exported: its old home)
from compressor.fitting.solve import AffineFit, LowRankFit


def ffn_path(model: nn.Module, index: int) -> str:
    """Dotted path of block ``index``'s FFN module (the thing that is swapped)."""
    model_type, spec = arch_for(model)
    if not spec.compressible:
        raise ValueError(
            f"{model_type} models are profile-only: their FFN ({spec.note}) is not one module, "
            "so `compress` cannot replace it. Use `compressor profile`."
        )
    path, blocks = find_blocks(model, spec)
    if not 0 <= index < len(blocks):
        raise ValueError(f"block {index} out of range: the model has {len(blocks)} blocks (0..{len(blocks) - 1})")
    return f"{path}.{index}.{spec.ffn_in}"


def build_module(fit: AffineFit | LowRankFit, like: nn.Module) -> nn.Module:
    """A replacement module holding an affine or reduced-rank ``fit``, on ``like``'s device and dtype."""
    from compressor.fitting.kinds import Fitted

    if isinstance(fit, LowRankFit):
        d_in, d_out = fit.A.shape[0], fit.B.shape[1]
        f = Fitted("low_rank", -1, {"in_features": d_in, "out_features": d_out, "rank": fit.rank},
                   {"down.weight": fit.A.T, "up.weight": fit.B.T, "up.bias": fit.b}, 0, float("nan"))
    else:
        f = Fitted("affine", -1, {"in_features": fit.d_in, "out_features": fit.d_out},
                   {"proj.weight": fit.W.T, "proj.bias": fit.b}, 0, float("nan"))
    return f.build(like)


@dataclass
class Swap:
    """A swapped block; ``undo()`` puts the original back."""

    model: nn.Module
    path: str
    original: nn.Module
    replacement: nn.Module

    def undo(self) -> None:
        self.model.set_submodule(self.path, self.original)


def swap(model: nn.Module, index: int, replacement: nn.Module) -> Swap:
    path = ffn_path(model, index)
    original = model.get_submodule(path)
    model.set_submodule(path, replacement)
    return Swap(model, path, original, replacement)
