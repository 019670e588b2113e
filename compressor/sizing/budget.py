"""What a size resolves to for one model, in any format: the bytes allowed (:class:`Budget`) and the exact
bytes of a file from the bytes of its planned tensors (:class:`Layout`). How a format measures them is its own
(:meth:`compressor.sizing.target.SizeTarget.budget`: :mod:`compressor.output.gguf.budget` writes the F16 and
llama.cpp's preset; :mod:`compressor.output.ctensors.target` counts a checkpoint's bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compressor.recipe.schema import Size


def padded(nbytes: int, alignment: int) -> int:
    """``nbytes`` rounded up to the GGUF alignment (every tensor's data is padded to it)."""
    return -(-int(nbytes) // alignment) * alignment


@dataclass
class Layout:
    """What a GGUF of this model holds besides its planned (2-D) tensors' data."""

    data_offset: int
    """Bytes before the first tensor's data: header, metadata, tokenizer, tensor infos."""
    alignment: int
    fixed_bytes: int
    """Padded data bytes of the tensors that are not planned (1-D: norms, biases)."""
    planned: dict[str, int]
    """Planned tensor → its F16 bytes (as the F16 file stores it)."""
    file_bytes: int
    """The F16 file's size."""

    def file_bytes_of(self, tensor_bytes: dict[str, int]) -> int:
        """The exact size of the file whose planned tensors take ``tensor_bytes`` (name → bytes, unpadded;
        a planned tensor not named stays F16)."""
        data = sum(padded(tensor_bytes.get(n, b), self.alignment) for n, b in self.planned.items())
        return self.data_offset + self.fixed_bytes + data


@dataclass
class Budget:
    """``output.size`` resolved for this model."""

    size: Size
    limit: int
    """File bytes allowed."""
    layout: Layout
    preset: dict | None = None
    """llama.cpp's preset of that name, made from the same F16 (``name``, ``path``, ``file_bytes``)."""
    base: Path | None = None
    """The F16 a plan's file re-quantizes, when it is llama.cpp's converter's (a Hugging Face source); None: the
    GGUF source is re-quantized."""
    converted: Any = None
    """Where the converter put each weight's rows (:class:`~compressor.output.gguf.converter.ConverterLayout`)
    when it made :attr:`base`."""

    @property
    def kind(self) -> str:
        return self.size.kind

    @property
    def overhead(self) -> int:
        """Bytes of every file that are not planned tensor data (padding of the planned tensors aside)."""
        return self.layout.data_offset + self.layout.fixed_bytes

    def to_json(self) -> dict:
        return {"size": str(self.size), "budget_bytes": self.limit, "non_tensor_bytes": self.overhead,
                "f16_file_bytes": self.layout.file_bytes,
                "preset": None if self.preset is None else {k: v for k, v in self.preset.items() if k != "path"}}


def bpw_bytes(bpw: float, model, layout) -> int:
    """File bytes of a size in bits per weight: ``bpw`` over every weight ``model`` stores (a tied matrix
    once), plus the F16 ``layout``'s header."""
    weights = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return int(bpw * weights / 8) + layout.data_offset
