"""A compressed-tensors checkpoint of an onloaded model (``model.offload: disk``), written and checked tensor by tensor.

The in-memory writer packs a whole copy of the model with the library (``ModelCompressor.compress_model``) and
saves it; its check holds a second model for reference logits. An onloaded model is never whole in memory, so
here each tensor is read from the offload store when it is written: a quantized layer's codes (the size stage's
GPTQ, or rounded to nearest here) packed by the library's own per-module compressor
(``PackedQuantizationCompressor.compress``, what ``compress_model`` calls for every layer), every other tensor
cast to the saved dtype, into safetensors shards of :data:`SHARD_BYTES`. With one shard the file is the
in-memory writer's byte for byte (``tests/test_ctensors_stream.py``).

The check reloads the folder with plain transformers and compares, tensor by tensor, what the reload computes with
against what was meant: each quantized layer's weight, as the library decompresses it, equal to the decoded codes;
every other tensor equal to the source's rounded through the saved dtype. Exact, where the in-memory check
compares logits to a tolerance — and it needs no second model.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
from torch import nn

from compressor.core import onload
from compressor.core.progress import progress
from compressor.output.ctensors.grids import IntScheme, Rounded, decoded
from compressor.output.ctensors.rounding import round_layer
from compressor.output.ctensors.schemes import PACK_FORMAT, SchemePlan, model_quantization_config

logger = logging.getLogger(__name__)

#: Bytes of tensors per safetensors shard (held in memory until the shard is written).
SHARD_BYTES = 512 << 20


def layer_rounded(plan: SchemePlan, model: nn.Module, name: str, scheme: IntScheme, dtype: torch.dtype) -> Rounded:
    """Layer ``name``'s codes and scales on ``scheme``: the size stage's rounding where the plan holds it, else
    :func:`~compressor.output.ctensors.rounding.round_layer` of the weight read from the offload store."""
    if name in plan.rounded:
        return plan.rounded[name]
    return round_layer(onload.weight(model, name), scheme, (plan.hessians or {}).get(name), dtype,
                       name)._replace(weight=None)


#: Rows of a quantized weight decoded, packed or compared at once: a whole output head decoded in float32 took
#: three copies of it (codes, scales spread over the row, their product: 2.8 GB for Qwen2.5-1.5B's untied head).
CHUNK_ROWS = 4096


def _chunks(n: int) -> list[slice]:
    return [slice(i, min(i + CHUNK_ROWS, n)) for i in range(0, n, CHUNK_ROWS)]


def _packed(packer, r: Rounded, scheme) -> dict[str, torch.Tensor]:
    """The library's packing of ``r`` (``weight_packed``, ``weight_scale``, ``weight_shape``), :data:`CHUNK_ROWS` rows
    at a time (its codes are packed along each row, so the rows' packs joined are the whole weight's)."""
    parts = [packer.compress({"weight": decoded(r, rows), "weight_scale": r.scales[rows]}, scheme)
             for rows in _chunks(r.ints.shape[0])]
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "weight_shape"}
    out["weight_shape"] = torch.tensor(tuple(r.ints.shape))
    return out


def _saved_names(model: nn.Module) -> list[str]:
    """The state dict's names as ``save_pretrained`` stores them: persistent tensors, a tied one once."""
    keys = set(model.state_dict())
    return [n for n, _ in onload.named_tensors(model) if n in keys]


class _Shards:
    """Tensors gathered into safetensors shards of about ``limit`` bytes, written as each fills; at the end named
    as ``save_pretrained`` names them (one: ``model.safetensors``; more: numbered, with the JSON index)."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.bytes + size > self.limit:
            self._flush()
        self.pending[name] = t.contiguous()
        self.bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.folder / f".shard-{len(self.parts)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.parts.append((path, sorted(self.pending)))
        self.pending, self.bytes = {}, 0

    def close(self) -> list[Path]:
        if self.pending or not self.parts:
            self._flush()
        n = len(self.parts)
        names = (["model.safetensors"] if n == 1 else
                 [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
        for (path, _), name in zip(self.parts, names):
            path.replace(self.folder / name)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: name for (_, keys), name in zip(self.parts, names) for k in keys}}
            (self.folder / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"
            )
        return [self.folder / name for name in names]


@torch.no_grad()
def write_streamed(model: nn.Module, plan: SchemePlan, schemes: dict[str, IntScheme | None], dtype: torch.dtype,
                   folder: Path, shard_bytes: int | None = None) -> None:
    """``model`` (onloaded) saved as a compressed-tensors folder in ``dtype``, one tensor read at a time: the
    weights, ``config.json`` with the quantization config, ``generation_config.json``."""
    from compressed_tensors.compressors import BaseCompressor

    packer = BaseCompressor.load_from_registry(PACK_FORMAT)
    library = {s: s.to_scheme(["Linear"], format=PACK_FORMAT) for s in set(schemes.values()) if s is not None}
    shards = _Shards(folder, SHARD_BYTES if shard_bytes is None else shard_bytes)
    names = _saved_names(model)
    for name in progress(names, desc="compressed-tensors: write", unit="tensor"):
        module, _, leaf = name.rpartition(".")
        scheme = schemes.get(module) if leaf == "weight" else None
        if scheme is None:
            t = onload.tensor(model, name).detach().cpu()
            shards.add(name, t.to(dtype) if t.is_floating_point() else t)
            continue
        r = layer_rounded(plan, model, module, scheme, dtype)
        packed = _packed(packer, r, library[scheme])
        for key, t in packed.items():
            shards.add(f"{module}.{key}", t.cpu())
    shards.close()
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(folder)
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus

    qconfig = model_quantization_config(model, schemes)
    qconfig.quantization_status = QuantizationStatus.COMPRESSED  # as compress_model leaves it
    ModelCompressor(quantization_config=qconfig).update_config(str(folder))


@torch.no_grad()
def check_reload(model: nn.Module, reloaded: nn.Module, plan: SchemePlan, schemes: dict[str, IntScheme | None],
                 dtype: torch.dtype) -> dict:
    """What the plain-transformers reload computes with, against what was meant, one tensor at a time: once its
    first forward has decompressed the packed weights (as the library does for a model that runs), each quantized
    layer's weight equal to the decoded codes (``ints · scales``) in the reload's dtype, every other tensor equal
    to the source's rounded through the saved ``dtype``. ``failed_at`` names the first tensor that is not."""
    compute = next(reloaded.parameters()).dtype
    reloaded(input_ids=torch.zeros(1, 1, dtype=torch.long, device=onload.execution_device(reloaded)))
    held = dict(reloaded.named_parameters()) | dict(reloaded.named_buffers())
    off, compared = None, 0
    for name in progress(_saved_names(model), desc="compressed-tensors: reload check", unit="tensor"):
        module, _, leaf = name.rpartition(".")
        scheme = schemes.get(module) if leaf == "weight" else None
        if scheme is None:
            source = onload.tensor(model, name).detach().cpu()
            shape = source.shape

            def want(rows, source=source):
                t = source[rows]
                return t.to(dtype).to(compute) if t.is_floating_point() else t
            what = f"the source's rounded through {str(dtype).removeprefix('torch.')}"
        else:
            r = layer_rounded(plan, model, module, scheme, dtype)
            shape = r.ints.shape

            def want(rows, r=r):
                return decoded(r, rows).to(compute)
            what = f"its decoded {scheme.name} codes"
        got = held.get(name)
        same = got is not None and got.shape == shape and all(  # a row chunk at a time: never a whole copy
            torch.equal(got.detach()[rows].cpu(), want(rows)) for rows in (_chunks(shape[0]) if len(shape) else [...]))
        if not same:
            off = off or f"{name} is not {what}"
        compared += 1
    return {"compared_with": "every tensor the reload computes with (quantized weights decompressed by the library) "
                             "against the decoded codes, or the source's rounded through the saved dtype",
            "tensors_compared": compared, "passed": off is None, "failed_at": off}
