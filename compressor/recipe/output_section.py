"""The recipe's ``output`` section, and ``output.size`` parsed once, when the recipe loads
(:class:`Size`, :attr:`OutputConfig.planned`)."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

from pydantic import Field, PrivateAttr, field_validator, model_validator

from compressor.core.presets import CT_SCHEMES, LLAMA_CPP_PRESETS, PRESET_ALIASES

from compressor.recipe.sections import _Section


class OutputConfig(_Section):
    path: str | None = Field(None, description="output folder (required for run; --output overrides)")
    overwrite: bool = Field(False, description="replace an earlier compressor output in that folder")
    dtype: Literal["source", "float32", "bfloat16", "float16"] = Field(
        "source", description="dtype of the saved weights; source = the source checkpoint's dtype (bfloat16 for GGUF)"
    )
    architecture: Literal["custom", "standard"] = Field(
        "custom", description="custom: per-block FFN widths and kinds, saved as compressor classes (loads with "
        "compressor installed or trust_remote_code); standard: one FFN width for every block (a multiple of 64, "
        "searched against the gate), saved as the base model's own class with a smaller intermediate_size, which "
        "loads with plain transformers, vLLM, TGI, MLX (kind prune only; see docs/standard.md)")
    width_multiple: int | None = Field(
        None, ge=1, le=4096, description="kept FFN widths of the prune/hybrid kinds come in multiples of this, "
        "chosen by the allocation (not rounded afterwards); null: automatic, see compressor.recipe.width_multiple "
        "(1; 64 for architecture standard; the GGML quantization block, 32 or 256, with the gguf format)")
    formats: list[str] = Field(
        default_factory=lambda: ["hf"], min_length=1,
        description="output formats written into the output folder, each verified before publishing: hf "
        "(Hugging Face folder), gguf (one .gguf for llama.cpp/Ollama, checked in llama.cpp), compressed-tensors "
        "(int4/int8 weights loaded by plain transformers with the compressed-tensors package and served by vLLM; "
        "docs/compressed-tensors.md); not set: [hf, gguf] for a GGUF source whose architecture the gguf writer "
        "takes, else [hf] (with output.size: the format the size names)",
    )
    _defaulted: bool = PrivateAttr(False)
    _planned: "Size | None" = PrivateAttr(None)
    """True when ``formats`` was filled in by the pipeline (not named by the recipe)."""
    gguf_quant: Literal["source", "bf16", "f16", "q8_0", "q4_k_m"] = Field(
        "source", description="gguf format: tensor types; source = a GGUF source's own (unchanged tensors copied as "
        "they are), else output.dtype; q8_0/q4_k_m use llama.cpp's quantizer (see docs/gguf.md)"
    )
    size: str | None = Field(
        None,
        description=(
            "gguf or compressed-tensors format: the file's size, met from below with the least predicted loss by"
            " choosing every weight's GGML type or integer scheme (docs/size.md, docs/compressed-tensors.md): bytes"
            " (750MB, 1.2GB, 123456789), bits per weight (4.5bpw), a llama.cpp preset's name (Q4_K_M, IQ4_XS, Q3_K_M,"
            " IQ3_XXS, Q2_K, IQ2_M, IQ1_M, …: every preset llama-quantize makes from IQ1_S to Q8_0; that preset's size"
            " for this model, made from the same F16 and measured beside the output), a compressed-tensors scheme"
            " (W4A16, W8A16, W4A16_G32: that uniform checkpoint's size, measured beside it), or smallest (the smallest"
            " file within policy.ppl_budget); null: the source's own types (gguf_quant)"
        ),
    )
    rounding: Literal["gptq", "nearest"] = Field(
        "gptq", description="output.size: how each planned tensor's codes are rounded onto the scales ggml's "
        "quantizer finds — gptq: error-compensating rounding through the layer's input second moment (GPTQ, "
        "bit-compatible with llama.cpp) offered beside ggml's own, each priced with what it gets; nearest: "
        "ggml's own rounding only (what llama-quantize does with an importance matrix)")
    size_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description=(
            "output.size: how the calibration passes that price every weight (the input second moments Ĥ and the loss"
            " gradients F) multiply a float32 model — bfloat16: under a bfloat16 autocast, each XᵀX the float32 product"
            " of the bfloat16 activations, every sum in float32 (Ĥ within 0.15 % where checked, the statistics in 40 %"
            " of the time where the hardware has it, the file's score within noise: docs/size.md); float32: in float32;"
            " auto: bfloat16 where the device multiplies it natively (a GPU that supports it, a CPU with AVX512-BF16 or"
            " AMX), else float32"
        ),
    )
    ct_head: Literal["plan", "keep"] = Field(
        "plan",
        description=(
            "compressed-tensors format with output.size: plan — an output head with a weight of its own (not tied to"
            " the input embedding) is a unit of the size plan like any linear layer (transformers loads it; vLLM since"
            " its PR #37291); keep — it stays in the saved dtype, as llm-compressor leaves it, for a runtime that"
            " cannot read a quantized lm_head. A tied head always stays with the embedding"
        ),
    )
    workdir: str | None = Field(
        None,
        description=(
            "output.size: the folder a size run's work folder goes in — the model's F16, llama.cpp's preset made from"
            " it and the plans tried (Llama-3.1-8B at Q4_K_M: about 16 + 4.6 + 4.6 GB), removed when the run ends; an"
            " existing folder, e.g. a scratch disk with room (the run checks the space before it writes the F16,"
            " docs/size.md#disk-space-and-interruptions); null: beside the output folder, on its disk"
        ),
    )
    gguf_unquantizable: Literal["error", "f16", "pad"] = Field(
        "error", description="gguf format: an FFN width the quantization block does not divide is an error, keeps "
        "its down projection in F16, or is padded with dead units"
    )

    @field_validator("size", mode="before")
    @classmethod
    def _size_text(cls, value):
        """A byte count written as a number (``size: 123456789``, ``--set output.size=3582592``) is that many
        bytes, kept as text; an empty size (an unset shell variable in ``--set output.size=$SIZE``) is an
        error, not "no size": null (or no key) is how a recipe says it plans none."""
        if isinstance(value, bool):
            raise ValueError(f"{value} is not a size; give {SIZE_FORMS}")
        if isinstance(value, (int, float)):
            if not (math.isfinite(value) and float(value).is_integer()):
                raise ValueError(f"{value!r} is not a whole number of bytes; give {SIZE_FORMS}")
            if value <= 0:
                raise ValueError(f"{int(value)} bytes: a size must be positive; give {SIZE_FORMS}")
            return str(int(value))
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"empty; give {SIZE_FORMS}. To plan no size, remove the output.size key (or set "
                             "it to null); an empty value is often an unset shell variable (--set output.size=$SIZE)")
        return value

    @property
    def planned(self) -> Size | None:
        """``size`` parsed (once: when the recipe is validated, again only if the text was changed since)."""
        if self.size is None:
            return None
        if self._planned is None or self._planned.text != str(self.size).strip():
            self._planned = Size.of(self.size)
        return self._planned

    @model_validator(mode="after")
    def _size_rule(self):
        if self.size is None and "rounding" in self.model_fields_set and self.rounding != "gptq":
            raise ValueError(f"output.rounding: {self.rounding!r} is read only with output.size (it says how a "
                             "size plan rounds); remove it, or give output.size")
        if self.size is None and "size_precision" in self.model_fields_set and self.size_precision != "auto":
            raise ValueError(f"output.size_precision: {self.size_precision} is read only with output.size (it says "
                             "how a size plan's calibration passes multiply); remove it, or give output.size")
        if self.size is None and self.workdir is not None:
            raise ValueError(f"output.workdir: {self.workdir} is read only with output.size (it says where a size "
                             "run keeps the model's F16 and preset); remove it, or give output.size")
        if self.workdir is not None and not self.workdir.strip():
            raise ValueError("output.workdir: empty; give an existing folder (e.g. /scratch), or null for the "
                             "output folder's own disk")
        if self.size is None and "ct_head" in self.model_fields_set and self.ct_head != "plan":
            raise ValueError(f"output.ct_head: {self.ct_head} is read only with output.size (it says whether a "
                             "compressed-tensors size plan may quantize the output head); remove it, or give "
                             "output.size")
        if self.size is not None:
            self._planned = Size.of(self.size)
            if self.gguf_quant != "source":
                raise ValueError(f"output.size plans every tensor's type itself; remove output.gguf_quant: "
                                 f"{self.gguf_quant} (or output.size)")
        return self

    @model_validator(mode="after")
    def _width_rule(self):
        if "hf-standard" in self.formats and self.architecture != "standard":
            raise ValueError("output.formats: hf-standard is the folder output.architecture: standard writes; "
                             "set output.architecture: standard (and list hf)")
        m = self.width_multiple
        if m is not None and self.architecture == "standard" and m % STANDARD_WIDTH_MULTIPLE:
            raise ValueError(f"output.width_multiple: {m} with output.architecture: standard must be a multiple of "
                             f"{STANDARD_WIDTH_MULTIPLE}; use e.g. {math.lcm(m, STANDARD_WIDTH_MULTIPLE)} or leave it "
                             "null (automatic)")
        return self

    def writers(self) -> list[str]:
        """The writers (``compressor.output`` format names) this section asks for, in order: ``formats``
        with ``hf`` written by ``hf-standard`` when ``architecture`` is ``standard``."""
        names = ["hf-standard" if f == "hf" and self.architecture == "standard" else f for f in self.formats]
        return list(dict.fromkeys(names))


#: llama.cpp presets ``output.size`` may name (their size for the model at hand is the budget), largest first;
#: llama-quantize's aliases (Q4_K for Q4_K_M) are read as the preset they name.
SIZE_PRESETS = tuple(LLAMA_CPP_PRESETS)
#: compressed-tensors schemes ``output.size`` may name (that uniform checkpoint's size for the model at hand).
CT_SIZE_SCHEMES = tuple(CT_SCHEMES)
#: What ``output.size`` takes, in words (every message that refuses a size names them).
SIZE_FORMS = (f"bytes (750MB, 1.2GB, 123456789), bits per weight (4.5bpw), a llama.cpp preset "
              f"({', '.join(SIZE_PRESETS)}; {', '.join(f'{a} for {p}' for a, p in PRESET_ALIASES.items())}), "
              f"a compressed-tensors scheme ({', '.join(CT_SIZE_SCHEMES)}) or smallest "
              "(the smallest file within policy.ppl_budget)")
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class Size(NamedTuple):
    """``output.size``, parsed once (:attr:`OutputConfig.planned`): the text the recipe gave, its kind (``bytes``,
    ``bpw``, ``preset``, ``smallest``) and value (bytes, bits per weight, the preset's name, None). Reads as its
    text in messages."""

    text: str
    kind: str
    value: float | str | None

    @classmethod
    def of(cls, text: str) -> "Size":
        return cls(str(text).strip(), *parse_size(text))

    def __str__(self) -> str:
        return self.text


def parse_size(text: str) -> tuple[str, float | str]:
    """``output.size`` → ("bytes", n) | ("bpw", bits) | ("preset", name) | ("smallest", None); ValueError
    naming the forms. Parsed when the recipe loads; the run reads :attr:`OutputConfig.planned`.

    >>> parse_size("750MB"), parse_size("4.5bpw"), parse_size("q3_k_m"), parse_size("IQ2_XXS"), parse_size("Q4_K")
    (('bytes', 750000000), ('bpw', 4.5), ('preset', 'Q3_K_M'), ('preset', 'IQ2_XXS'), ('preset', 'Q4_K_M'))
    """
    import re

    t = str(text).strip()
    if t.lower() == "smallest":
        return "smallest", None
    if t.upper() in SIZE_PRESETS or t.upper() in CT_SIZE_SCHEMES:
        return "preset", t.upper()
    if t.upper() in PRESET_ALIASES:
        return "preset", PRESET_ALIASES[t.upper()]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*bpw", t, flags=re.I)
    if m:
        bits = float(m.group(1))
        if not 1.5 <= bits <= 16:
            raise ValueError(f"output.size: {t}: bits per weight must be between 1.5 and 16")
        return "bpw", bits
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([KMG]i?B|B)?", t, flags=re.I)
    if m:
        n = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "B").upper()])
        if n <= 0:
            raise ValueError(f"output.size: {t} must be positive")
        return "bytes", n
    raise ValueError(f"output.size: {t!r} is not a size: give {SIZE_FORMS}")


#: Multiple of the one FFN width of ``output.architecture: standard``: serving kernels (vLLM, llama.cpp,
#: MLX) tile the intermediate dimension in 64s or more, and 64 is a whole number of q8_0/q4 blocks.
STANDARD_WIDTH_MULTIPLE = 64
#: Elements per GGML quantization block, by ``output.gguf_quant``: a quantized row is a whole number of
#: blocks, and the down projection's rows are as long as the FFN width (gguf-py's GGML_QUANT_SIZES).
GGML_BLOCK = {"source": 1, "f32": 1, "f16": 1, "bf16": 1, "q8_0": 32, "q4_0": 32, "q4_1": 32, "q5_0": 32,
              "q5_1": 32, "q2_k": 256, "q3_k_m": 256, "q4_k_s": 256, "q4_k_m": 256, "q5_k_m": 256, "q6_k": 256}


def width_multiple(output: OutputConfig, block: int = 1) -> int:
    """The multiple every kept FFN width of the prune/hybrid kinds must be; the allocation offers
    only those widths (:mod:`compressor.policy.compress`), so no width is rounded afterwards.

    ``output.width_multiple`` when set; else the least common multiple of :data:`STANDARD_WIDTH_MULTIPLE`
    for ``architecture: standard`` and ``block``: what the output formats need to store every kept width
    (each writer says its own, :meth:`~compressor.output.base.Writer.width_block`: a GGUF's quantization
    block), which the caller reads before the model loads.

    >>> width_multiple(OutputConfig())
    1
    >>> width_multiple(OutputConfig(), block=256)
    256
    >>> width_multiple(OutputConfig(architecture="standard"), block=32)
    64
    """
    if output.width_multiple is not None:
        return output.width_multiple
    return math.lcm(STANDARD_WIDTH_MULTIPLE if output.architecture == "standard" else 1, block)
