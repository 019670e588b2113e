"""Every per-architecture fact, one row per Hugging Face ``model_type``: data, not code paths.

A row says where the list of transformer blocks is (the first path that exists
on the loaded model wins, so one row serves ``XModel`` and ``XForCausalLM``),
which sub-module's *input* is the FFN input (after the pre-FFN norm) and which
sub-module's *output* is the FFN output (before the residual add). When both
are the same module, that module is what :mod:`compressor.fitting.replace` swaps.
The same row says where the pre-FFN norm is, which config attribute holds the
FFN width (``hf-standard``), and whether and as which llama.cpp architecture the
``gguf`` writer writes the type (or why not).

Adding an architecture is adding a row to :data:`ARCHITECTURES` (every field is
documented on :class:`ArchSpec`) and a tiny model in the test matrix;
``tests/test_archs.py`` checks that every row is complete and consistent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from torch import nn

from compressor.core.errors import UnsupportedModelError

#: Why a model type with no llama.cpp facts (or no row) is not written as GGUF.
NO_GGUF = "no llama.cpp architecture for it is mapped here"


@dataclass(frozen=True)
class ArchSpec:
    blocks: tuple[str, ...]
    """Candidate dotted paths to the ``nn.ModuleList`` of blocks."""
    ffn_in: str = "mlp"
    """Module (relative to a block) whose first input is the FFN input."""
    ffn_out: str = "mlp"
    """Module (relative to a block) whose output is the FFN output."""
    compressible: bool = True
    """False for architectures we only profile (the FFN is not one module)."""
    ffn_up: tuple[str, ...] = ()
    """Projections (relative to the FFN module) that make its hidden units:
    ``(gate, up)`` for gated MLPs (``act(gate x) * up x``), ``(up,)`` for plain
    ones (``act(up x)``). Empty: hidden-unit kinds (prune, hybrid) unsupported."""
    ffn_down: str = ""
    """Projection (relative to the FFN module) whose input is the hidden units."""
    act_attrs: tuple[str, ...] = ("hidden_act",)
    """Config attributes naming the activation (first present wins)."""
    residual_direct: bool = True
    """True when the FFN output is added to the residual stream as is (no
    post-FFN norm): the residual teacher target is defined only then."""
    pre_ffn_norm: str | None = field(kw_only=True)
    """The pre-FFN norm module, relative to a block (cross-feeding hooks it and swaps it between blocks);
    None: there is none (a post-norm encoder). Required, so that None is a statement, not an omission."""
    width_attr: str = "intermediate_size"
    """Config attribute holding the FFN width (what ``hf-standard`` sets)."""
    gguf_arch: str | None = None
    """gguf-py ``MODEL_ARCH`` name whose tensor-name map names this type's weights in a GGUF: used by the
    ``gguf`` writer and by the size planner, which re-quantizes a GGUF source of any type that has one."""
    gguf_native: str | None = None
    """llama.cpp architecture the ``gguf`` writer writes when every layer has one FFN width. None: the
    type is not written as GGUF (:attr:`gguf_refusal` says why)."""
    gguf_native_ffn_bias: bool = False
    """Whether :attr:`gguf_native` loads FFN biases (a replaced block has them)."""
    gguf_per_layer: str | None = None
    """llama.cpp architecture written for per-layer FFN widths, or FFN biases :attr:`gguf_native` does not
    load (``deci``); set whenever :attr:`gguf_native` is."""
    gguf_refusal: str = NO_GGUF
    """Why the type is not written as GGUF, with what it lacks, when :attr:`gguf_native` is None."""
    int_refusal: str | None = None
    """Why the type's projections cannot take compressed-tensors integer schemes (None: they are ``nn.Linear``,
    which the library's schemes target)."""
    experts: tuple[str, str, str] | None = None
    """A mixture of experts' routed experts (:mod:`compressor.core.moe`): the checkpoint's names of an expert's
    gate, up and down projections (``{e}``: the expert) relative to a decoder layer, as the folder on disk (and
    llama.cpp's converter) names them. Such a type is planned to a GGUF size, each expert priced on the tokens
    routed to it; no block is replaced (:func:`moe_refusal` refuses structural runs before loading)."""

    @property
    def moe(self) -> bool:
        """Whether the type's FFNs are routed experts (:attr:`experts`)."""
        return self.experts is not None
    note: str = ""

    @property
    def causal_lm(self) -> bool:
        """Loaded with its language-model head (``AutoModelForCausalLM``); False: an encoder (``AutoModel``)."""
        return self.compressible or self.moe


_DECODER = ArchSpec(blocks=("model.layers", "layers"), ffn_up=("gate_proj", "up_proj"), ffn_down="down_proj",
                    pre_ffn_norm="post_attention_layernorm")
#: llama.cpp's ``llama`` loads optional FFN biases but builds every FFN at layer 0's width; ``deci``
#: (Nemotron-NAS) runs the same graph with per-layer widths (see :mod:`compressor.output.gguf`).
_LLAMA_CPP_LLAMA = dict(gguf_arch="LLAMA", gguf_native="llama", gguf_native_ffn_bias=True, gguf_per_layer="deci")
_BERT = ArchSpec(
    blocks=("bert.encoder.layer", "roberta.encoder.layer", "encoder.layer"),
    ffn_in="intermediate",
    ffn_out="output.dense",
    compressible=False,
    pre_ffn_norm=None,
    note="post-norm encoder: the FFN is split across `intermediate` and `output.dense`",
)

_MOE_NOTE = "routed experts: planned to a GGUF size, each expert on the tokens routed to it; no block is replaced"


def _moe(experts: tuple[str, str, str]) -> "ArchSpec":
    """A mixture-of-experts row: size plans only (``compressible`` False), its experts' names on disk."""
    return ArchSpec(blocks=("model.layers", "layers"), pre_ffn_norm="post_attention_layernorm", compressible=False,
                    experts=experts, gguf_refusal="its FFNs are routed experts, which no block replacement "
                    "describes; a GGUF size plan is written by llama.cpp's own converter", note=_MOE_NOTE)

ARCHITECTURES: dict[str, ArchSpec] = {
    "gpt2": ArchSpec(
        blocks=("transformer.h", "h"), ffn_up=("c_fc",), ffn_down="c_proj", act_attrs=("activation_function",),
        pre_ffn_norm="ln_2", width_attr="n_inner",
        gguf_refusal="its FFN is a plain GELU MLP (no gate); llama.cpp's gpt2 has one width for all layers",
        int_refusal="its projections are transformers' Conv1D, not nn.Linear, which compressed-tensors' schemes "
                    "target (llm-compressor refuses it likewise)",
    ),
    "gpt_neox": ArchSpec(
        blocks=("gpt_neox.layers", "layers"), ffn_up=("dense_h_to_4h",), ffn_down="dense_4h_to_h",
        pre_ffn_norm="post_attention_layernorm",
        gguf_refusal="its FFN is a plain GELU MLP (no gate); llama.cpp's gptneox has one width for all layers",
    ),
    "llama": replace(_DECODER, **_LLAMA_CPP_LLAMA),
    "mistral": replace(_DECODER, **_LLAMA_CPP_LLAMA),
    # llama.cpp's qwen2 loads no FFN bias (an extra tensor fails the load); deci takes its q/k rows permuted
    # from the NeoX RoPE layout to the normal one
    "qwen2": replace(_DECODER, gguf_arch="QWEN2", gguf_native="qwen2", gguf_native_ffn_bias=False,
                     gguf_per_layer="deci"),
    "qwen3": replace(
        _DECODER, gguf_arch="QWEN3",
        gguf_refusal="llama.cpp's qwen3 builds every FFN at layer 0's width with no FFN bias, and its only "
                     "per-layer-width Llama-like architecture (deci) has no q/k norm",
    ),
    "gemma3_text": ArchSpec(
        blocks=("model.layers", "layers"), ffn_up=("gate_proj", "up_proj"), ffn_down="down_proj",
        act_attrs=("hidden_activation", "hidden_act"), residual_direct=False,
        pre_ffn_norm="pre_feedforward_layernorm", gguf_arch="GEMMA3",
        gguf_refusal="llama.cpp's gemma3 builds every FFN at layer 0's width with no FFN bias, and its FFN is "
                     "GELU-gated with a post-FFN norm, which deci does not have",
        note="the FFN output passes a post-FFN RMSNorm before the residual add",
    ),
    # Phi-3: q/k/v and gate/up are each one fused projection (qkv_proj, gate_up_proj)
    "phi3": ArchSpec(
        blocks=("model.layers", "layers"), pre_ffn_norm="post_attention_layernorm", gguf_arch="PHI3",
        gguf_refusal="its gate and up projections are one fused matrix (gate_up_proj), which the structural gguf "
                     "writer does not split (a size plan is written by llama.cpp's own converter and takes it)",
        note="gate and up are one fused gate_up_proj: hidden-unit kinds (prune, hybrid) are not offered",
    ),
    # mixtures of experts: size plans only, one row each (the names of an expert's projections on disk)
    "qwen3_moe": _moe(("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")),
    "qwen2_moe": _moe(("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")),
    "mixtral": _moe(("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                     "block_sparse_moe.experts.{e}.w2")),
    "bert": _BERT,
    "roberta": replace(_BERT),
}

#: Model types that wrap another row's text model (Gemma 3's multimodal ``gemma3`` around ``gemma3_text``).
#: They are not loaded, profiled or compressed (no row of their own), but a GGUF of one holds the text
#: model's tensors under that row's ``gguf_arch``, so the size planner re-quantizes such a source.
TEXT_MODEL_OF: dict[str, str] = {"gemma3": "gemma3_text"}


# Configs that route tokens to experts: one affine map per block is the wrong
# model for them, and their `mlp` is a router plus a module list.
_MOE_CONFIG_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _is_moe(config) -> bool:
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        if any((getattr(cfg, key, None) or 0) > 1 for key in _MOE_CONFIG_KEYS):
            return True
        if "moe" in str(getattr(cfg, "model_type", "")):
            return True
    return False


#: A fix that works for a model compressor does not plan: llama.cpp's own tools.
LLAMA_CPP_TOOLS = (
    "make its GGUF with llama.cpp's own tools (convert_hf_to_gguf.py, then llama-imatrix and llama-quantize)"
)
#: What a user can do with a mixture-of-experts model of a family not mapped here.
MOE_FIX = f"{LLAMA_CPP_TOOLS}; compressor does not plan or compress it yet"


def moe_refusal(config, *, size: bool, fmt: str | None = None, plans_experts: bool = True,
                offload: str = "none") -> str | None:
    """Why a mixture-of-experts model is refused, for a size plan into ``fmt`` (``size``; ``plans_experts``:
    whether that format's file holds per-expert weights a runtime loads) or a structural run, with what to do
    instead; None for a dense model, and for a size of a family whose experts are planned (a row with ``moe``)
    held in memory, into a format that plans experts."""
    if config is None or not _is_moe(config):
        return None
    model_type = getattr(config, "model_type", "?")
    spec = ARCHITECTURES.get(model_type)
    planned = sorted(t for t, s in ARCHITECTURES.items() if s.moe)
    if not size:
        why = "one affine map per FFN block does not describe routed experts, so compressor replaces no block of it"
        fix = f"plan it to a GGUF size instead (output.size, e.g. Q4_K_M; {', '.join(planned)})"
        if spec is None or not spec.moe:
            fix = MOE_FIX
    elif spec is None or not spec.moe:
        why = (f"its routed experts are not mapped to per-expert linear layers here (done for {', '.join(planned)}), "
               "which a size plan prices one by one")
        fix = MOE_FIX
    elif not plans_experts:
        why = (f"its experts are planned into GGUF only, not {fmt}: plain transformers (5.x) holds a layer's experts "
               "as stacked parameters and does not load per-expert integer weights into them (checked with "
               "compressed-tensors 0.20: they are dropped as unexpected and the stacked experts left uninitialised; "
               "llm-compressor's issue #2699), so the folder would not load as the model it is")
        fix = "plan a GGUF (output.formats: [gguf], output.size: e.g. Q4_K_M)"
    elif offload != "none":
        why = f"its experts are planned with the model held in memory, and model.offload is {offload}"
        fix = "use model.offload: none"
    else:
        return None
    return f"model type {model_type!r} is a mixture-of-experts model: {why}; {fix}"


def arch_for(model: nn.Module, *, structural: bool = True) -> tuple[str, ArchSpec]:
    """Return ``(model_type, spec)`` for a loaded Hugging Face model, or raise. ``structural``: for a path that
    measures or replaces FFN blocks, which a mixture of experts is refused (a size plan passes False)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no `config.model_type`; pass a Hugging Face transformers model"
        )
    if _is_moe(config) and (structural or not (model_type in ARCHITECTURES and ARCHITECTURES[model_type].moe)):
        raise UnsupportedModelError(moe_refusal(config, size=not structural))
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported. Supported types: "
            f"{', '.join(sorted(ARCHITECTURES))}. To add one, add a row to "
            "ARCHITECTURES in compressor/core/archs.py (its fields are documented on ArchSpec) and a tiny "
            "model to the test matrix."
        )
    return model_type, ARCHITECTURES[model_type]


def find_blocks(model: nn.Module, spec: ArchSpec) -> tuple[str, nn.ModuleList]:
    """Resolve the block list; raise listing the paths tried."""
    for path in spec.blocks:
        try:
            blocks = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(blocks, nn.ModuleList):
            return path, blocks
    raise UnsupportedModelError(
        f"could not find the transformer blocks of {type(model).__name__}: tried {list(spec.blocks)}. "
        "Load the model with AutoModel/AutoModelForCausalLM, or fix its row in ARCHITECTURES in "
        "compressor/core/archs.py."
    )
