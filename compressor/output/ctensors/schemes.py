"""Which layer of a compressed-tensors checkpoint gets which scheme, and what the checkpoint's tensors take.

The per-tensor plan the writer writes (:class:`SchemePlan`): a scheme per ``nn.Linear`` (the writer's options,
``ct_scheme`` / ``ct_schemes``, or a size's plan), vLLM's fused siblings (``qkv_proj``, ``gate_up_proj``)
one scheme each (:func:`fused_units`), the library's ``QuantizationConfig`` for them, and their exact bytes.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from compressor.output.ctensors.grids import SCHEMES, IntScheme, Rounded, get_scheme, weight_bytes

logger = logging.getLogger(__name__)

CTENSORS_FORMAT = "compressor.ctensors/v1"
#: What a compressed-tensors checkpoint's ``quantization_config`` names as its ``quant_method``.
QUANT_METHOD = "compressed-tensors"
#: How the library stores every layer written here.
PACK_FORMAT = "pack-quantized"
#: What a user runs to get the library.
INSTALL = "pip install 'compressor[compressed-tensors]'"
DEFAULT_SCHEME = "W4A16"
#: Sibling projections vLLM fuses into one layer (its ``packed_modules_mapping``: ``qkv_proj``,
#: ``gate_up_proj``); it refuses a fused layer whose parts carry different schemes.
FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
#: GPTQ as llm-compressor's ``GPTQModifier`` runs it by default (``actorder: static``): columns in descending
#: diag Ĥ, every group's scale from the original weights first, so the file needs no ``g_idx``.
GPTQ_ORDER = {"act_order": True, "static_groups": True}
#: ``replacement.kind`` values whose model is its base class (after :func:`standard_model` for prune).
_PLAIN_KINDS = ("prune", "none")


def library_missing() -> str | None:
    """Why the compressed-tensors package cannot be used (None when it can)."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as e:
        return (f"the compressed-tensors format is written and read by the compressed-tensors package, which is not "
                f"importable ({e}): {INSTALL}")
    return None


def _require_library() -> None:
    if (why := library_missing()) is not None:
        raise ValueError(why)


# --------------------------------------------------------------------------------------------------
# Which layer gets which scheme
# --------------------------------------------------------------------------------------------------


def _embedding_names(model: nn.Module) -> set[str]:
    """Module names of the input and output embeddings."""
    ids = {id(m) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return {name for name, m in model.named_modules() if id(m) in ids}


def head_name(model: nn.Module) -> str | None:
    """The output head's module name when a scheme may be given to it: an ``nn.Linear`` whose weight is its
    own (a head tied to the input embedding stays in the saved dtype with it); else None."""
    from compressor.core.params import tied_head

    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or tied_head(model):
        return None
    return next(name for name, m in model.named_modules() if m is head)


def linear_names(model: nn.Module, head: bool = True) -> list[str]:
    """Every ``nn.Linear`` a scheme may be given to: all of them but a tied output head (and, with ``head``
    False, any output head)."""
    keep = head_name(model) if head else None
    skip = _embedding_names(model) - {keep}
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in skip]


def layer_schemes(model: nn.Module, options: dict) -> dict[str, IntScheme | None]:
    """Every candidate linear (:func:`linear_names`) → its scheme (None: unquantized), from ``options``
    (module docstring); ``ValueError`` for an unknown layer or scheme, a group that does not divide a row,
    a fused set (:data:`FUSED_SIBLINGS`) split between schemes, or nothing to quantize."""
    names = linear_names(model)
    mapping = options.get("ct_schemes")
    if mapping is not None:
        unknown = sorted(set(mapping) - set(names))
        if unknown:
            raise ValueError(f"ct_schemes names {len(unknown)} module(s) that are not quantizable nn.Linear layers of "
                             f"{type(model).__name__} ({', '.join(unknown[:5])}); the layers are: "
                             f"{', '.join(names[:8])}{', …' if len(names) > 8 else ''} (embeddings and a tied output "
                             "head stay in the float dtype)")
        schemes = {n: get_scheme(mapping.get(n)) for n in names}
    else:
        uniform = get_scheme(options.get("ct_scheme", DEFAULT_SCHEME))
        head = head_name(model)  # llm-compressor's ignore=["lm_head"]: the uniform scheme leaves it out
        schemes = {n: None if n == head else uniform for n in names}
    for name, s in schemes.items():
        cols = model.get_submodule(name).in_features
        if s is not None and not s.fits(cols):
            fitting = [k for k, v in SCHEMES.items() if v.fits(cols)]
            raise ValueError(f"{name} has {cols} inputs, which groups of {s.group_size} ({s.name}) do not divide; "
                             f"give it a scheme whose group divides {cols} in ct_schemes "
                             f"({', '.join(fitting) or 'none of ' + ', '.join(SCHEMES) + ' does'}), or leave it "
                             "unquantized (None)")
    _check_fused(schemes)
    if not any(schemes.values()):
        raise ValueError(f"no nn.Linear layer of {type(model).__name__} is given a scheme: nothing to quantize "
                         "(compressed-tensors quantizes nn.Linear layers, not e.g. GPT-2's Conv1D; write hf or "
                         "hf-standard for a float checkpoint)")
    return schemes


def _check_fused(schemes: dict[str, IntScheme | None]) -> None:
    for parts in FUSED_SIBLINGS:
        sets: dict[str, dict[str, IntScheme | None]] = {}
        for name, s in schemes.items():
            parent, _, leaf = name.rpartition(".")
            if leaf in parts:
                sets.setdefault(parent, {})[leaf] = s
        for parent, found in sets.items():
            if len({s.name if s else None for s in found.values()}) > 1:
                got = ", ".join(f"{leaf}: {s.name if s else None}" for leaf, s in sorted(found.items()))
                raise ValueError(f"{parent}: vLLM fuses {' + '.join(parts)} into one layer, which takes one scheme; "
                                 f"got {got}. Give them the same scheme in ct_schemes")


#: Joins the module names of a fused unit (``model.layers.0.self_attn.q_proj+k_proj+v_proj``): the layers vLLM
#: fuses take one scheme, so a size plan chooses one for them together.
JOIN = "+"


def fused_units(names) -> dict[str, list[str]]:
    """Module names (in order) → units: the fused siblings (:data:`FUSED_SIBLINGS`) of one parent joined
    (:data:`JOIN`), every other layer alone."""
    names = list(names)
    present = set(names)
    fused = {leaf: parts for parts in FUSED_SIBLINGS for leaf in parts}
    out: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        parts = fused.get(leaf)
        if parts is None:
            out[name] = [name]
            continue
        found = [p for p in parts if f"{parent}.{p}" in present]
        out.setdefault(f"{parent}.{found[0]}" + "".join(f"{JOIN}{p}" for p in found[1:]), []).append(name)
    return out


def unit_members(unit: str) -> list[str]:
    """The module names of a unit (:func:`fused_units`)."""
    first, *rest = unit.split(JOIN)
    parent = first.rpartition(".")[0]
    return [first] + [f"{parent}.{leaf}" for leaf in rest]


@dataclass
class SchemePlan:
    """What the writer writes, layer by layer: the writer's own options (``schemes`` None: ``ct_scheme`` /
    ``ct_schemes``, ``ct_hessians``), or a size's plan (:meth:`~.target.CompressedTensorsTarget.file_plan`: a
    scheme per layer and the layers the size stage already rounded by GPTQ). Per-run state lives here too: the
    codes write made, for verify (:attr:`codes`), not in a module's globals."""

    schemes: dict[str, str | None] | None = None
    """Module → scheme name (None: unquantized); None: from the writer's options."""
    rounded: dict[str, Rounded] = field(default_factory=dict)
    """Layers already rounded (codes and scales, no float weight): the size stage's GPTQ over all rows."""
    hessians: dict | None = None
    """Module → Ĥ: those layers are rounded by GPTQ (``ct_hessians``), the others to nearest."""
    measured: bool = False
    """Scored on the gate's domains where it runs (a size's plan: the size stage judges it)."""
    codes: tuple | None = field(default=None, repr=False)
    """``(what was rounded, {name: Rounded without its float weight})``: what write rounded, for verify."""

    def options(self, options: dict) -> dict:
        """The writer's options with this plan's schemes (``ct_schemes``) in them."""
        return options if self.schemes is None else {**options, "ct_schemes": self.schemes}

    def gptq_layers(self) -> set[str]:
        """The layers rounded by GPTQ: given an Ĥ, or rounded so by the size stage."""
        return set(self.hessians or {}) | set(self.rounded)


def quantization_config(schemes: dict[str, IntScheme | None], ignore_extra: list[str] = ()):
    """The library's ``QuantizationConfig`` for ``schemes``: one group targeting ``Linear`` when every
    quantized layer has one scheme (llm-compressor's layout), one group per scheme naming its layers
    otherwise; the unquantized linears (and ``ignore_extra``, a tied output head) in ``ignore``. Status
    ``frozen``: the compressor sets ``compressed`` once it has packed the weights."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    used = sorted({s for s in schemes.values() if s is not None}, key=lambda s: s.name)
    if len(used) == 1:
        groups = {"group_0": used[0].to_scheme(["Linear"], format=PACK_FORMAT)}
    else:
        groups = {f"group_{i}": s.to_scheme(sorted(n for n, t in schemes.items() if t == s), format=PACK_FORMAT)
                  for i, s in enumerate(used)}
    ignore = sorted(ignore_extra) + sorted(n for n, s in schemes.items() if s is None)
    return QuantizationConfig(config_groups=groups, format=PACK_FORMAT, ignore=ignore,
                              quantization_status=QuantizationStatus.FROZEN)


def model_quantization_config(model: nn.Module, schemes: dict[str, IntScheme | None]):
    """:func:`quantization_config` of ``model``'s ``schemes``, a tied output head (a linear that is an embedding and
    has no scheme) ignored with the embedding."""
    return quantization_config(schemes, sorted((_embedding_names(model) - set(schemes)) & {
        n for n, m in model.named_modules() if isinstance(m, nn.Linear)}))


def scheme_counts(schemes: dict[str, IntScheme | None]) -> dict[str, int]:
    """Layers per scheme name (``unquantized`` for None)."""
    return dict(sorted(Counter(s.name if s else "unquantized" for s in schemes.values()).items()))


def linear_bytes(model: nn.Module, schemes: dict[str, IntScheme | None], dtype: torch.dtype) -> int:
    """Bytes of the tensors stored for the weights of the layers in ``schemes`` (:meth:`IntScheme.nbytes`;
    unquantized ones in ``dtype``)."""
    return sum(weight_bytes(s, *model.get_submodule(n).weight.shape, dtype) for n, s in schemes.items())


def tensor_bytes(model: nn.Module, schemes: dict[str, IntScheme | None], dtype: torch.dtype) -> int:
    """Bytes of every tensor the folder's safetensors hold (their JSON header aside): :func:`linear_bytes`
    plus every other tensor of ``model``'s state dict (biases, norms, embeddings, the output head) in
    ``dtype``, a tied tensor once."""
    total, seen = linear_bytes(model, schemes, dtype), set()
    size = torch.empty((), dtype=dtype).element_size()
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        # a meta placeholder (an onloaded layer's) has no storage to tell ties by: its name is its own
        key = (name,) if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.storage_offset(),
                                                       tuple(t.shape))
        if (leaf == "weight" and module in schemes) or key in seen:
            continue
        seen.add(key)
        total += t.numel() * (size if t.is_floating_point() else t.element_size())
    return total


def head_scheme(model: nn.Module, schemes: dict[str, IntScheme | None]) -> str:
    """The output head's scheme in words: its scheme's name when quantized, else how it is kept."""
    name = head_name(model)
    if name is not None and schemes.get(name) is not None:
        return schemes[name].name
    return "unquantized (tied to the embedding)" if name is None else "unquantized"
