"""The GGUF size target: every weight matrix's GGML type, for an unmodified llama.cpp.

Options are ggml's types (:mod:`compressor.sizing.plan`), rounded by ggml's own quantizer with the
run's importance matrix or by error-compensating rounding onto its scales (:mod:`compressor.fitting.gridround`);
the budget is read off the F16 file written once (:mod:`.budget`), and the anchor is llama.cpp's preset of the
size made from that F16 by llama.cpp's own quantizer with an importance matrix from the run's own calibration
text (:mod:`.imatrix`: written into the output for ``llama-quantize --imatrix``), measured in llama.cpp on the
same windows, with up to two smaller presets beside it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Callable

from compressor.core.archs import ARCHITECTURES, LLAMA_CPP_TOOLS
from compressor.output.gguf.experts import MIN_EXPERT_TOKENS
from compressor.core.errors import InputError
from compressor.sizing.target import SizeTarget
from compressor.recipe.schema import SIZE_PRESETS

logger = logging.getLogger(__name__)


class GGUFTarget(SizeTarget):
    format = "gguf"
    presets = SIZE_PRESETS
    what = "the GGUF file"
    gptq_options = 16  # the offered types below COMPENSATED_BELOW_BPW that take it (7 of them block by block)
    keeps_priced_roundings = True
    rounds_side_by_side = True  # ggml's scale searches and numpy's GPTQ column loop
    streams = True
    plans_experts = True
    writes_f16 = True

    def __init__(self, output=None) -> None:
        super().__init__(output)
        self._arch: str | None = None
        self._converted = None  # the converter's layout, once the budget has made the F16 (a Hugging Face source)
        self._base = None  # that F16, which the plan's file re-quantizes
        self._stacks = None  # a layer's experts stacked in one tensor (:mod:`.experts`), with the converter's layout
        self._imatrix = None  # the run's importance matrix, llama.cpp's (:mod:`.imatrix`), once measured
        self._rivals: list[str] = []  # smaller presets to measure beside the size's own
        self._workdir: Path | None = None

    def anchor_called(self, name: str) -> str:
        from compressor.output.gguf.budget import PRESET_CALLED

        return PRESET_CALLED.format(name=name)

    def refusal(self, model_type: str, src, config=None) -> str | None:
        """A GGUF source is re-quantized in its own architecture, which any llama.cpp-loadable model type with
        a tensor-name map allows; a Hugging Face folder is planned in the F16 llama.cpp's converter makes of it,
        so any architecture the converter converts (:func:`~compressor.output.gguf.converter.refusal`)."""
        from compressor.output.gguf.naming import REQUANTIZE_ARCH
        from compressor.output.gguf.plan import arch_refusal
        from compressor.output.gguf.writer import runtime_missing
        from compressor.output.gguf.converter import refusal

        if src.gguf_file:
            return runtime_missing() or (None if model_type in REQUANTIZE_ARCH else arch_refusal(model_type))
        if config is None:
            return arch_refusal(model_type) or runtime_missing()
        spec = ARCHITECTURES.get(model_type)
        if spec is None:  # not loaded at all: say so before llama.cpp's converter is asked
            return (f"model type {model_type!r} has no row in compressor's architecture table (ARCHITECTURES in "
                    f"compressor/core/archs.py; rows: {', '.join(sorted(ARCHITECTURES))}), so it is not loaded; "
                    f"{LLAMA_CPP_TOOLS}, or add a row")
        if spec.int_refusal:  # its weights are not nn.Linear: no statistics to price them
            return (f"model type {model_type!r} is not planned as GGUF: {spec.int_refusal}, whose inputs and outputs "
                    f"the size statistics measure; {LLAMA_CPP_TOOLS}")
        return runtime_missing() or refusal(config)

    def writer_refusal(self, why: str | None, src) -> str | None:
        """A size plan's file is a re-quantized GGUF (the source, or the converter's F16 of a folder): the
        writer's own architecture table does not apply (:meth:`refusal` says what does)."""
        return None

    def namer(self, model) -> Callable[[str], str | None]:
        if self._converted is None:
            return gguf_namer(model)
        return lambda hf: self._converted.gguf_name(self._stacks.checkpoint_name(hf))

    def price_all(self, sites: list, rounding: str, kept=None) -> dict:
        """Every site in every GGML type; a stack of experts (one GGUF tensor) as the sum over its experts,
        priced once all of them are measured (:mod:`.experts`)."""
        from compressor.output.gguf.pricing import price_all

        stacked = [s for s in sites if self._stacked(s.name)]
        single = [s for s in sites if not self._stacked(s.name)]
        units = price_all(single, rounding=rounding, kept=kept) if single else {}
        if stacked:
            units.update(self._stacks.price(stacked, lambda parts: price_all(parts, rounding="nearest")))
        return units

    def priced(self, sites: list) -> list:
        from compressor.sizing.plan import Priced

        out = [Priced.of(s) for s in sites if not self._stacked(s.name)]
        return out + (self._stacks.priced(sites) if self._stacks is not None else [])

    def apart(self, name: str) -> bool:
        """A stack of experts is priced once all its experts' sites are in (:class:`~.experts.ExpertStacks`, on
        rank 0); every other tensor alone."""
        return not self._stacked(name)

    def _stacked(self, name: str) -> bool:
        """Whether GGUF tensor ``name`` stacks several weights (a layer's experts)."""
        return self._stacks is not None and self._stacks.stacked(name)

    def report(self) -> dict:
        """Tokens per expert of every stacked tensor, and the experts priced as their layer's average."""
        if self._stacks is None or not self._stacks.report:
            return {}
        return {"experts": {"min_tokens": MIN_EXPERT_TOKENS, "tensors": self._stacks.report,
                            "not_planned": self._stacks.incomplete()}}

    def store(self, name: str, option: str, raw, request):
        """Bytes GPTQ made in the weight's row order (:meth:`round_full`'s, or pricing's), in the file's."""
        from compressor.output.gguf.naming import to_file_rows
        from compressor.output.gguf.plan import file_arch

        if self._converted is not None:
            return self._converted.to_file_rows(name, raw)
        if self._arch is None:
            self._arch = file_arch(request)
        return to_file_rows(name, raw, self._arch, request.model.config)

    def payload(self, name: str, weighted: bool, compensated: bool):
        from compressor.core.ggml import GGMLType
        from compressor.sizing.plan import Choice

        return Choice(GGMLType[name], weighted, compensated)

    def cache_settings(self) -> dict:
        from compressor.output.gguf.pricing import DEFAULT_TYPES
        from compressor.sizing.sites import MAX_PRICED_ELEMENTS

        return {"types": [t.name for t in DEFAULT_TYPES], "max_elements": MAX_PRICED_ELEMENTS}

    def budget(self, size, request, workdir: Path):
        from compressor.output.gguf.budget import measure_budget

        from compressor.core.moe import checkpoint_name
        from compressor.output.gguf.experts import ExpertStacks

        budget = measure_budget(size, request, workdir)
        self._converted, self._base = budget.converted, budget.base
        if budget.converted is not None:
            model_type = str(request.model.config.model_type)
            # a partial, not a lambda: the target crosses to the other ranks under torchrun (pickled)
            self._stacks = ExpertStacks(budget.converted.parts, functools.partial(checkpoint_name, model_type))
        if budget.converted is not None and (kept := budget.converted.unplanned()):
            logger.info("output.size: %d tensors are not one Hugging Face weight each and stay as llama.cpp's "
                        "converter wrote them: %s", len(kept), ", ".join(kept[:6]) + (" …" if len(kept) > 6 else ""))
        return budget

    def file_plan(self, plan, request):
        """The plan's types re-quantizing llama.cpp's converter's F16 of a Hugging Face folder (its unplanned
        tensors copied as the converter wrote them), or the GGUF source (in F16 where not planned)."""
        from compressor.output.gguf.plan import Requantized

        if self._base is not None:
            return Requantized(Path(self._base), dict(plan.types), plan.imatrix, None, plan.stored)
        source = Path(request.source.path) / request.source.gguf_file
        return Requantized(source, dict(plan.types), plan.imatrix, "F16", plan.stored)

    def round_full(self, name: str, option: str, weight, h, priced, request, alongside: list[str] | None = None):
        """GPTQ onto the type's importance-weighted scales (IQ1_*, IQ2_*, IQ3_*: ggml's blocks one at a time, each
        block's error carried into the rest; each such type alone), its raw bytes in the file's row order.
        ``alongside``: the types pricing rounded this tensor in together (``option`` among them): rounded together
        again, so the bytes are pricing's to the bit (one column loop for several types sums in another order than
        one for a type alone, and a near-tie can round the other way)."""
        from compressor.core.ggml import GGMLType
        from compressor.fitting.gridround import gptq_quantize_many

        types = [GGMLType[t] for t in (alongside or [option])]
        raws = gptq_quantize_many(weight, h, types, priced.imatrix)
        return self.store(name, option, raws[types.index(GGMLType[option])], request)

    def measure_anchor(self, run, preset: dict) -> dict:
        """The preset file in llama.cpp on each gate domain's windows (with the KL from the original where the
        domain carries its teacher)."""
        from compressor.output.gguf import read  # the module

        return {d["name"]: read.read_scores(Path(preset["path"]), d["tokens"], d["seq_len"], d["stride"],
                                            d.get("teacher"))
                for d in run.request.options.get("gate_domains") or []}

    def measured(self, budget, priced: list, calibration, windows, workdir: Path) -> None:
        """The run's importance matrix (Ĥ's diagonal, llama-imatrix's statistic) written as llama.cpp's imatrix
        GGUF, and the preset made again with it (:func:`~.budget.with_importance`)."""
        from compressor.output.gguf.budget import with_importance
        from compressor.output.gguf.imatrix import ImportanceMatrix

        self._workdir = workdir
        self._imatrix = ImportanceMatrix.of(priced, int(windows.numel()), int(windows.shape[-1]),
                                            _dataset_names(calibration))
        self._rivals = with_importance(budget, self._imatrix, workdir)
        if budget.preset is not None:
            logger.info("output.size: %s is %s bytes%s", self.anchor_called(budget.preset["name"]),
                        f"{budget.preset['file_bytes']:,}",
                        f"; measured beside it too: {', '.join(self._rivals)}" if self._rivals else "")

    def measure_rivals(self, run, preset: dict) -> list[tuple[dict, dict]]:
        """Each smaller preset, made with the run's importance matrix, measured like the anchor and removed
        (one at a time: the work folder holds one more preset at most)."""
        from compressor.output.gguf.budget import make_rival

        out = []
        for name in self._rivals if self._imatrix is not None else []:
            rival = make_rival(name, self._imatrix, self._workdir, run.budget.limit)
            if rival is None:
                continue
            try:
                out.append((rival, self.measure_anchor(run, rival)))
            finally:
                Path(rival.pop("path")).unlink(missing_ok=True)
        return out

    def output_files(self) -> dict[str, Path]:
        """The run's importance matrix, for ``llama-quantize --imatrix`` (the preset beside the file, remade)."""
        from compressor.output.gguf.imatrix import IMATRIX_FILE

        path = self._workdir / IMATRIX_FILE if self._workdir is not None else None
        return {IMATRIX_FILE: path} if path is not None and path.is_file() else {}

    # the report's words for a GGUF (compressor.reports.wording)
    runs_in = "llama.cpp"
    choices = "tensor types"

    def shipped(self, folder: Path) -> Path:
        from compressor.output.gguf.writer import FILE_NAME

        return folder / FILE_NAME

    def beside(self, preset: dict) -> str:
        """llama.cpp's preset, made from the F16 the plan re-quantizes."""
        return f"{super().beside(preset)} from the same F16"

    def check_line(self, check: dict, size: dict) -> str | None:
        """A GGUF written as it is: its perplexity in llama.cpp against the source GGUF's (a GGUF source), else its
        bytes and type, and what quantizing cost against the float model when nothing judged it."""
        from compressor.engine.cache import human_bytes

        if check.get("source_perplexity") is not None:
            return (f"llama.cpp: perplexity {check['perplexity']:.4f} against the source GGUF's "
                    f"{check['source_perplexity']:.4f} ({100 * check['source_relative_change']:+.2f} %, same windows)")
        if size.get("gguf_bytes") is None:
            return None
        q = check.get("quantization_change")
        note = (f", {100 * q:+.2f} % against the float model: quantizing costs this, not judged"
                if check.get("compared_with") is None and q is not None else "")
        return (f"gguf: {human_bytes(size['gguf_bytes'])} ({check.get('file_type', '?')}; llama.cpp perplexity "
                f"{check.get('perplexity', float('nan')):.4f}{note})")

    def card_words(self) -> dict[str, str]:
        return {
            "file": "one GGUF file, `model.gguf`, of {bytes:,} bytes",
            "choice": "every weight matrix's GGML type",
            "where": "in llama.cpp",
            "anchor": "llama.cpp's {name} + imatrix",
            "anchor_line": (
                "llama.cpp's own {name} of the same F16 with an importance matrix ({bytes:,} bytes; the matrix, "
                "from the same calibration text, is `model.imatrix`: `llama-quantize --imatrix model.imatrix` "
                "takes it)"
            ),
            "unchanged": "the GGUF's tensor types",
            "best_line": (
                "{called} is of no more bytes ({bytes:,}) and better on the gate's text; the file against it: "
                '{rows}. The gate\'s "at least as good as the preset" compares with it.\n'
            ),
            "load": (
                '```bash\nllama-cli -m model.gguf -p "Once upon a time"\n```\n\n'
                '```python\nfrom llama_cpp import Llama\nllm = Llama(model_path="model.gguf")\n```'
            ),
            "library": "gguf",
        }


def _dataset_names(calibration) -> list[str]:
    """The calibration's sources as the imatrix records them (llama-imatrix: its text file's name); a local
    path by its file name only (a file shared with others names no folder of the user's)."""
    sources = calibration.dataset if isinstance(calibration.dataset, list) else [calibration.dataset]
    names = [str(getattr(s, "source", s)) for s in sources]
    return [Path(n).name if ("/" in n and Path(n).expanduser().exists()) else n for n in names]


def gguf_namer(model) -> Callable[[str], str | None]:
    """Hugging Face parameter name → GGUF tensor name (gguf-py's map for the model's architecture)."""
    import gguf

    from compressor.output.gguf.naming import REQUANTIZE_ARCH

    cfg = getattr(model.config, "text_config", None) or model.config
    model_type = str(cfg.model_type).removeprefix("compressed_")
    if model_type not in REQUANTIZE_ARCH:
        raise InputError(f"output.size: no GGUF tensor names are mapped for model type {model_type!r} "
                         f"(mapped: {', '.join(sorted(REQUANTIZE_ARCH))})")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, REQUANTIZE_ARCH[model_type]), cfg.num_hidden_layers)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))

    def name(hf: str) -> str | None:
        out = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        return None if out is None or (tied and out == "output.weight") else out
    return name
