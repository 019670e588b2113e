"""The named sizes a recipe may give, defined once: llama.cpp's quantization presets and compressed-tensors'
integer schemes.

The recipe's ``output.size`` takes their names; the GGUF writer hands llama.cpp's quantizer a preset's file type,
and the size budget starts its search for the largest preset that fits from their bits per weight; the
compressed-tensors grids are made from a scheme's bits and group. A new preset or scheme is a new row here.
"""

from __future__ import annotations

from typing import NamedTuple


class Preset(NamedTuple):
    file_type: str
    """gguf-py's ``LlamaFileType`` member that ``llama_model_quantize`` makes the preset from."""
    bpw: float
    """Bits per weight on Llama-3-8B (``llama-quantize --help``): where the search for the largest preset that fits
    a size starts (a small model's are higher: its embedding and output take more of it)."""


#: Largest first, as messages list them.
LLAMA_CPP_PRESETS: dict[str, Preset] = {
    "Q8_0": Preset("MOSTLY_Q8_0", 7.93),
    "Q6_K": Preset("MOSTLY_Q6_K", 6.12),
    "Q5_K_M": Preset("MOSTLY_Q5_K_M", 5.31),
    "Q5_K_S": Preset("MOSTLY_Q5_K_S", 5.19),
    "Q5_0": Preset("MOSTLY_Q5_0", 5.19),
    "Q4_K_M": Preset("MOSTLY_Q4_K_M", 4.56),
    "Q4_K_S": Preset("MOSTLY_Q4_K_S", 4.35),
    "Q4_0": Preset("MOSTLY_Q4_0", 4.32),
    "Q3_K_L": Preset("MOSTLY_Q3_K_L", 4.02),
    "Q3_K_M": Preset("MOSTLY_Q3_K_M", 3.73),
    "Q3_K_S": Preset("MOSTLY_Q3_K_S", 3.40),
    "Q2_K": Preset("MOSTLY_Q2_K", 2.95),
}

#: compressed-tensors integer schemes a recipe may name → (bits per code, inputs per scale; None: one scale per
#: output row). W4A16 and W8A16 are compressed-tensors' presets of those names; the others are group sizes vLLM's
#: W4A16/W8A16 kernels also take (:data:`compressor.output.ctensors.grids.SCHEMES` makes them grids).
CT_SCHEMES: dict[str, tuple[int, int | None]] = {
    "W4A16": (4, 128),
    "W4A16_G64": (4, 64),
    "W4A16_G32": (4, 32),
    "W4A16_CH": (4, None),
    "W8A16": (8, 128),
    "W8A16_CH": (8, None),
}
