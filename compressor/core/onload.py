"""Onloading: decoder layers' weights stay off the compute device, one layer at a time is materialised.

``model.offload`` in a recipe: ``none`` loads the whole model on ``model.device``; ``disk`` keeps every decoder layer
on disk (a safetensors checkpoint read in place, a GGUF written once to an offload folder), each linear layer read
when it runs and dropped after; ``cpu`` keeps layers in host RAM and moves each to the GPU when it runs.

The mechanism is accelerate's (``device_map`` with ``"disk"``/``"cpu"`` entries, its ``AlignDevicesHook``), so every
full-model forward works unchanged and the layer-sequential engine touches one layer at a time. With ``disk`` an
untied embedding and head wait on disk too (the largest tensors of a large vocabulary); a tied pair stays on the
device. This module adds the few places where compressor reads weights itself: a module's execution device
(:func:`input_device`) and a weight's value when its parameter is a ``meta`` placeholder. Measured:
docs/large-models.md.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from typing import Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)

OFFLOAD = ("none", "cpu", "disk")


def layer_list_path(model: nn.Module) -> str:
    """Dotted path of the decoder-layer ``ModuleList`` (the one with ``num_hidden_layers`` entries)."""
    n = getattr(model.config, "num_hidden_layers", None) or getattr(getattr(model.config, "text_config", None),
                                                                     "num_hidden_layers", None)
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (n is None or len(mod) == n):
            if best is None or len(name) < len(best):
                best = name
    if best is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to offload")
    return best


def device_map(skeleton: nn.Module, offload: str, device: str) -> dict[str, str]:
    """An explicit accelerate ``device_map``: decoder layers → ``offload``, everything else → ``device``; with
    ``disk``, an untied token embedding and output head → ``disk`` too (:func:`offloaded_embeddings`).

    ``skeleton`` is the model built on the meta device (``accelerate.init_empty_weights``).
    """
    if offload not in ("cpu", "disk"):
        raise ValueError(f"offload must be 'cpu' or 'disk', got {offload!r}")
    layers = layer_list_path(skeleton)
    out: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if path == layers:
                for i in range(len(child)):
                    out[f"{path}.{i}"] = offload
            elif layers.startswith(path + "."):
                visit(path, child)
            else:
                out[path] = device
        for name, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            out[f"{prefix}.{name}" if prefix else name] = device

    visit("", skeleton)
    if offload == "disk":
        for path in offloaded_embeddings(skeleton):
            if out.get(path) == device:  # a module of its own in the map (not inside one placed whole)
                out[path] = "disk"
    return out


def offloaded_embeddings(skeleton: nn.Module) -> list[str]:
    """Module paths of the token embedding and the output head when they are two tensors (an untied head): what
    ``disk`` onloading keeps on disk besides the decoder layers. A tied pair (one tensor) stays on the compute
    device: none."""
    from compressor.core.params import tied_head

    try:
        mods = [skeleton.get_input_embeddings(), skeleton.get_output_embeddings()]
    except (AttributeError, NotImplementedError):
        return []
    if any(m is None for m in mods) or tied_head(skeleton) or _ties_embeddings(skeleton.config):
        return []
    names = {id(m): n for n, m in skeleton.named_modules()}
    return [names[id(m)] for m in mods if id(m) in names]


def offload_folder() -> str:
    """A temporary folder for offloaded weights that are not already in safetensors files; removed at exit."""
    path = tempfile.mkdtemp(prefix="compressor-offload-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def is_offloaded(model: nn.Module) -> bool:
    dm = getattr(model, "hf_device_map", None) or {}
    return any(v in ("cpu", "disk") for v in dm.values()) and any(
        p.device.type == "meta" for p in model.parameters())


def execution_device(module: nn.Module) -> torch.device:
    """Where ``module`` computes: an accelerate hook's execution device, else its first real parameter's device."""
    for m in module.modules():
        hook = getattr(m, "_hf_hook", None)
        dev = getattr(hook, "execution_device", None)
        if dev is not None:
            return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for p in module.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _ties_embeddings(config) -> bool:
    """Whether the config ties the head to the embedding (a skeleton on the meta device is not tied yet)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))


def input_device(model: nn.Module) -> torch.device:
    """Where ``model``'s token ids go: its input embedding's execution device (its weight may wait on disk as a
    ``meta`` placeholder: :func:`device_map`); a model without one, its first parameter's."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embed = None
    return execution_device(embed if embed is not None else model)


def tensor(module: nn.Module, name: str) -> torch.Tensor:
    """The value of ``module``'s parameter/buffer ``name`` (dotted), read from the offload store when it is a
    ``meta`` placeholder. The result is a real tensor (on the CPU when read back from disk)."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    t = getattr(owner, leaf)
    if t is None or t.device.type != "meta":
        return t
    hook = getattr(owner, "_hf_hook", None)
    weights = getattr(hook, "weights_map", None)
    if weights is None:
        raise RuntimeError(f"{name} is a meta tensor without an offload store; the model was not loaded completely")
    return weights[leaf].to(t.dtype)


def weight(model: nn.Module, module_name: str) -> torch.Tensor:
    """Module ``module_name``'s weight as a float32 CPU tensor, read from the offload store when the layer is
    onloaded (only that tensor is read: a safetensors checkpoint is memory-mapped)."""
    return tensor(model, f"{module_name}.weight" if module_name else "weight").detach().float().cpu()


def named_tensors(model: nn.Module, buffers: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` over parameters (and buffers), one real tensor at a time (offloaded ones are read back)."""
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        own = list(mod.named_parameters(recurse=False)) + (list(mod.named_buffers(recurse=False)) if buffers else [])
        for pname, t in own:
            if id(t) in seen:
                continue
            seen.add(id(t))
            full = f"{mname}.{pname}" if mname else pname
            yield full, tensor(mod, pname) if t.device.type == "meta" else t


def offload_module(module: nn.Module, execution_device: torch.device) -> nn.Module:
    """Move a freshly built module's weights to disk (accelerate's ``disk_offload``), so a replacement
    installed in an onloaded layer is materialised only while it runs, like the layer around it.
    Its folder is removed when the module is garbage-collected (or at exit)."""
    import weakref

    from accelerate import disk_offload

    folder = offload_folder()
    disk_offload(module, folder, execution_device=execution_device)
    weakref.finalize(module, shutil.rmtree, folder, True)
    return module


MMAP_THRESHOLD = 1 << 20


def limit_heap_growth() -> bool:
    """Pin glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``) so that freed weight and statistics
    buffers go back to the system. glibc raises the threshold as large blocks are freed and then
    serves tens-of-MB tensors from its heap, which fragments: an onloaded 1.17 B model's profile
    grew ~35 MB per layer that way (2.36 GiB peak at 22 layers; 1.73 GiB with the threshold pinned).
    Returns whether it applied (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return bool(libc is not None and libc.mallopt(-3, MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def load_kwargs(config, auto_cls, offload: str, device: str, common: dict) -> dict:
    """``from_pretrained`` keyword arguments that offload the decoder layers."""
    from accelerate import init_empty_weights

    limit_heap_growth()
    with init_empty_weights():
        skeleton = auto_cls.from_config(config, trust_remote_code=common.get("trust_remote_code", False))
    exec_device = "cpu" if device == "cpu" else 0
    dm = device_map(skeleton, offload, exec_device)
    kwargs = {"device_map": dm}
    if offload == "disk":
        kwargs["offload_folder"] = offload_folder()
    layers = layer_list_path(skeleton) + "."
    embeddings = [p for p, v in dm.items() if v == "disk" and not p.startswith(layers)]  # device is never disk
    logger.info("onloading: %d decoder layers%s offloaded to %s, executed on %s",
                sum(v == offload for v in dm.values()) - len(embeddings),
                f" and the token embedding and output head ({', '.join(embeddings)})" if embeddings else "",
                offload, device)
    return kwargs
