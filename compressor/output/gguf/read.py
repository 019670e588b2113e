"""Reading a GGUF back: a source's tensor types (cached per file version), a written file's summary, and
its per-window negative log-likelihood in llama.cpp (llama-cpp-python)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
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
    :func:`compressor.evaluation.evaluate.perplexity` windows (only tokens the previous window did
    not score count). Returns (perplexity, scored tokens)."""
    sums, counts = llama_cpp_window_nll(path, tokens, seq_len, stride)
    return math.exp(sum(sums) / sum(counts)), int(sum(counts))


def llama_cpp_window_nll(path: Path, tokens: torch.Tensor, seq_len: int, stride: int) -> tuple[list[float], list[int]]:
    """Per window (as :func:`llama_cpp_perplexity` windows): the summed NLL of its scored tokens in
    llama.cpp, and how many it scored — what a paired comparison with another model needs."""
    scores = read_scores(path, tokens, seq_len, stride)
    return scores.nll, scores.tokens


@dataclass
class WindowScores:
    """A GGUF's per-window scores in llama.cpp: what the size gate pairs, window by window, with the original."""

    nll: list[float]
    """Summed NLL of each window's scored tokens."""
    tokens: list[int]
    """Scored tokens per window."""
    kl: list[float] | None = None
    """Summed KL(original ‖ file) per window (the teacher's top-k and tail, as the gate's KL), with a teacher."""
    agree: list[float] | None = None
    """Tokens per window whose most likely next token is the original's."""
    token_kl: np.ndarray | None = field(default=None, repr=False)
    """Every scored token's KL, in window order: the median and the 99th percentile."""

    def kl_summary(self) -> dict:
        """Mean, median and 99th-percentile KL per token and the same-top-token rate (``llama-perplexity
        --kl-divergence``'s figures); {} without a teacher."""
        if self.kl is None:
            return {}
        n = sum(self.tokens)
        return {"kl_mean": sum(self.kl) / n, "kl_median": float(np.median(self.token_kl)),
                "kl_p99": float(np.quantile(self.token_kl, 0.99)), "same_top_token": sum(self.agree) / n}


def read_scores(path: Path, tokens: torch.Tensor, seq_len: int, stride: int, teacher=None) -> WindowScores:
    """The GGUF at ``path`` in llama.cpp on ``tokens``' windows: per window its NLL and, with ``teacher``
    (the original's :class:`~compressor.evaluation.evaluate.TeacherCache` on the same tokens and windows),
    its KL from the original and agreeing tokens."""
    from compressor.evaluation.evaluate import kl_terms, windows

    ids_all = tokens.flatten().tolist()
    llm = _load(path, seq_len)
    out = WindowScores([], [], *(([], [], []) if teacher is not None else ()))
    try:
        for w, (begin, end, scored) in enumerate(windows(len(ids_all), seq_len, stride)):
            ids = ids_all[begin:end]
            llm.reset()
            llm.eval(ids)
            k = min(scored, len(ids) - 1)
            logp = torch.log_softmax(torch.from_numpy(np.asarray(llm.scores[len(ids) - 1 - k: len(ids) - 1],
                                                                 dtype=np.float32)).double(), dim=-1)
            target = torch.tensor(ids[len(ids) - k:])
            out.nll.append(float(-logp.gather(-1, target[:, None]).sum()))
            out.tokens.append(k)
            if teacher is not None:
                kl = kl_terms(logp.float(), teacher, w).double()
                out.kl.append(float(kl.sum()))
                out.agree.append(float((logp.argmax(-1) == teacher.topk_idx[int(teacher.offsets[w]):
                                                                             int(teacher.offsets[w + 1]), 0]).sum()))
                out.token_kl.append(kl.numpy())
    finally:
        llm.close()
    if teacher is not None:
        out.token_kl = np.concatenate(out.token_kl)
    return out


def _load(path: Path, seq_len: int):
    import llama_cpp

    with _CapturedOutput() as out:
        try:
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=seq_len, n_batch=seq_len, n_ubatch=seq_len,
                                  logits_all=True, n_threads=max(1, torch.get_num_threads()), verbose=False)
        except ValueError as e:
            failure = e
        else:
            return llm
    raise VerificationError(f"llama.cpp does not load {path.name} ({failure}):\n{out.tail()}")
