"""The :class:`GGUFWriter`: writes the plan it is handed, checks the file in llama.cpp."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from compressor.output.base import VerificationError, WriteRequest, Writer, Written
from compressor.output.gguf.check import planned_check, source_quant_check
from compressor.output.gguf.metadata import tokenizer_problem
from compressor.output.gguf.plan import (
    Requantized,
    Uniform,
    arch_refusal,
    check_options,
    compression_widths,
    down_blocks,
    width_error,
    writable,
    writer_plan,
)
from compressor.output.gguf.read import gguf_summary, llama_cpp_perplexity, source_tensor_types
from compressor.output.gguf.write import write_gguf

logger = logging.getLogger(__name__)

FILE_NAME = "model.gguf"
#: Relative perplexity tolerance of the llama.cpp check at unquantized types. Measured: see docs/gguf.md.
PPL_TOLERANCE = 5e-3
LLAMA_CPP_PIN = "llama-cpp-python==0.3.36"


def runtime_missing() -> str | None:
    """Why gguf-py or llama-cpp-python cannot be used (None when both can)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        return "the gguf format needs gguf-py: pip install 'compressor[gguf]' (or bash tools/setup.sh)"
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken build fails its import with anything
        return (f"the gguf format verifies its file in llama.cpp, but llama-cpp-python is not importable ({e}). "
                f"Install it with `bash tools/setup.sh` (builds {LLAMA_CPP_PIN} from source; cmake and a C++ "
                "compiler needed), or leave gguf out of output.formats")
    return None


class GGUFWriter(Writer):
    """``gguf``: ``model.gguf`` for llama.cpp and Ollama (Llama-family and Qwen2 models), verified by
    running it in llama.cpp. Options (``request.options``): ``quant`` (:data:`QUANTS`),
    ``unquantizable`` (:data:`UNQUANTIZABLE`)."""

    format = "gguf"
    description = f"one GGUF file for llama.cpp/Ollama ({', '.join(writable())}), checked in llama.cpp"
    source_suffix = ".gguf"
    verify_passes = 2  # the file in llama.cpp, and the source (or the preset) beside it

    def unsupported(self, model_type: str, kind: str) -> str | None:
        return arch_refusal(model_type) or runtime_missing()

    def source_refusal(self, model_type: str) -> str | None:
        """The architecture decides, not what is installed: the same recipe writes the same files."""
        return arch_refusal(model_type)

    def width_block(self, src, output) -> int:
        """The quantization block of ``gguf_quant``; for ``source``, that of a GGUF source's own FFN down
        projections (written at the source's types, a width must be a whole number of those blocks)."""
        from compressor.recipe.schema import GGML_BLOCK

        quant = getattr(output, "gguf_quant", "source")
        if quant != "source":
            return GGML_BLOCK.get(quant, 1)
        if not src.gguf_file:
            return 1
        try:
            from compressor.output.gguf.read import source_down_block

            return source_down_block(Path(src.path) / src.gguf_file)
        except ImportError:  # no gguf-py: the writer's own check names the missing package
            return 1

    def snap_grid(self, src, output) -> dict[int, str]:
        """Written at its source's quantization, each block's down projection keeps the source's quantized type."""
        if not src.gguf_file or getattr(output, "gguf_quant", "source") != "source":
            return {}
        try:
            from compressor.core.ggml import GGMLType
        except ImportError:  # no gguf-py: the writer's own check names the missing package
            return {}
        grid = {}
        for name, t in source_tensor_types(Path(src.path) / src.gguf_file).items():
            parts = name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2:] == ["ffn_down", "weight"]:
                known = GGMLType.known(t)
                if known is not None and known.quantized:
                    grid[int(parts[1])] = known.name
        return grid

    def check_options(self, options: dict) -> str | None:
        return check_options(options)

    def check_tokenizer(self, tokenizer, source) -> str | None:
        """Asked before the model loads: a GGUF source's tokenizer is copied; a Hugging Face one must be
        a byte-level BPE."""
        return None if source.gguf_file else tokenizer_problem(tokenizer)

    def check_widths(self, compression: dict, config: dict, source, options: dict) -> str | None:
        """Why the widths of a ``compression`` section cannot take the quantization (None when they can):
        for ``unquantizable: error``, asked as soon as the widths are known, before anything is written."""
        if options.get("unquantizable", "error") != "error":
            return None
        quant = options.get("quant", "source")
        types = {}
        if quant == "source":
            if not source.gguf_file:
                return None  # the saved float dtype: any width
            types = source_tensor_types(Path(source.path) / source.gguf_file)
        blocks = down_blocks(quant, int(config["num_hidden_layers"]), types)
        bad = [(i, w, blocks[i]) for i, w in sorted(compression_widths(compression, config).items()) if w % blocks[i]]
        return str(width_error(quant, bad)) if bad else None

    def plan(self, request: WriteRequest) -> Uniform | Requantized:
        """The writer's ``quant`` option as a plan (:func:`~.plan.writer_plan`)."""
        return writer_plan(request, _options(request))

    def write(self, request: WriteRequest, folder: Path, plan=None) -> Written:
        options = _options(request)
        if (problem := check_options(options)) is not None:
            raise ValueError(problem)
        path = Path(folder) / options.get("file", FILE_NAME)
        file_plan = self.plan(request) if plan is None else plan
        written = write_gguf(request, path, options, file_plan)
        how = f"{written.arch}, {written.quant}" if written is not None else "a GGUF re-quantized tensor by tensor"
        logger.info("gguf: wrote %s (%s, %.1f MB)", path.name, how, path.stat().st_size / 1e6)
        return Written(Path(folder), [path], file_plan)

    def verify(self, request: WriteRequest, written: Written) -> dict:
        """Perplexity in llama.cpp on the probe text. At f32/f16/bf16: within :data:`PPL_TOLERANCE` of
        the in-memory model's. At the source's own quantization (a GGUF source): no worse than the source
        file itself in llama.cpp, on the same windows, by more than the gate's budget. At another
        quantized type (no original at that type to compare with): finite, and recorded."""
        import llama_cpp

        options = _options(request)
        path = written.folder / options.get("file", FILE_NAME)
        file_plan = written.plan
        if file_plan.measured:
            return planned_check(path, request, options)
        quant = file_plan.quant
        same_quant = None
        if quant == "source" and request.gate is not None:
            # measured once: the gate domains' first is the probe (write_request), so it gives the probe's too
            same_quant = source_quant_check(path, request, options)
            first = same_quant["domains"][0]
            ppl, n = first["perplexity"], first["scored_tokens"]
        else:
            ppl, n = llama_cpp_perplexity(path, request.probe_tokens, request.probe_seq_len, request.probe_stride)
        expected = request.expected_ppl
        rel = abs(ppl - expected) / expected if expected else None
        exact = quant in ("f32", "f16", "bf16")
        if not math.isfinite(ppl) or (exact and (rel is None or rel > PPL_TOLERANCE)):
            raise VerificationError(
                f"llama.cpp check failed: {path.name} ({gguf_summary(path)['architecture']}, {quant}) has perplexity "
                f"{ppl:.5f} in llama.cpp, the in-memory model {expected:.5f} (relative tolerance {PPL_TOLERANCE:g}); "
                "nothing was published")
        check = {"runtime": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, **gguf_summary(path),
                 "quant": quant, "perplexity": ppl, "expected_perplexity": expected, "scored_tokens": n,
                 "relative_ppl_diff": rel, "relative_ppl_tolerance": PPL_TOLERANCE if exact else None,
                 "file_bytes": path.stat().st_size}
        if exact:
            check.update(compared_with="the in-memory model", passed=True)
        elif same_quant is not None:
            check.update(compared_with="the source GGUF at the same quantization, in llama.cpp, on every gate domain "
                         "(the gate's rule: upper confidence bound, paired by window)", **same_quant)
        else:
            # No original exists at this quantization to hold the file against: what is checked is that
            # llama.cpp runs it (finite perplexity); the change quantizing added is recorded, not judged.
            check.update(compared_with=None, checked="llama.cpp runs it (finite perplexity); not compared",
                         quantization_change=ppl / expected - 1.0 if expected else None)
        return check


def _options(request: WriteRequest) -> dict:
    """The gguf options: ``request.options['gguf']`` if given as a section, else the flat keys."""
    opts = dict(request.options or {})
    return dict(opts.get("gguf", opts))
