"""The byte budget of a size plan, and the exact bytes every plan's file will have.

The model is written once as F16 (the file a deployer would quantize) in a work folder beside the
output: a Hugging Face folder by llama.cpp's own ``convert_hf_to_gguf.py`` (:mod:`compressor.output.gguf.converter`:
its names, layouts and metadata, whatever the architecture), which the plan's file then re-quantizes; a GGUF
source re-read in F16. Its layout fixes everything that is not a planned tensor's data: the header, metadata and
tokenizer (``data_offset``), the 1-D tensors, and the alignment padding after each tensor. A planned
file has the same metadata and tensors in the same order, only other types, so its size is known
exactly before it is written: :meth:`Budget.file_bytes`.

A preset name (``Q3_K_M``) is made from that F16 by llama.cpp's own quantizer with an importance matrix; its
bytes are the budget, and the preset file is measured beside the output on the same windows.
``750MB`` / ``4.5bpw`` are bytes directly (bits per weight over every weight the file stores); the largest
llama.cpp preset whose file fits them is made the same way and measured beside the output. Before the
statistics exist a preset is made with a uniform importance matrix (llama.cpp's type mix with a matrix, some
presets' types differ without one); once they do, :func:`with_importance` makes it again with the run's own
(:mod:`.imatrix`) and names at most :data:`RIVAL_FILES` smaller presets to measure beside it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from compressor.core.errors import InputError
from compressor.core.presets import LLAMA_CPP_PRESETS
from compressor.output.base import WriteRequest
from compressor.recipe.schema import Size
from compressor.sizing.budget import Budget, Layout, bpw_bytes, padded

logger = logging.getLogger(__name__)

#: How the anchor of a GGUF size is made.
PRESET_MADE_BY = ("llama.cpp llama_model_quantize from the same F16, with an importance matrix from the run's own "
                  "calibration text (model.imatrix, llama-imatrix's format)")
#: The anchor in words, as the summary, the report and the model card name it.
PRESET_CALLED = "llama.cpp's {name} with an importance matrix"
#: What the F16 budget file is written with: the model's own tensors (a GGUF source's, re-read), in F16.
F16_OPTIONS = {"quant": "f16", "from_source": True}
#: The F16 file's name in the work folder.
F16_FILE = "f16.gguf"


def read_layout(path: Path) -> Layout:
    """The :class:`Layout` of the GGUF at ``path``: its header only (:func:`header_layout`)."""
    data_offset, alignment, tensors = header_layout(path)
    planned, fixed = {}, 0
    for name, shape, n_bytes in tensors:
        if len([d for d in shape if d > 1]) >= 2:
            planned[name] = n_bytes
        else:
            fixed += padded(n_bytes, alignment)
    return Layout(data_offset, alignment, fixed, planned, path.stat().st_size)


def header_layout(path: Path) -> tuple[int, int, list[tuple[str, tuple[int, ...], int]]]:
    """``(data offset, alignment, [(tensor name, shape, data bytes)])`` of a GGUF file, read from its header:
    metadata values are skipped, not decoded (gguf-py's reader decodes every one, the tokenizer's ~100k
    strings included: 1.7 s of SmolLM2's size run, where this takes a few hundredths). GGUF v2/v3, with
    gguf-py's constants for the value and tensor types; ``tests/test_gguf.py`` checks it against the reader."""
    import mmap
    import struct

    import gguf

    V = gguf.GGUFValueType
    scalar = {V.UINT8: 1, V.INT8: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4, V.BOOL: 1,
              V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF" or struct.unpack_from("<I", m, 4)[0] not in (2, 3):
            raise ValueError(f"{path} is not a GGUF v2/v3 file")
        n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, at)
            return m[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

        def skip(kind: int, at: int) -> int:
            if kind == V.STRING:
                return at + 8 + struct.unpack_from("<Q", m, at)[0]
            if kind == V.ARRAY:
                inner, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if inner in scalar:
                    return at + scalar[V(inner)] * count
                for _ in range(count):
                    at = skip(inner, at)
                return at
            return at + scalar[V(kind)]

        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            if key == "general.alignment":
                alignment = int(struct.unpack_from("<I", m, pos)[0])
            pos = skip(kind, pos)
        tensors = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", m, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", m, pos + 4)
            qtype, _offset = struct.unpack_from("<IQ", m, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            elements = 1
            for d in shape:
                elements *= int(d)
            tensors.append((name, tuple(int(d) for d in shape), elements // block * type_size))
    return padded(pos, alignment), alignment, tensors


def f16_request(request: WriteRequest) -> WriteRequest:
    return WriteRequest(model=request.model, tokenizer=request.tokenizer, compression=request.compression,
                        source=request.source, dtype=torch.float16, options=dict(F16_OPTIONS))


def measure_budget(size: Size, request: WriteRequest, workdir: Path) -> Budget:
    """Write the F16 file into ``workdir`` and resolve ``size`` against it (and the preset, when named)."""
    from compressor.output.gguf.encode import PRESETS, quantize_file
    from compressor.output.gguf.write import write_gguf

    f16 = workdir / F16_FILE
    converted = None
    if request.source.gguf_file:
        write_gguf(f16_request(request), f16, dict(F16_OPTIONS))
    else:
        converted = convert_folder(request, f16, workdir)
    layout = read_layout(f16)
    kind, value = size.kind, size.value
    preset = None
    if kind == "preset":
        path = workdir / f"{value}.gguf"
        quantize_file(f16, path, PRESETS[value], imatrix=stand_in(f16))
        preset = _preset(value, path)
        limit = preset["file_bytes"]
    elif kind == "smallest":
        limit = layout.file_bytes  # at most the F16 file; the plan itself is searched
    elif kind == "bpw":
        limit = bpw_bytes(value, request.model, layout)
    else:
        limit = int(value)
    if limit <= layout.file_bytes_of({n: 0 for n in layout.planned}):
        raise InputError(f"output.size: {size} ({limit:,} bytes) does not even hold what is not weights "
                         f"({layout.data_offset + layout.fixed_bytes:,} bytes: metadata, tokenizer, norms); "
                         "give a larger size")
    if kind in ("bytes", "bpw") and limit > layout.file_bytes:  # more than every weight in F16 cannot be meant
        raise InputError(f"output.size: {size} ({_human(limit)}, {limit:,} bytes) is more than this model's F16 file "
                         f"({_human(layout.file_bytes)}, {layout.file_bytes:,} bytes): nothing would be quantized; "
                         f"give a size below {layout.file_bytes:,} bytes, e.g. a preset's name (Q4_K_M) or 4.5bpw")
    if kind in ("bytes", "bpw") and limit == layout.file_bytes:
        logger.warning("output.size %s (%s bytes) is the F16 file's size: every tensor stays F16, nothing is "
                       "quantized; give a smaller size to compress", size, f"{limit:,}")
    elif kind in ("bytes", "bpw"):
        preset = largest_preset(f16, limit, layout, workdir)
    return Budget(size, limit, layout, preset, base=f16 if converted is not None else None, converted=converted)


def _human(n: int) -> str:
    from compressor.engine.cache import human_bytes

    return human_bytes(n)


def _preset(name: str, path: Path) -> dict:
    return {"name": name, "path": str(path), "file_bytes": path.stat().st_size, "made_by": PRESET_MADE_BY,
            "called": PRESET_CALLED.format(name=name)}


def quantized_shapes(f16: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor of the F16 that llama.cpp may quantize (two dimensions or more), with its GGUF shape."""
    return {name: shape for name, shape, _ in header_layout(f16)[2] if len([d for d in shape if d > 1]) >= 2}


def stand_in(f16: Path):
    """A uniform importance matrix over the F16's tensors: a preset made with it has the bytes and the types of
    that preset made with the run's own matrix (llama.cpp's mix asks only whether there is one), before the
    statistics exist; and the presets that need one (IQ2_XXS) can be sized."""
    from compressor.output.gguf.imatrix import ImportanceMatrix

    return ImportanceMatrix.uniform(quantized_shapes(f16))


#: Presets besides the size's own that are made and measured (each a llama-quantize of the F16 with the run's
#: importance matrix): the next ones below it by bits per weight, in case a smaller preset is better there.
RIVAL_FILES = 2


def with_importance(budget: Budget, matrix, workdir: Path) -> list[str]:
    """The size's preset made again from the F16 with the run's importance matrix ``matrix`` (an
    :class:`~compressor.output.gguf.imatrix.ImportanceMatrix`, written into ``workdir`` for llama-quantize),
    replacing the stand-in's; a named preset's bytes become the budget. Returns the presets to measure beside it:
    at most :data:`RIVAL_FILES`, the largest below it by bits per weight that may fit the budget."""
    from compressor.output.gguf.encode import PRESETS, quantize_file
    from compressor.output.gguf.imatrix import IMATRIX_FILE

    f16 = workdir / F16_FILE
    missing = {n: s for n, s in quantized_shapes(f16).items() if n not in matrix.sums}
    if missing:  # llama-quantize refuses an i-quant preset with a tensor the matrix lacks
        logger.info("importance matrix: %d tensors have no statistics of the run (%s) and are weighted uniformly",
                    len(missing), ", ".join(sorted(missing)[:4]) + (" …" if len(missing) > 4 else ""))
        matrix.fill(missing)
    matrix.write(workdir / IMATRIX_FILE)
    preset = budget.preset
    if preset is None:
        return []
    path = Path(preset["path"])
    quantize_file(f16, path, PRESETS[preset["name"]], imatrix=matrix)
    preset.update(file_bytes=path.stat().st_size, imatrix=IMATRIX_FILE)
    if budget.kind == "preset":
        budget.limit = preset["file_bytes"]
    elif preset["file_bytes"] > budget.limit:  # the matrix's metadata took the few bytes the stand-in left
        logger.info("output.size: llama.cpp's %s with an importance matrix is %s bytes, over the budget; measured "
                    "beside no preset", preset["name"], f"{preset['file_bytes']:,}")
        path.unlink()
        budget.preset = None
        return []
    weights = sum(n // 2 for n in budget.layout.planned.values())
    top = PRESET_BPW[preset["name"]]
    below = sorted(((bpw, name) for name, bpw in PRESET_BPW.items() if bpw < top and name != preset["name"]
                    and budget.overhead + bpw * weights / 8 <= budget.limit), reverse=True)
    return [name for _, name in below[:RIVAL_FILES]]


def make_rival(name: str, matrix, workdir: Path, limit: int) -> dict | None:
    """llama.cpp's preset ``name`` from the F16 with the run's importance matrix, if its file fits ``limit``
    bytes (else None, and no file is left)."""
    from compressor.output.gguf.encode import PRESETS, quantize_file

    path = workdir / f"rival-{name}.gguf"
    try:
        quantize_file(workdir / F16_FILE, path, PRESETS[name], imatrix=matrix)
    except RuntimeError as exc:
        logger.info("output.size: llama.cpp's %s is not measured beside the file: %s", name, exc)
        path.unlink(missing_ok=True)
        return None
    if path.stat().st_size > limit:
        logger.info("output.size: llama.cpp's %s with an importance matrix is %s bytes, over the budget; not "
                    "measured", name, f"{path.stat().st_size:,}")
        path.unlink()
        return None
    return {**_preset(name, path), "chosen": "a smaller llama.cpp preset, measured beside the size's own"}


def convert_folder(request: WriteRequest, f16: Path, workdir: Path):
    """The F16 llama.cpp's converter makes of the source's Hugging Face folder (a hub model's files from the
    local cache), and its :class:`ConverterLayout`. A model object, or one whose folder holds no checkpoint, is
    saved into ``workdir`` first."""
    from compressor.output.gguf.converter import convert
    from compressor.output.gguf.metadata import pre_tokenizer_name

    src = request.source
    folder = None
    if src.is_local:
        folder = Path(src.path).expanduser()
    elif not src.in_memory and src.hub_id() is not None:
        from huggingface_hub import snapshot_download

        # the snapshot the model was loaded from (transformers records its commit), not whatever main is now
        folder = Path(snapshot_download(src.path, revision=getattr(request.model.config, "_commit_hash", None)))
    if src.in_memory or folder is None or not (folder / "config.json").is_file():
        folder = workdir / "hf"
        request.model.save_pretrained(folder)
        if request.tokenizer is not None:
            request.tokenizer.save_pretrained(folder)
    pre = pre_tokenizer_name(request.tokenizer) if request.tokenizer is not None else None
    return convert(folder, f16, workdir, pre_tokenizer=pre, named_after=request.model)


#: llama.cpp's presets' bits per weight on Llama-3-8B (:data:`~compressor.core.presets.LLAMA_CPP_PRESETS`): where
#: the search for the largest preset that fits a size starts. A small model's are higher, so each candidate is
#: made and its bytes read.
PRESET_BPW = {name: preset.bpw for name, preset in LLAMA_CPP_PRESETS.items()}
#: Presets made at most in that search (each is a llama-quantize of the F16).
PRESET_TRIES = 3


def largest_preset(f16: Path, limit: int, layout: Layout, workdir: Path) -> dict | None:
    """llama.cpp's largest preset whose file fits ``limit`` bytes, made from the F16 (what a user with that
    many bytes would ship, measured beside the plan); None when none of the tried ones fits."""
    from compressor.output.gguf.encode import PRESETS, quantize_file

    weights = sum(n // 2 for n in layout.planned.values())  # F16: two bytes a weight
    tries = 0
    for name, bpw in sorted(PRESET_BPW.items(), key=lambda kv: -kv[1]):
        if layout.data_offset + layout.fixed_bytes + bpw * weights / 8 > limit:
            continue
        path = workdir / f"{name}.gguf"
        quantize_file(f16, path, PRESETS[name], imatrix=stand_in(f16))
        if path.stat().st_size <= limit:
            return {**_preset(name, path), "chosen": "the largest llama.cpp preset that fits the size"}
        path.unlink()
        tries += 1
        if tries == PRESET_TRIES:
            break
    logger.info("output.size: no llama.cpp preset of at most %s bytes among the %d tried", f"{limit:,}", tries)
    return None
