"""The run's importance matrix as llama.cpp takes it: the imatrix GGUF that ``llama-quantize --imatrix`` reads,
and the same values handed to ``llama_model_quantize`` in-process.

``llama-imatrix`` writes, per weight matrix, the sum of each input column's squared activation
(``<name>.in_sum2``, F32 ``[n_mat, n_cols]``: one row per expert of a stacked ``ffn_*_exps``) and the tokens
summed (``<name>.counts``, F32 ``[n_mat, 1]``), with ``general.type: imatrix`` and ``imatrix.datasets`` /
``imatrix.chunk_count`` / ``imatrix.chunk_size`` (tools/imatrix/imatrix.cpp); ``llama-quantize`` hands ggml
``in_sum2 / counts`` per expert (tools/quantize/quantize.cpp ``load_imatrix``) through
``llama_model_quantize_params.imatrix``, an array of ``{name, data, size}`` ended by a null name.

The run's Ĥ diagonal is that mean squared activation (:mod:`compressor.engine.tensorstats`), kept scaled per
tensor by its largest column (:func:`compressor.sizing.sites._imatrix`); ggml's quantizers weigh an element's
error by these values' ratios only, so the sums written are those values times the calibration tokens, and
:meth:`ImportanceMatrix.values` divides them back in float32 as llama-quantize does. A preset made in-process
and one made by ``llama-quantize --imatrix`` from the file get the same numbers.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

#: Where a GGUF size run leaves the importance matrix, in its work folder and in the output. Not ``*.gguf``: the
#: output folder holds one model file, and llama.cpp tells the format by the content, not by the name.
IMATRIX_FILE = "model.imatrix"
#: What ``llama-quantize`` records in a preset made with an importance matrix (tools/quantize/quantize.cpp).
KV_FILE, KV_DATASET = "quantize.imatrix.file", "quantize.imatrix.dataset"
KV_ENTRIES, KV_CHUNKS = "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"


@dataclass
class ImportanceMatrix:
    """Per GGUF tensor name: ``in_sum2`` (float32 ``[n_mat, n_cols]``) and ``counts`` (float32 ``[n_mat, 1]``)."""

    sums: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0

    @classmethod
    def of(cls, priced: list, tokens: int, chunk_size: int, datasets: list[str]) -> "ImportanceMatrix":
        """From the run's priced tensors (:class:`~compressor.sizing.plan.Priced`: GGUF name and importance,
        ``[n_cols]`` or ``[n_expert, n_cols]``), measured over ``tokens`` calibration tokens in windows of
        ``chunk_size``."""
        tokens = max(int(tokens), 1)
        sums, counts = {}, {}
        for p in priced:
            v = np.asarray(p.imatrix, dtype=np.float64)
            v = v.reshape(-1, v.shape[-1])
            sums[p.name] = (v * tokens).astype(np.float32)
            counts[p.name] = np.full((v.shape[0], 1), float(tokens), dtype=np.float32)
        return cls(sums, counts, list(datasets), tokens // max(int(chunk_size), 1), int(chunk_size))

    @classmethod
    def uniform(cls, shapes: dict[str, tuple[int, ...]]) -> "ImportanceMatrix":
        """Every column weighted alike, for tensors of these GGUF shapes (``ne`` order: row length first, experts
        third): what makes a preset's file with llama.cpp's imatrix type mix before the statistics exist."""
        sums, counts = {}, {}
        for name, shape in shapes.items():
            n_mat = int(shape[2]) if len(shape) > 2 else 1
            sums[name] = np.ones((n_mat, int(shape[0])), dtype=np.float32)
            counts[name] = np.ones((n_mat, 1), dtype=np.float32)
        return cls(sums, counts)

    def fill(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Uniform entries, counted as this matrix's tokens, for the tensors of these shapes that have none."""
        counts = next(iter(self.counts.values()), np.ones((1, 1), dtype=np.float32))
        tokens = np.float32(counts.reshape(-1)[0])
        plain = ImportanceMatrix.uniform({n: s for n, s in shapes.items() if n not in self.sums})
        for name in plain.sums:
            self.sums[name], self.counts[name] = plain.sums[name] * tokens, plain.counts[name] * tokens

    def values(self) -> dict[str, np.ndarray]:
        """What llama-quantize hands ggml for each tensor: ``in_sum2 / counts`` per expert in float32 (ones where a
        count is zero), flattened to ``n_mat × n_cols``."""
        out = {}
        for name, s in self.sums.items():
            c = self.counts[name].astype(np.float32)
            v = np.where(c > 0, s.astype(np.float32) / np.where(c > 0, c, np.float32(1)), np.float32(1))
            out[name] = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
        return out

    def metadata(self, file_name: str) -> dict[str, str | int]:
        """The keys llama-quantize writes into a preset made with this matrix from the file ``file_name``."""
        out: dict[str, str | int] = {KV_FILE: file_name}
        if self.datasets:
            out[KV_DATASET] = self.datasets[0]
        out[KV_ENTRIES] = len(self.sums)
        if self.chunk_count > 0:
            out[KV_CHUNKS] = self.chunk_count
        return out

    def write(self, path: Path) -> Path:
        """The imatrix GGUF llama-imatrix writes (no architecture: it describes a model's inputs, not a model)."""
        import gguf

        w = gguf.GGUFWriter(str(path), arch="")
        w.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # gguf-py always adds one; llama-imatrix does not
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(self.datasets))
        w.add_uint32("imatrix.chunk_count", int(self.chunk_count))
        w.add_uint32("imatrix.chunk_size", int(self.chunk_size))
        for name in sorted(self.sums):
            w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(self.sums[name], dtype=np.float32))
            w.add_tensor(f"{name}.counts", np.ascontiguousarray(self.counts[name], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    @classmethod
    def read(cls, path: Path) -> "ImportanceMatrix":
        """An imatrix GGUF (llama-imatrix's or :meth:`write`'s), read with gguf-py."""
        import gguf

        r = gguf.GGUFReader(str(path))
        kind = r.get_field(gguf.Keys.General.TYPE)
        if kind is None or kind.contents() != "imatrix":
            raise ValueError(f"{path} is not an imatrix GGUF (general.type is "
                             f"{kind.contents() if kind is not None else 'missing'!r}, not 'imatrix')")
        sums, counts = {}, {}
        for t in r.tensors:
            data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
            if t.name.endswith(".in_sum2"):
                sums[t.name.removesuffix(".in_sum2")] = data
            elif t.name.endswith(".counts"):
                counts[t.name.removesuffix(".counts")] = data

        def scalar(key: str) -> int:
            f = r.get_field(key)
            return int(f.contents()) if f is not None else 0
        unpaired = sorted(set(sums) ^ set(counts))
        if unpaired:
            raise ValueError(f"{path}: sums without counts or counts without sums for {', '.join(unpaired[:5])}")
        datasets = r.get_field("imatrix.datasets")
        return cls(sums, counts, list(datasets.contents()) if datasets is not None else [],
                   scalar("imatrix.chunk_count"), scalar("imatrix.chunk_size"))


class CArrays:
    """``values`` (tensor name → float32 values) as llama.cpp's ``llama_model_imatrix_data`` array and ``metadata``
    as its ``llama_model_kv_override`` array, each ended as llama.cpp expects; the numpy buffers and names are
    held here for as long as the quantizer reads them."""

    def __init__(self, values: dict[str, np.ndarray], metadata: dict[str, str | int]) -> None:
        import llama_cpp

        self._keep = [np.ascontiguousarray(v, dtype=np.float32) for v in values.values()]
        self._names = [n.encode() for n in values]
        entries = [llama_cpp.llama_model_imatrix_data(n, v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size)
                   for n, v in zip(self._names, self._keep)]
        entries.append(llama_cpp.llama_model_imatrix_data(None, None, 0))  # the array's end: a null name
        self.imatrix = (llama_cpp.llama_model_imatrix_data * len(entries))(*entries)
        kvs = []
        for key, value in metadata.items():
            kv = llama_cpp.llama_model_kv_override()
            kv.key = key.encode()[:127]
            if isinstance(value, str):
                kv.tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
                kv.value.val_str = value.encode()[:127]
            else:
                kv.tag, kv.value.val_i64 = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT, int(value)
            kvs.append(kv)
        kvs.append(llama_cpp.llama_model_kv_override())  # the array's end: an empty key
        self.kv = (llama_cpp.llama_model_kv_override * len(kvs))(*kvs)

    def set_on(self, params) -> None:
        import llama_cpp

        params.imatrix = ctypes.cast(self.imatrix, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        params.kv_overrides = ctypes.cast(self.kv, ctypes.POINTER(llama_cpp.llama_model_kv_override))
