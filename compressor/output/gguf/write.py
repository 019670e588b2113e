"""Writing the file: the plan's tensors in their types with the metadata, or a GGUF source re-quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from compressor.core import ggml
from compressor.core.threads import side_by_side, workers
from compressor.output.base import WriteRequest
from compressor.output.gated import NotRepresentableError
from compressor.output.gguf.encode import _FTYPES, encode, quantize_file
from compressor.output.gguf.metadata import copy_source_metadata, hf_hparams, hf_tokenizer_metadata
from compressor.output.gguf.naming import _FFN_TENSOR, Tensor, _field, _gguf, _sort_key, _tensor_types
from compressor.output.gguf.plan import Plan, Requantized, Uniform, plan_for, writer_plan
from compressor.output.gguf.tensors import ffn_tensors, model_tensors, source_tensors


def stream(writer, ordered: list[Tensor], qtype_of, payload) -> None:
    """Write the header, metadata and every tensor's info (each payload's type and bytes are known before its
    values are read), then the tensors' data in ``ordered``'s order, encoded a few at a time side by side
    (ggml's quantizer and numpy's casts release the GIL): at most that many tensors are held, so the model
    is never copied whole (an 8B's float32 tensors would be 32 GB)."""
    infos = [_info(t.dims if t.raw_type is None else None, t, qtype_of(t)) for t in ordered]
    for t, (shape, dtype, nbytes, raw_dtype) in zip(ordered, infos):
        writer.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    step = max(1, workers())
    for first in range(0, len(ordered), step):
        chunk = ordered[first:first + step]
        for t, info, data in zip(chunk, infos[first:first + step], side_by_side(payload, chunk)):
            data = np.ascontiguousarray(data)
            if data.nbytes != info[2]:
                raise ValueError(f"{t.name}: {data.nbytes} bytes to write, {info[2]} announced in its header")
            writer.write_tensor_data(data if data.dtype == info[1] else data.view(info[1]))
    writer.close()


def _info(dims, t: Tensor, qtype) -> tuple:
    """``(shape, numpy dtype, bytes, GGML type)`` of a tensor's payload, as gguf-py's ``add_tensor_info`` takes
    them (quantized types: the byte shape ``[..., row bytes]`` of uint8)."""
    Q = _gguf().GGMLQuantizationType
    if dims is None:  # a source's raw bytes, as they are
        return t.data.shape, t.data.dtype, t.data.nbytes, qtype
    n = int(np.prod(dims))
    if qtype == Q.F32:
        return dims, np.dtype(np.float32), 4 * n, qtype
    if qtype == Q.F16:
        return dims, np.dtype(np.float16), 2 * n, qtype
    row = ggml.bytes_per_row(ggml.GGMLType(int(qtype)), dims[-1])
    shape = (*dims[:-1], row)
    return shape, np.dtype(np.uint8), int(np.prod(shape)), qtype


def write_requantized(source: Path, path: Path, types: dict[str, str], imatrix: dict[str, np.ndarray] | None = None,
                      default: str | None = "F16", stored: dict[str, tuple[str, np.ndarray]] | None = None) -> None:
    """The GGUF at ``source`` with every tensor of two or more dimensions dequantized (gguf-py) and written
    in ``types[name]`` (else ``default``) by ggml's quantizer with ``imatrix[name]`` as column weights, or
    as ``stored[name]``'s raw bytes when given in that type (error-compensating rounding, already in the
    file's row order); 1-D tensors in F32; metadata (tokenizer, chat template) copied. ``default`` None: a
    tensor not in ``types`` is copied as the source stores it (bytes and type). The source's own
    architecture and layout: the tensors are read as llama.cpp stores them, so nothing is renamed or
    permuted."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    reader = gguf.GGUFReader(source)
    arch = _field(reader, "general.architecture")
    writer = gguf.GGUFWriter(str(path), arch)
    copy_source_metadata(writer, reader, arch, {"general.file_type", "general.quantization_version"})
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if not types else gguf.LlamaFileType.GUESSED))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    ordered = [Tensor(t.name, None, load=_dequantizer(t), shape=tuple(int(d) for d in reversed(t.shape)))
               for t in reader.tensors]
    as_stored = {t.name: t for t in reader.tensors if default is None and t.name not in types}

    def qtype_of(t: Tensor):
        if t.name in as_stored:
            return as_stored[t.name].tensor_type
        if len(t.dims) < 2 or int(np.prod(t.dims[:-1])) == 1:
            return Q.F32
        return getattr(Q, types.get(t.name, default))

    def payload(t: Tensor):
        if t.name in as_stored:
            return np.asarray(as_stored[t.name].data)
        data, qtype = t.values(), qtype_of(t)
        if qtype == Q.F32:
            return data
        raw = (stored or {}).get(t.name)
        if raw is not None and raw[0] == qtype.name:
            return np.ascontiguousarray(raw[1], dtype=np.uint8).reshape(*data.shape[:-1], -1)
        if qtype == Q.F16:
            return encode(data, qtype)
        weights = (imatrix or {}).get(t.name)
        if weights is not None and np.ndim(weights) == 2:  # stacked experts: each with its own importance matrix
            return np.stack([encode(np.ascontiguousarray(data[e]).reshape(-1, data.shape[-1]), qtype, weights[e])
                             for e in range(data.shape[0])]).reshape(*data.shape[:-1], -1)
        return encode(data.reshape(-1, data.shape[-1]), qtype, weights).reshape(*data.shape[:-1], -1)

    stream(writer, ordered, qtype_of, payload)


def _dequantizer(t):
    """A GGUF tensor's float32 values, read from the memory-mapped source when called."""
    def load() -> np.ndarray:
        return np.asarray(_gguf().quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return load


def write_gguf(request: WriteRequest, path: Path, options: dict,
               file_plan: Uniform | Requantized | None = None) -> Plan | None:
    """Write ``file_plan`` (default: the plan ``options`` give, :func:`~.plan.writer_plan`) of ``request.model`` to
    ``path``; returns what was written from the model (None for a re-quantized file)."""
    gguf = _gguf()
    file_plan = file_plan if file_plan is not None else writer_plan(request, options)
    if isinstance(file_plan, Requantized):
        write_requantized(file_plan.source, path, dict(file_plan.types), file_plan.imatrix, default=file_plan.default,
                          stored=file_plan.stored)
        return None
    plan = plan_for(request, options, file_plan.quant)
    source = request.source
    meta = gguf.GGUFReader(Path(source.path) / source.gguf_file) if source.gguf_file else None
    final_quant = plan.quant in ("q8_0", "q4_k_m")
    tmp = path.with_name(path.name + ".f16.tmp") if final_quant else path
    writer = gguf.GGUFWriter(str(tmp), plan.arch)
    tensors, types = _metadata_and_tensors(writer, request, plan, meta, final_quant)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    stored = options.get("stored") or {}  # fits snapped onto the file's grid (compressor.fitting.snap)

    def qtype_of(t: Tensor):
        if t.raw_type is not None:
            return t.raw_type
        if _stored_fits(t, plan, types, stored):
            return getattr(gguf.GGMLQuantizationType, stored[t.name][0])
        return _target_type(t, plan, types)

    def payload(t: Tensor):
        """Tensor ``t``'s bytes as the file stores them (read from the model only now)."""
        if t.raw_type is not None:
            return t.data
        if (raw := _stored_bytes(t, plan, types, stored)) is not None:
            return raw[1]
        return encode(t.values(), qtype_of(t))

    stream(writer, sorted(tensors, key=lambda t: _sort_key(t.name)), qtype_of, payload)
    if final_quant:
        try:
            llama_quantize(tmp, path, plan)
        finally:
            tmp.unlink(missing_ok=True)
    return plan


def _metadata_and_tensors(writer, request: WriteRequest, plan: Plan, meta, final_quant: bool) -> tuple[list, dict]:
    """Write every key but the quantization version; return the tensors to write and, at ``source``
    quantization, the source's tensor types (else ``{}``)."""
    gguf = _gguf()
    config, source, n = request.model.config, request.source, len(plan.ffns)
    tensors: list[Tensor] = []
    if meta is not None:  # a GGUF source: its metadata, tokenizer and chat template as they are
        copy_source_metadata(writer, meta, plan.arch, {f"{plan.arch}.feed_forward_length", "general.file_type",
                                                       "general.quantization_version"})
    else:
        if request.tokenizer is None:
            raise NotRepresentableError("the gguf format needs the tokenizer; none was loaded")
        writer.add_name(Path(source.path).name or "compressed")
        tensors += hf_hparams(writer, config)
        hf_tokenizer_metadata(writer, request.tokenizer, config.vocab_size)
    writer.add_feed_forward_length(plan.widths if plan.arch == "deci" else plan.widths[0])
    if plan.quant == "source":  # only for a GGUF source: its tensors as they are, new FFNs in its types
        writer.add_file_type(int(_field(meta, "general.file_type") or 0))
        tensors += source_tensors(meta, plan, config) + ffn_tensors(plan, [i for i in range(n) if plan.replaced[i]])
        return tensors, _tensor_types(meta)
    writer.add_file_type(int(getattr(gguf.LlamaFileType, _FTYPES["f16" if final_quant else plan.quant])))
    tensors += model_tensors(request.model, plan) + ([] if plan.unchanged else ffn_tensors(plan, range(n)))
    if meta is not None:  # tensors that are not model weights (Llama 3's rope_freqs)
        have = {t.name for t in tensors}
        tensors += [t for t in source_tensors(meta, plan, config) if t.name not in have
                    and not _FFN_TENSOR.match(t.name) and t.raw_type == gguf.GGMLQuantizationType.F32]
    return tensors, {}


def llama_quantize(src: Path, dst: Path, plan: Plan) -> None:
    """llama.cpp's own quantizer (its per-tensor mix for the file type); down projections of
    ``plan.kept_f16`` stay F16."""
    quantize_file(src, dst, _FTYPES[plan.quant], plan.kept_f16)


def _target_type(t: Tensor, plan: Plan, source_types: dict):
    """The GGML type tensor ``t`` (float32 values) is written in."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if len(t.dims) == 1:
        return Q.F32
    if (m := _FFN_TENSOR.match(t.name)) and m.group(2) == "down" and int(m.group(1)) in plan.kept_f16:
        return Q.F16
    if plan.quant == "source":
        return source_types.get(t.name, Q.F16)
    # q8_0 / q4_k_m: F16 first, llama.cpp's quantizer after
    return {"f32": Q.F32, "bf16": Q.BF16}.get(plan.quant, Q.F16)


def _stored_fits(t: Tensor, plan: Plan, source_types: dict, stored: dict) -> bool:
    """Whether ``stored`` holds ``t``'s bytes in the type the plan writes it in, of its shape."""
    if t.name not in stored:
        return False
    name, raw = stored[t.name]
    qtype = _target_type(t, plan, source_types)
    rows, width = int(np.prod(t.dims[:-1])), t.dims[-1]
    return qtype.name == name and tuple(raw.shape) == (rows, ggml.bytes_per_row(ggml.GGMLType[name], width))


def _stored_bytes(t: Tensor, plan: Plan, source_types: dict, stored: dict):
    """``(GGML type, bytes)`` of a fit snapped onto the file's grid (:mod:`compressor.fitting.snap`), when the
    plan stores ``t`` in that type and the bytes hold ``t``'s shape; else None (quantized here)."""
    if not _stored_fits(t, plan, source_types, stored):
        return None
    name, raw = stored[t.name]
    raw = raw.numpy() if hasattr(raw, "numpy") else np.asarray(raw)
    return _target_type(t, plan, source_types), np.ascontiguousarray(raw, dtype=np.uint8)
