"""Reading a GGUF back: a source's tensor types (cached per file version), a written file's summary, and
its per-window negative log-likelihood in llama.cpp (llama-cpp-python)."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from compressor.output.base import VerificationError
from compressor.output.gguf.encode import _CapturedOutput
from compressor.output.gguf.naming import _FFN_TENSOR, _field, _gguf, _tensor_types


def source_tensor_types(path: str | Path) -> dict:
    """Tensor name → GGML type of the GGUF at ``path``, read once per file version: the checks before
    loading, the width check and the plan all ask about the same source (a 1 GB file's table)."""
    p = Path(path)
    st = p.stat()
    return dict(_source_types(str(p.resolve()), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _source_types(path: str, size: int, mtime_ns: int) -> dict:
    return _tensor_types(_gguf().GGUFReader(path))


def source_down_block(path: str | Path) -> int:
    """The quantization block a width must be a multiple of to keep the source's FFN down-projection
    types (the lcm over layers; 1 for float types)."""
    gguf = _gguf()
    types = {t for name, t in source_tensor_types(path).items() if name.endswith("ffn_down.weight")}
    return math.lcm(1, *(gguf.GGML_QUANT_SIZES[t][0] for t in types))


def gguf_summary(path: Path) -> dict:
    """Architecture, widths and tensor types read back from a written GGUF."""
    gguf = _gguf()
    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    ff = reader.fields[f"{arch}.feed_forward_length"].contents()
    types = _tensor_types(reader)
    ftype = int(_field(reader, "general.file_type") or 0)
    try:
        ftype_name = gguf.LlamaFileType(ftype).name
    except ValueError:
        ftype_name = str(ftype)
    down = {int(m.group(1)): types[name].name for name in types if (m := _FFN_TENSOR.match(name)) and
            m.group(2) == "down" and m.group(3) == "weight"}
    return {"architecture": arch, "ffn_widths": ff if isinstance(ff, list) else [ff] * len(down),
            "file_type": ftype_name, "ffn_down_types": [down[i] for i in sorted(down)]}


def llama_cpp_perplexity(path: Path, tokens: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """Perplexity of the GGUF at ``path`` in llama.cpp on ``tokens``, windowed exactly as
    :func:`compressor.evaluation.perplexity.perplexity` windows (only tokens the previous window did
    not score count). Returns (perplexity, scored tokens)."""
    sums, counts = llama_cpp_window_nll(path, tokens, seq_len, stride)
    return math.exp(sum(sums) / sum(counts)), int(sum(counts))


def llama_cpp_window_nll(path: Path, tokens: torch.Tensor, seq_len: int, stride: int) -> tuple[list[float], list[int]]:
    """Per window (as :func:`llama_cpp_perplexity` windows): the summed NLL of its scored tokens in
    llama.cpp, and how many it scored — what a paired comparison with another model needs."""
    scores = read_scores(path, tokens, seq_len, stride)
    return scores.nll, scores.tokens


def read_scores(path: Path, tokens: torch.Tensor, seq_len: int, stride: int, teacher=None):
    """The GGUF at ``path`` in llama.cpp on ``tokens``' windows: per window its NLL and, with ``teacher``
    (the original's :class:`~compressor.evaluation.teacher.TeacherCache` on the same tokens and windows),
    its KL from the original and agreeing tokens (:func:`~compressor.evaluation.external.window_scores`)."""
    from compressor.evaluation.external import window_scores

    llm = _load(path, seq_len)

    def logits(ids: list[int], k: int) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.asarray(llm.scores[len(ids) - 1 - k: len(ids) - 1], dtype=np.float32))
    try:
        return window_scores(logits, tokens, seq_len, stride, teacher)
    finally:
        llm.close()


def _load(path: Path, seq_len: int):
    import llama_cpp

    import logging

    # llama-cpp-python's log callback prints what this logger's level lets through: a failed load's reason too
    log = logging.getLogger("llama-cpp-python")
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        with _CapturedOutput() as out:
            try:
                llm = llama_cpp.Llama(model_path=str(path), n_ctx=seq_len, n_batch=seq_len, n_ubatch=seq_len,
                                      logits_all=True, n_threads=max(1, torch.get_num_threads()), verbose=False)
            except ValueError as e:
                failure = e
            else:
                return llm
    finally:
        log.setLevel(level)
    said = [line.strip() for line in out.text.splitlines() if "error" in line.lower() or "failed" in line.lower()]
    reason = "; ".join(said[-3:]) or out.tail(3) or "llama.cpp printed no reason"
    raise VerificationError(f"llama.cpp does not load {path.name} ({failure}): {reason}")
