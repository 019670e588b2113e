"""Rounding a compressed-tensors checkpoint's layers onto their schemes, and packing them with the library.

Rounded once per run: write stores the codes and scales (one byte a weight) on the plan
(:attr:`~.schemes.SchemePlan.codes`) and verify takes them; GPTQ on a billion-parameter model is minutes of CPU.
"""

from __future__ import annotations

import contextlib

import copy
import itertools

import torch
from torch import nn

from compressor.core.modeling import AffineFFN, HiddenUnitFFN, LowRankAffineFFN
from compressor.core.progress import progress
from compressor.output.ctensors.grids import IntScheme, Rounded, decoded, gptq, rtn
from compressor.output.ctensors.schemes import GPTQ_ORDER, SchemePlan, model_quantization_config



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
            out[name] = round_layer(model.get_submodule(name).weight.detach(), s, hessians.get(name), scale_dtype,
                                    name)
            bar.update(1)
    return out


def round_layer(weight: torch.Tensor, scheme: IntScheme, h: torch.Tensor | None, scale_dtype: torch.dtype,
                name: str) -> Rounded:
    """One layer's weight onto ``scheme``: GPTQ through ``h`` (its Ĥ), or to nearest without one; a weight the
    scheme cannot take is a ``ValueError`` naming the layer."""
    try:
        return (rtn(weight, scheme, scale_dtype=scale_dtype) if h is None else
                gptq(weight, h, scheme, scale_dtype=scale_dtype, **GPTQ_ORDER))
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _rounded(plan: SchemePlan, model: nn.Module, schemes: dict[str, IntScheme | None],
             scale_dtype: torch.dtype) -> dict[str, Rounded]:
    """Every quantized layer of ``plan`` rounded, once per plan: the layers the plan holds rounded already (a
    size's GPTQ) decoded, the rest by :func:`round_layers`; the codes are kept on the plan
    (:attr:`~.schemes.SchemePlan.codes`) for verify."""
    key = (tuple(schemes.items()), scale_dtype)
    if plan.codes is not None and plan.codes[0] == key:
        return {n: r._replace(weight=decoded(r)) for n, r in plan.codes[1].items()}
    out = {m: r._replace(weight=decoded(r)) for m, r in plan.rounded.items() if schemes.get(m) is not None}
    out.update(round_layers(model, {n: s for n, s in schemes.items() if n not in out},
                            {n: h for n, h in (plan.hessians or {}).items() if n not in out}, scale_dtype))
    plan.codes = (key, {n: r._replace(weight=None) for n, r in out.items()})
    return out


# --------------------------------------------------------------------------------------------------
# The base-class model the folder holds
# --------------------------------------------------------------------------------------------------


def _replaced(model: nn.Module) -> bool:
    return any(isinstance(m, (HiddenUnitFFN, AffineFFN, LowRankAffineFFN)) for m in model.modules())


def base_model(model: nn.Module) -> nn.Module:
    """A model of the base class to quantize and save, leaving ``model`` as it is: the pruned model rebuilt
    as its base class (:func:`~compressor.output.hf.standard.standard_model`, a new model), or ``model``'s
    module tree copied around its tensors (shared, never written: a replaced weight is a new parameter)."""
    if _replaced(model):
        from compressor.output.hf.standard import standard_model

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

    qconfig = model_quantization_config(model, schemes)
    apply_quantization_config(model, qconfig, show_progress=False)
    targeted = {n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None}
    if targeted != set(rounded):
        raise RuntimeError(f"the quantization config targets {len(targeted)} layers, {len(rounded)} were rounded "
                           f"(differ: {sorted(targeted ^ set(rounded))[:5]})")
    for name, r in rounded.items():
        mod = model.get_submodule(name)
        # float32 ints·scales is exact, so the compressor's own quantize() recovers the codes; on the layer's
        # device, where apply_quantization_config made its zero point (a model on a GPU: tools/checks/gpu_check.py)
        device = mod.weight.device
        mod.weight = nn.Parameter(r.weight.to(device), requires_grad=False)
        mod.weight_scale = nn.Parameter(r.scales.to(device), requires_grad=False)
    compressor = ModelCompressor(quantization_config=qconfig)
    with alone():
        compressor.compress_model(model)
    return compressor


def alone():
    """The library working in this process only: under torchrun it would otherwise deal the layers out to every
    rank and broadcast them (``replace_module_parallel``), while rank 0 writes and reloads the folder alone
    (the other ranks wait for its report)."""
    try:
        from compressed_tensors.offload.utils import as_single_threaded
    except ImportError:  # a version without distributed compression: nothing to turn off
        return contextlib.nullcontext()
    return as_single_threaded()


