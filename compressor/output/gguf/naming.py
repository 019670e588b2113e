"""GGUF names and layouts: gguf-py's tensor-name maps, the RoPE row order, the FFN tensor names.

Every tensor the writer emits is a :class:`Tensor`: float32 values to be encoded, or a GGUF source's
raw bytes copied as they are. Names come from gguf-py's tensor-name map for the model type's
``gguf_arch`` (:data:`compressor.core.archs.ARCHITECTURES`); llama.cpp's ``llama`` and ``deci`` want
attn_q/attn_k rows in the "normal" RoPE layout, so a Hugging Face (NeoX-order) tensor written for them
is permuted (:func:`rope_permutation`), as llama.cpp's converter does for Llama. The bottom module of the
package: it imports none of the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from compressor.core.archs import ARCHITECTURES, TEXT_MODEL_OF

#: llama.cpp architecture → RoPE row layout of attn_q/attn_k: "norm" (pairs interleaved; Hugging Face
#: rows are permuted) or "neox" (Hugging Face order). Keyed by llama.cpp's architecture names, not by
#: model type: it describes llama.cpp (every ``gguf_native``/``gguf_per_layer`` of a row needs an entry).
ROPE_LAYOUT = {"llama": "norm", "deci": "norm", "qwen2": "neox"}
#: Model types whose GGUF source the size planner re-quantizes tensor by tensor (widths unchanged, the
#: source's own architecture and metadata) → gguf-py's tensor-name map for each: every row's ``gguf_arch``,
#: and the wrappers of a text model (:data:`~compressor.core.archs.TEXT_MODEL_OF`) under their text row's.
REQUANTIZE_ARCH: dict[str, str] = {
    **{t: spec.gguf_arch for t, spec in ARCHITECTURES.items() if spec.gguf_arch},
    **{t: ARCHITECTURES[text].gguf_arch for t, text in TEXT_MODEL_OF.items() if ARCHITECTURES[text].gguf_arch},
}
_FFN_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(weight|bias)$")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("the gguf format needs gguf-py: pip install 'compressor[gguf]'") from None
    return gguf


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def _tensor_types(reader) -> dict:
    return {t.name: t.tensor_type for t in reader.tensors}


def rope_permutation(n_rows: int, n_head: int) -> np.ndarray:
    """Row order taking attn_q/attn_k from the NeoX (Hugging Face) RoPE layout to the normal one:
    within each head, the first and second halves interleave."""
    half = n_rows // n_head // 2
    return np.arange(n_rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(-1)


@dataclass
class Tensor:
    """One tensor of the file: float32 values to encode, or raw bytes ``[rows, row_bytes]`` of ``raw_type``.
    ``data`` may be left None with ``load`` and ``shape`` given: the values are then read only when the
    tensor is written (:func:`~compressor.output.gguf.write.write_gguf` streams), so a model that lives on
    disk is never held whole."""

    name: str
    data: np.ndarray | None
    raw_type: object = None
    load: Callable[[], np.ndarray] | None = None
    shape: tuple[int, ...] | None = None

    @property
    def dims(self) -> tuple[int, ...]:
        """The values' shape, known before they are read."""
        return tuple(self.data.shape) if self.data is not None else tuple(self.shape)

    def values(self) -> np.ndarray:
        return self.data if self.data is not None else self.load()


def _permute_qk(name: str, data: np.ndarray, config) -> np.ndarray:
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    heads = n_head if ".attn_q." in name else n_kv
    return data[rope_permutation(data.shape[0], heads)]


def _needs_permute(name: str, from_layout: str, to_layout: str) -> bool:
    return from_layout != to_layout and (".attn_q." in name or ".attn_k." in name)


def to_file_rows(name: str, rows: np.ndarray, arch: str, config) -> np.ndarray:
    """Rows of a Hugging Face weight (values, or raw bytes: rows are quantized independently) in the order a
    GGUF of llama.cpp architecture ``arch`` stores tensor ``name``: attn_q/attn_k permuted for a "norm" RoPE
    layout, everything else as it is."""
    return _permute_qk(name, rows, config) if _needs_permute(name, "neox", ROPE_LAYOUT.get(arch, "neox")) else rows


def _sort_key(name: str):
    """Embeddings and RoPE factors first, then block by block, then the rest (llama.cpp's converter order)."""
    m = re.match(r"blk\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0, 0, name) if name.startswith(("token_embd", "rope")) else (2, 0, name)
