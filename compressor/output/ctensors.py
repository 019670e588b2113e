"""The ``compressed-tensors`` writer: integer weights in the format llm-compressor writes and vLLM serves.

The folder is what ``oneshot(model, recipe=GPTQModifier(scheme="W4A16", targets="Linear",
ignore=["lm_head"]))`` followed by ``save_pretrained`` gives: the base model's own class, every
quantized ``nn.Linear`` stored ``pack-quantized`` (codes packed into int32 ``weight_packed``, a
``weight_scale`` per group in the saved dtype, ``weight_shape``), every other tensor in the saved dtype,
and ``quantization_config`` in ``config.json``. ``AutoModelForCausalLM.from_pretrained(folder)`` loads it
with no flag wherever the ``compressed-tensors`` package is installed; vLLM serves it as it is.

What each layer gets (``request.options``):

* ``ct_schemes``: module name → scheme name (:data:`~compressor.fitting.intround.SCHEMES`) or None
  (left in the float dtype); a layer not named is left in the float dtype. Else
* ``ct_scheme`` (default ``W4A16``) for every ``nn.Linear`` but the output head; embeddings never.

An output head with a weight of its own (not tied to the input embedding) may be given a scheme in ``ct_schemes``
(a size plan does so, ``output.ct_head: plan``): vLLM reads a quantized ``lm_head`` since its PR #37291; the uniform
``ct_scheme`` leaves it in the float dtype, as llm-compressor's ``ignore=["lm_head"]`` does.
* ``ct_hessians``: module name → that layer's input second moment Ĥ ``[in, in]``: the layer is rounded by
  GPTQ (:func:`~compressor.fitting.intround.gptq`), a layer without one to nearest.

The packing, the config groups and ``quantization_config`` are the library's own
(``apply_quantization_config``, ``ModelCompressor.compress_model`` and ``update_config``, the calls
llm-compressor's save wrapper makes); this module only hands it the scales and the rounded weights, whose
codes the compressor recovers exactly. The model in memory is left as it was: the writer works on a copy
that shares every tensor it does not replace.

A pruned model (``replacement.kind: prune``) is saved as its base class at the pruned width first, as
``hf-standard`` does (:func:`compressor.output.standard.standard_model`); other kinds have no place in a
plain transformers class and are refused.

Verification reloads the folder with plain ``AutoModelForCausalLM.from_pretrained`` (the library
decompresses it) and compares its logits with the in-memory model whose quantized weights are replaced by
the values the file decodes to, to float tolerance; the reloaded model's perplexity on the probe is
recorded with the change quantizing made (judged, if at all, by the stage that chose the schemes).
"""

from __future__ import annotations

import copy
import gc
import itertools
import json
import logging
import time
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.core.onload import is_offloaded
from compressor.core.progress import progress
from compressor.fitting.intround import SCHEMES, IntScheme, Rounded, get_scheme, gptq, rtn, weight_bytes
from compressor.output.base import VerificationError, WriteRequest, Writer, register_writer
from compressor.output.hf import (
    cast_state_dict, computes_on_gpu, finish_folder, folder_weight_bytes, logit_tolerance, rounded_copy,
)

logger = logging.getLogger(__name__)

CTENSORS_FORMAT = "compressor.ctensors/v1"
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


def _options(request: WriteRequest) -> dict:
    """The writer's options; with a size plan (:attr:`WriteRequest.size_plan`, a scheme per unit), its schemes
    per layer as ``ct_schemes``."""
    plan = request.size_plan
    if plan is None:
        return request.options
    return {**request.options, "ct_schemes": {m: s for u, s in plan.types.items() for m in unit_members(u)}}


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
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if (leaf == "weight" and module in schemes) or key in seen:
            continue
        seen.add(key)
        total += t.numel() * (size if t.is_floating_point() else t.element_size())
    return total


# --------------------------------------------------------------------------------------------------
# Rounding (once per request: write and verify are asked of two writer instances)
# --------------------------------------------------------------------------------------------------


def round_layers(model: nn.Module, schemes: dict[str, IntScheme | None], hessians: dict | None,
                 scale_dtype: torch.dtype) -> dict[str, Rounded]:
    """Every quantized layer's weight rounded onto its scheme: GPTQ where ``hessians`` has the layer's Ĥ,
    to nearest elsewhere; scales in ``scale_dtype``."""
    hessians = dict(hessians or {})
    unknown = sorted(set(hessians) - set(schemes))
    if unknown:
        raise ValueError(f"ct_hessians names {len(unknown)} module(s) that are not quantizable nn.Linear layers "
                         f"({', '.join(unknown[:5])})")
    todo = [(n, s) for n, s in schemes.items() if s is not None]
    out: dict[str, Rounded] = {}
    with progress(total=len(todo), desc="compressed-tensors: rounding", unit="layer") as bar:
        for name, s in todo:
            w = model.get_submodule(name).weight.detach()
            h = hessians.get(name)
            try:
                out[name] = (rtn(w, s, scale_dtype=scale_dtype) if h is None else
                             gptq(w, h, s, scale_dtype=scale_dtype, **GPTQ_ORDER))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
            bar.update(1)
    return out


# id(request) -> (what was rounded, {name: Rounded without its float weight}); entries leave with their request
_ROUNDED: dict[int, tuple[tuple, dict[str, Rounded]]] = {}


def _rounded(request: WriteRequest, model: nn.Module, schemes: dict[str, IntScheme | None],
             scale_dtype: torch.dtype) -> dict[str, Rounded]:
    """:func:`round_layers` for ``request``, done once: the write stores the codes and scales (one byte a
    weight), the verify takes them; GPTQ on a billion-parameter model is minutes of CPU."""
    plan = request.size_plan
    if plan is not None:  # the size stage rounded the compensated layers over all their rows already
        stored = {m: r for _, by in plan.stored.values() for m, r in by.items()}
        out = {m: r._replace(weight=_dequantized(r)) for m, r in stored.items() if schemes.get(m) is not None}
        out.update(round_layers(model, {n: s for n, s in schemes.items() if n not in out}, None, scale_dtype))
        return out
    hessians = request.options.get("ct_hessians")
    key = (tuple(schemes.items()), id(hessians), scale_dtype)
    hit = _ROUNDED.get(id(request))
    if hit is not None and hit[0] == key:
        return {n: r._replace(weight=_dequantized(r)) for n, r in hit[1].items()}
    rounded = round_layers(model, schemes, hessians, scale_dtype)
    if id(request) not in _ROUNDED:
        weakref.finalize(request, _ROUNDED.pop, id(request), None)
    _ROUNDED[id(request)] = (key, {n: r._replace(weight=None) for n, r in rounded.items()})
    return rounded


def _dequantized(r: Rounded) -> torch.Tensor:
    """``ints · scales`` in float32, as :mod:`~compressor.fitting.intround` computes it (bit for bit)."""
    per = r.ints.shape[1] // r.scales.shape[1]
    return r.ints.float() * r.scales.float().repeat_interleave(per, dim=1)


# --------------------------------------------------------------------------------------------------
# The base-class model the folder holds
# --------------------------------------------------------------------------------------------------


def _replaced(model: nn.Module) -> bool:
    return any(isinstance(m, (HiddenUnitFFN, AffineFFN, LowRankAffineFFN)) for m in model.modules())


def base_model(model: nn.Module) -> nn.Module:
    """A model of the base class to quantize and save, leaving ``model`` as it is: the pruned model rebuilt
    as its base class (:func:`~compressor.output.standard.standard_model`, a new model), or ``model``'s
    module tree copied around its tensors (shared, never written: a replaced weight is a new parameter)."""
    if _replaced(model):
        from compressor.output.standard import standard_model

        return standard_model(model)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)


def _with_weights(model: nn.Module, rounded: dict[str, Rounded], dtype: torch.dtype) -> None:
    """Give each rounded layer of ``model`` its decoded weight (a new parameter, in ``dtype``)."""
    for name, r in rounded.items():
        mod = model.get_submodule(name)
        mod.weight = nn.Parameter(r.weight.to(device=mod.weight.device, dtype=dtype), requires_grad=False)


def _compress(model: nn.Module, schemes: dict[str, IntScheme | None], rounded: dict[str, Rounded]):
    """Attach the config to ``model`` and pack its quantized layers with the library (in place); returns the
    ``ModelCompressor`` whose config is now ``compressed``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import apply_quantization_config

    qconfig = quantization_config(schemes, sorted((_embedding_names(model) - set(schemes)) & {
        n for n, m in model.named_modules() if isinstance(m, nn.Linear)}))
    apply_quantization_config(model, qconfig, show_progress=False)
    targeted = {n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    if targeted != set(rounded):
        raise RuntimeError(f"the quantization config targets {len(targeted)} layers, {len(rounded)} were rounded "
                           f"(differ: {sorted(targeted ^ set(rounded))[:5]})")
    for name, r in rounded.items():
        mod = model.get_submodule(name)
        # float32 ints·scales is exact, so the compressor's own quantize() recovers the codes; on the layer's
        # device, where apply_quantization_config made its zero point (a model on a GPU: tools/gpu_check.py)
        device = mod.weight.device
        mod.weight = nn.Parameter(r.weight.to(device), requires_grad=False)
        mod.weight_scale = nn.Parameter(r.scales.to(device), requires_grad=False)
    compressor = ModelCompressor(quantization_config=qconfig)
    compressor.compress_model(model)
    return compressor


# --------------------------------------------------------------------------------------------------
# The writer
# --------------------------------------------------------------------------------------------------


@register_writer
class CompressedTensorsWriter(Writer):
    """``compressed-tensors``: the base class with integer ``pack-quantized`` linears (W4A16, W8A16…), loaded
    by plain transformers with the compressed-tensors package and served by vLLM. Options
    (``request.options``): ``ct_scheme``, ``ct_schemes``, ``ct_hessians`` (module docstring)."""

    format = "compressed-tensors"
    description = ("Hugging Face folder of the base class with int4/int8 weights in compressed-tensors' pack-quantized "
                   "format (llm-compressor's W4A16/W8A16; vLLM serves it); kind prune or none")

    def unsupported(self, model_type: str, kind: str) -> str | None:
        if (why := library_missing()) is not None:
            return why
        from compressor.core.archs import ARCHITECTURES

        spec = ARCHITECTURES.get(model_type)
        if spec is not None and spec.int_refusal:
            return (f"model type {model_type!r} cannot be written as compressed-tensors: {spec.int_refusal}; use "
                    "output.formats: [hf] for this model")
        if kind not in _PLAIN_KINDS:
            return (f"the compressed-tensors format stores the base model's own class, which has no place for "
                    f"{kind} replacements: only kind prune (saved at the pruned width) or none; use kind: prune, or "
                    "the hf format")
        if kind == "prune":
            from compressor.output.standard import StandardWriter

            return StandardWriter().unsupported(model_type, kind)
        return None

    def check_options(self, options: dict) -> str | None:
        try:
            if "ct_scheme" in options and get_scheme(options["ct_scheme"]) is None:
                return "output ct_scheme: none quantizes nothing; name a scheme, or write hf / hf-standard"
            mapping = options.get("ct_schemes")
            if mapping is not None:
                if not isinstance(mapping, dict):
                    return f"output ct_schemes must map module names to scheme names, got {type(mapping).__name__}"
                for scheme in mapping.values():
                    get_scheme(scheme)
            hessians = options.get("ct_hessians")
            if hessians is not None and not isinstance(hessians, dict):
                return f"output ct_hessians must map module names to [in, in] tensors, got {type(hessians).__name__}"
        except ValueError as e:
            return f"output: {e}"
        return None

    def write(self, request: WriteRequest, folder: Path) -> list[Path]:
        _require_library()
        from compressed_tensors import __version__ as ct_version

        model = request.model
        if is_offloaded(model):
            raise ValueError("the compressed-tensors writer rounds every weight in memory; an onloaded model "
                             "(model.offload) cannot be written in this format")
        if (why := self.check_options(request.options)) is not None:
            raise ValueError(why)
        dtype = request.dtype or model.dtype
        base = base_model(model)
        schemes = layer_schemes(base, _options(request))
        rounded = _rounded(request, base, schemes, dtype)
        compressor = _compress(base, schemes, rounded)
        base.save_pretrained(folder, safe_serialization=True, state_dict=cast_state_dict(base, dtype))
        del base, rounded
        compressor.update_config(str(folder))
        cfg_path, cfg = finish_folder(folder, request.tokenizer, dtype)
        cfg.pop("auto_map", None)
        counts = scheme_counts(schemes)
        head = head_scheme(model, schemes)
        cfg["compression"] = {**request.compression, "format": CTENSORS_FORMAT,
                              "quantization": {"library": f"compressed-tensors {ct_version}", "format": PACK_FORMAT,
                                               "schemes": counts, "gptq_layers": _gptq_layers(request, schemes),
                                               "output_head": head}}
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for name, text in request.extra_files.items():
            (folder / name).write_text(_card(text, counts, head) if name == "README.md" else text)
        logger.info("compressed-tensors: %s, %d layer(s) rounded by GPTQ", counts, _gptq_layers(request, schemes))
        return sorted(folder.iterdir())

    def verify(self, request: WriteRequest, folder: Path) -> dict:
        """Reload with plain transformers in the compute dtype; its logits must equal, to the compute dtype's
        tolerance, those of the in-memory model whose quantized weights are the values the file decodes to
        and whose other tensors are rounded through the saved dtype. Records the reload's perplexity."""
        _require_library()
        from compressed_tensors import __version__ as ct_version
        from transformers import AutoModelForCausalLM

        from compressor.core.params import count_params
        from compressor.evaluation.evaluate import perplexity

        t0 = time.perf_counter()
        model = request.model
        dtype = request.dtype or model.dtype
        base = base_model(model)
        schemes = layer_schemes(base, _options(request))
        rounded = _rounded(request, base, schemes, dtype)
        _ROUNDED.pop(id(request), None)  # verified once: the codes are not needed again
        stored_bytes = tensor_bytes(base, schemes, dtype)
        base_cls = type(base)
        probe, expected = _reference_logits(request, base, rounded, dtype)
        del base, rounded  # before the reload: never three models in memory at once
        reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=model.dtype).eval()
        cls = f"{type(reloaded).__module__}.{type(reloaded).__name__}"
        if not type(reloaded).__module__.startswith("transformers.") or type(reloaded) is not base_cls:
            raise VerificationError(f"the compressed-tensors folder reloaded as {cls}, not the base class "
                                    f"{base_cls.__name__}; the folder was not published")
        diff = float((expected - _logits(reloaded, probe)).abs().max())
        tol = logit_tolerance(model.dtype, computes_on_gpu(model) or computes_on_gpu(reloaded))
        again = perplexity(reloaded, request.probe_tokens, seq_len=request.probe_seq_len,
                           stride=request.probe_stride, batch_size=request.probe_batch_size,
                           desc="compressed-tensors reload check", shard=False)
        ref_ppl = request.expected_ppl
        check = {"runtime": "transformers", "compressed_tensors": ct_version, "class": cls, "format": PACK_FORMAT,
                 "saved_dtype": str(dtype).removeprefix("torch."), "schemes": scheme_counts(schemes),
                 "gptq_layers": _gptq_layers(request, schemes),
                 "tensor_bytes": stored_bytes, "file_bytes": folder_weight_bytes(Path(folder)),
                 "params": count_params(reloaded), "max_abs_logit_diff": diff, "logit_tolerance": tol,
                 "compared_with": "the in-memory model with the decoded weights",
                 "perplexity": again.ppl, "expected_perplexity": ref_ppl,
                 "quantization_change": again.ppl / ref_ppl - 1.0 if ref_ppl else None,
                 "passed": diff <= tol, "seconds": time.perf_counter() - t0}
        if not check["passed"]:
            raise VerificationError(
                f"compressed-tensors reload check failed: max |Δlogit| {diff:.3g} against the in-memory model with the "
                f"decoded weights (tolerance {tol:g}); the folder was not published")
        if request.size_plan is not None:  # measured where it runs, for the size stage's gate
            check.update(quant="plan", disk_bytes=check["file_bytes"], file_bytes=stored_bytes,
                         domains=_score(reloaded, _gate_domains(request)))
        # freed now: reference cycles in a reloaded model wait for a full collection, and the next model (the
        # anchor; Qwen2.5-1.5B: 7 GB in float32) must not be loaded beside it
        del reloaded
        gc.collect()
        return check


def _gate_domains(request: WriteRequest) -> list[dict]:
    """Every gate domain (``options['gate_domains']``), else the verification probe."""
    return request.options.get("gate_domains") or [
        {"name": "probe", "tokens": request.probe_tokens, "seq_len": request.probe_seq_len,
         "stride": request.probe_stride, "reference_ppl": request.expected_ppl}]


def _score(model: nn.Module, domains: list[dict]) -> list[dict]:
    """A reloaded checkpoint on every gate domain: its rows (perplexity, change, KL from the original's teacher
    where the domain carries it) with each window's scores for the size gate."""
    from compressor.evaluation.evaluate import model_scores

    return [model_scores(model, d["tokens"], d["seq_len"], d["stride"], d.get("teacher")).row(
        d["name"], d.get("reference_ppl")) for d in domains]


def score_folder(folder: Path, domains: list[dict], dtype: torch.dtype) -> dict:
    """A checkpoint folder reloaded by plain transformers, scored on every gate domain (``name →
    WindowScores``): the anchor a size plan is measured beside."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    scores = {row["name"]: row["scores"] for row in _score(reloaded, domains)}
    del reloaded  # as in verify: before another model is loaded
    gc.collect()
    return scores


def _gptq_layers(request: WriteRequest, schemes: dict[str, IntScheme | None]) -> int:
    """Quantized layers rounded by GPTQ: given an Ĥ, or rounded so by the size stage."""
    by_gptq = set(request.options.get("ct_hessians") or {})
    if request.size_plan is not None:
        by_gptq |= {m for _, rounded in request.size_plan.stored.values() for m in rounded}
    return len(by_gptq & {n for n, s in schemes.items() if s is not None})


@torch.no_grad()
def _reference_logits(request: WriteRequest, base: nn.Module, rounded: dict[str, Rounded],
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe windows (at most 2) and the logits of ``base`` with every tensor rounded through the saved
    ``dtype`` and each quantized weight its decoded values (what the reload computes with)."""
    tokens, seq_len = request.probe_tokens, request.probe_seq_len
    if tokens is None:
        raise ValueError("the compressed-tensors reload check needs probe tokens (request.probe_tokens)")
    n = min(2, max(1, tokens.numel() // seq_len))
    probe = tokens[: n * min(seq_len, tokens.numel() // n)].view(n, -1)
    compute = next(base.parameters()).dtype
    # base's tensors are shared with the model: rounding copies them, all but the weights replaced below
    ref = base if dtype == compute else rounded_copy(base, dtype, [base.get_submodule(n).weight for n in rounded])
    _with_weights(ref, rounded, compute)
    logits = _logits(ref, probe)
    del ref
    return probe, logits


@torch.no_grad()
def _logits(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    device = model.get_input_embeddings().weight.device
    return model(input_ids=input_ids.to(device)).logits.float().cpu()


def head_scheme(model: nn.Module, schemes: dict[str, IntScheme | None]) -> str:
    """The output head's scheme in words: its scheme's name when quantized, else how it is kept."""
    name = head_name(model)
    if name is not None and schemes.get(name) is not None:
        return schemes[name].name
    return "unquantized (tied to the embedding)" if name is None else "unquantized"


def _card(card: str, counts: dict[str, int], head: str) -> str:
    """The model card with its Load section for a compressed-tensors folder (no custom code)."""
    schemes = ", ".join(f"{k} × {v}" for k, v in counts.items())
    serve = ("vLLM serves it as it is (`vllm serve path/to/this/folder`)" if head.startswith("unquantized") else
             f"the output head is quantized too ({head}), which a runtime must read: vLLM routes a quantized "
             "`lm_head` to its compressed-tensors kernels since its PR #37291 (not checked by compressor); for a "
             "runtime that does not, write the folder again with `output.ct_head: keep`")
    note = (f"Saved in the compressed-tensors `{PACK_FORMAT}` format (linear layers: {schemes}): plain transformers "
            "loads it with the `compressed-tensors` package installed (`pip install compressed-tensors`), no custom "
            f"code and no flags; {serve}.\n\n## Load\n")
    from compressor.output.standard import plain_load_card

    return plain_load_card(card, note)
