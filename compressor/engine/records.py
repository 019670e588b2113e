"""Records of a run state: nested dataclasses, dicts and lists of tensors and plain values ↔ (JSON, tensors).

:func:`encode` turns a step's result into JSON-able data plus the tensors it
refers to (by name), :func:`decode` turns them back. Only registered dataclass
types are recorded: the engine's and fitting's own, and those the layers above
register with :func:`register_record`. :class:`ResumeError` is the error a
saved state that does not fit this run raises (here because a record of an
unknown type is one).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


class ResumeError(ValueError):
    """Nothing to resume, or a saved state that does not belong to this run (an input error: exit 2)."""


#: Record types of the layers above the engine (policy, evaluation), registered by their own
#: modules with :func:`register_record`; the engine never imports upward.
_REGISTERED: dict[str, type] = {}


def register_record(*types: type) -> None:
    """Let the run state record and restore instances of these dataclasses."""
    for t in types:
        _REGISTERED[t.__name__] = t


def _record_types() -> dict[str, type]:
    from compressor.core.stats import Moments
    from compressor.engine.profiling import BlockProfile
    from compressor.fitting.kinds import BlockData, Fitted, Level
    from compressor.fitting.obs import ObsPath
    from compressor.fitting.solve import AffineFit

    own = (AffineFit, BlockData, Fitted, Level, ObsPath, BlockProfile, Moments)
    return {**{t.__name__: t for t in own}, **_REGISTERED}


# Fields that hold live objects of the model (re-attached by whoever loads the record).
_SKIP = {"BlockData": ("ffn", "spec")}


def encode(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` as JSON-able data plus the tensors it refers to (by name)."""
    tensors: dict[str, torch.Tensor] = {}
    return _enc(value, tensors, _record_types()), tensors


# Module-level recursion, not nested closures: a recursive closure is a reference cycle that would
# keep each record's tensors (a layer's statistics, hundreds of MB at 1B scale) alive until the
# cyclic garbage collector happens to run.
def _enc(v, tensors: dict[str, torch.Tensor], types: dict[str, type]):
    if isinstance(v, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = v.detach().cpu().contiguous().clone()  # clone: no shared storage in safetensors
        return {"__tensor__": name}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        name = type(v).__name__
        if types.get(name) is not type(v):
            raise TypeError(f"run state cannot record a {type(v).__qualname__}")
        skip = _SKIP.get(name, ())
        return {"__type__": name, "fields": {f.name: _enc(getattr(v, f.name), tensors, types)
                                             for f in dataclasses.fields(v) if f.name not in skip}}
    if isinstance(v, dict):
        return {"__dict__": [[_enc(k, tensors, types), _enc(x, tensors, types)] for k, x in v.items()]}
    if isinstance(v, tuple):
        return {"__tuple__": [_enc(x, tensors, types) for x in v]}
    if isinstance(v, list):
        return [_enc(x, tensors, types) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"run state cannot record a {type(v).__qualname__}")


def decode(data: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`encode` (skipped fields come back as None)."""
    return _dec(data, tensors, _record_types())


def _dec(v, tensors: dict[str, torch.Tensor], types: dict[str, type]):
    if isinstance(v, list):
        return [_dec(x, tensors, types) for x in v]
    if not isinstance(v, dict):
        return v
    if "__tensor__" in v:
        return tensors[v["__tensor__"]]
    if "__tuple__" in v:
        return tuple(_dec(x, tensors, types) for x in v["__tuple__"])
    if "__dict__" in v:
        return {_hashable(_dec(k, tensors, types)): _dec(x, tensors, types) for k, x in v["__dict__"]}
    cls = types.get(v["__type__"])
    if cls is None:
        raise ResumeError(f"the saved run state holds a {v['__type__']!r} record that nothing registered; "
                          "it was written by another compressor version: run without --resume")
    kwargs = {k: _dec(x, tensors, types) for k, x in v["fields"].items()}
    kwargs.update({k: None for k in _SKIP.get(v["__type__"], ())})
    return cls(**kwargs)


def _hashable(k):
    return tuple(k) if isinstance(k, list) else k
