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
    """Bits per weight of the preset's file of Llama-3-8B (its size in ``llama-quantize --help``, or, where that
    line gives the main type's bits instead, in llama.cpp's ``tools/perplexity/README.md``; × 8 / 8.03e9 weights):
    where the search for the largest preset that fits a size starts (a small model's are higher: its embedding
    and output take more of it)."""
    requires_imatrix: bool = False
    """Whether llama.cpp's quantizer refuses to make the preset without an importance matrix: it holds tensors of
    IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S or IQ3_XXS (llama.cpp's ``tensor_requires_imatrix``; Q2_K in Q2_K_S), which
    it calls garbage unweighted."""


#: Every preset ``llama-quantize`` makes from IQ1_S to Q8_0 (its ``QUANT_OPTIONS``; not the ternary TQ1_0/TQ2_0,
#: made for BitNet's trained ternary weights, nor MXFP4_MOE, a mixture of experts' format), largest first, as
#: messages list them.
LLAMA_CPP_PRESETS: dict[str, Preset] = {
    "Q8_0": Preset("MOSTLY_Q8_0", 7.93),
    "Q6_K": Preset("MOSTLY_Q6_K", 6.12),
    "Q5_1": Preset("MOSTLY_Q5_1", 5.63),
    "Q5_K_M": Preset("MOSTLY_Q5_K_M", 5.31),
    "Q5_K_S": Preset("MOSTLY_Q5_K_S", 5.19),
    "Q5_0": Preset("MOSTLY_Q5_0", 5.19),
    "Q4_1": Preset("MOSTLY_Q4_1", 4.76),
    "Q4_K_M": Preset("MOSTLY_Q4_K_M", 4.56),
    "Q4_K_S": Preset("MOSTLY_Q4_K_S", 4.35),
    "IQ4_NL": Preset("MOSTLY_IQ4_NL", 4.33),
    "Q4_0": Preset("MOSTLY_Q4_0", 4.32),
    "IQ4_XS": Preset("MOSTLY_IQ4_XS", 4.12),
    "Q3_K_L": Preset("MOSTLY_Q3_K_L", 4.02),
    "Q3_K_M": Preset("MOSTLY_Q3_K_M", 3.73),
    "IQ3_M": Preset("MOSTLY_IQ3_M", 3.52),
    "IQ3_S": Preset("MOSTLY_IQ3_S", 3.41),
    "Q3_K_S": Preset("MOSTLY_Q3_K_S", 3.40),
    "IQ3_XS": Preset("MOSTLY_IQ3_XS", 3.27, requires_imatrix=True),
    "IQ3_XXS": Preset("MOSTLY_IQ3_XXS", 3.04, requires_imatrix=True),
    "Q2_K": Preset("MOSTLY_Q2_K", 2.95),
    "Q2_K_S": Preset("MOSTLY_Q2_K_S", 2.95, requires_imatrix=True),
    "IQ2_M": Preset("MOSTLY_IQ2_M", 2.73, requires_imatrix=True),
    "IQ2_S": Preset("MOSTLY_IQ2_S", 2.55, requires_imatrix=True),
    "IQ2_XS": Preset("MOSTLY_IQ2_XS", 2.42, requires_imatrix=True),
    "IQ2_XXS": Preset("MOSTLY_IQ2_XXS", 2.23, requires_imatrix=True),
    "IQ1_M": Preset("MOSTLY_IQ1_M", 2.00, requires_imatrix=True),
    "IQ1_S": Preset("MOSTLY_IQ1_S", 1.87, requires_imatrix=True),
}

#: Names ``llama-quantize`` also takes for a preset above (``Q4_K`` makes Q4_K_M).
PRESET_ALIASES: dict[str, str] = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}

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
