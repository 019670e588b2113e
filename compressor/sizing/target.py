"""What a size plans *into*: the :class:`SizeTarget` each format that a size can plan provides.

The size stage (plan → allocate → write → gate → back off) is the same for every file a user ships; what
differs by format is a short list, and each format says it once, in its own module:

* which architectures it can plan (:meth:`SizeTarget.refusal`) and which weights it plans (:meth:`namer`);
* the options of a weight — a GGML type, an integer scheme — with their exact bytes and closed-form
  predicted cost (:meth:`price_all`), and the full-row error-compensating rounding of a chosen one
  (:meth:`round_full`);
* the budget: what a size's name means for this model and the exact bytes of a plan (:meth:`budget`);
* the anchor measured beside the file: what the user would otherwise ship at that size
  (:meth:`measure_anchor` — llama.cpp's preset for a GGUF; the uniform scheme for compressed-tensors).

The writer of the same format writes the plan it is handed as an argument (:meth:`SizeTarget.file_plan`;
:meth:`~compressor.output.base.Writer.write`) and measures the file where
it runs (its ``verification`` entry: ``quant: plan`` and per gate domain its window scores). A format's target
lives in the format's package (:mod:`compressor.output.gguf.target`, :mod:`compressor.output.ctensors.target`)
and is registered with its writer as one :class:`~compressor.output.registry.Format`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ClassVar

import torch

from compressor.policy.options import Option


class SizeTarget:
    """One format a size plans. Subclasses set :attr:`format` (the writer's name) and :attr:`presets`."""

    format: ClassVar[str] = ""
    presets: ClassVar[tuple[str, ...]] = ()
    """Size names that mean "the size of this anchor for this model" (``Q4_K_M``, ``W4A16``)."""
    what: ClassVar[str] = ""
    """The file, in words, for messages ("the GGUF file")."""
    gptq_options: ClassVar[int] = 0
    """Options per weight priced with error-compensating rounding (for the run-time estimate)."""
    full_roundings: ClassVar[int] = 1
    """Chosen options per weight rounded over all rows by the run: the file's, and the anchor's if the run
    makes it (for the run-time estimate)."""
    keeps_priced_roundings: ClassVar[bool] = False
    """Whether :meth:`price_all` offers the full-row roundings it makes to ``kept`` (for the run-time
    estimate: those tensors are not rounded again)."""
    rounds_side_by_side: ClassVar[bool] = False
    """Whether :meth:`round_full` of several layers may run at once, one per core (single-threaded numpy and ggml
    work that releases the GIL); False: one at a time (a torch GPTQ, on torch's own threads)."""
    writes_f16: ClassVar[bool] = False
    """Whether the budget writes the model's F16 and the anchor file into the work folder (for its disk check)."""
    reload_check: ClassVar[bool] = False
    """Whether the planned file is checked by reloading the whole model in transformers (for the memory model,
    :func:`compressor.engine.memory.size_components`)."""
    plans_experts: ClassVar[bool] = False
    """Whether a mixture of experts is planned into this format expert by expert (a file its runtime loads)."""
    streams: ClassVar[bool] = False
    """Whether a size plans this format with the decoder layers onloaded (``model.offload: disk``, or ``cpu``
    with ``device: cuda``): statistics, pricing, rounding and the file made one layer or tensor at a time."""
    heldout_prices: ClassVar[bool] = False
    """Price error-compensating rounding cross-fitted on two halves of the calibration windows
    (:meth:`~compressor.sizing.sites.Site.fit_pairs`) rather than on the Ĥ it is fitted to."""

    def __init__(self, output=None) -> None:
        """``output``: the recipe's ``output`` section (:class:`~compressor.recipe.schema.OutputConfig`), from
        which a target reads its own settings when it is made; None: their defaults."""

    def anchor_called(self, name: str) -> str:
        """The anchor of size ``name``, in words ("llama.cpp's Q4_K_M")."""
        return name

    def refusal(self, model_type: str, src, config=None) -> str | None:
        """Why a size cannot be planned into this format for ``model_type`` from ``src`` (None: it can);
        ``config``: the model's config, where the caller has it."""
        return None

    def writer_refusal(self, why: str | None, src) -> str | None:
        """This format's writer's refusal as a size plan sees it (default: as it is)."""
        return why

    def namer(self, model) -> Callable[[str], str | None]:
        """Hugging Face parameter name → the planned tensor's name (None: not planned, kept as the writer
        keeps it)."""
        raise NotImplementedError

    def apart(self, name: str) -> bool:
        """Whether planned tensor ``name`` can be priced apart from the other tensors of its group, on another
        rank (:mod:`compressor.pipeline.size.share`); False: priced on rank 0 with all of them (default True)."""
        return True

    def price_all(self, sites: list, rounding: str, kept=None) -> dict[str, list[Option]]:
        """Every site's options: exact bytes and predicted loss increase, priced with the rounding each gets.
        ``kept``: a :class:`~compressor.sizing.plan.Rounded` offered the bytes of roundings made over every
        row of a tensor while pricing it, for :meth:`store` (a target may offer none)."""
        raise NotImplementedError

    def store(self, name: str, option: str, raw, request):
        """What :meth:`round_full` returns, from bytes that pricing kept (:meth:`price_all`'s ``kept``); only
        called for what the target offered."""
        raise NotImplementedError

    def spill(self, raw, path: Path, at_least: int):
        """What :meth:`round_full` (or :meth:`store`) returned, written to ``path`` (plus a suffix) and mapped back
        from disk when it holds at least ``at_least`` bytes, else ``raw`` itself: file pages rather than the run's
        memory until the file is written. Default: a numpy array (a GGUF tensor's bytes) as ``.npy``."""
        import numpy as np

        if not isinstance(raw, np.ndarray) or raw.nbytes < at_least:
            return raw
        path = path.with_name(path.name + ".npy")
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, raw)
        return np.load(path, mmap_mode="r")

    def priced(self, sites: list) -> list:
        """What planning keeps of the priced sites, one :class:`~compressor.sizing.plan.Priced` per unit
        of the allocation (default: per site)."""
        from compressor.sizing.plan import Priced

        return [Priced.of(s) for s in sites]

    def report(self) -> dict:
        """What the report's ``size_plan`` adds for this format once the prices are measured (default nothing)."""
        return {}

    def payload(self, name: str, weighted: bool, compensated: bool):
        """A cached option's :class:`~compressor.sizing.plan.Choice` from its name and flags."""
        raise NotImplementedError

    def cache_settings(self) -> dict:
        """What the prices depend on besides the model and the calibration (part of their cache key)."""
        return {"format": self.format}

    def budget(self, size, request, workdir: Path):
        """``size`` (:class:`~compressor.recipe.schema.Size`, parsed when the recipe loaded) resolved for this model:
        a :class:`~compressor.sizing.budget.Budget`."""
        raise NotImplementedError

    def round_full(self, name: str, option: str, weight: torch.Tensor, h: torch.Tensor, priced, request,
                   alongside: list[str] | None = None):
        """A chosen compensated option over all rows of ``weight`` (GPTQ through ``h``, Ĥ's act-order
        :func:`~compressor.fitting.gridround.factor`, one per layer shared by its options): what the writer
        stores as it is (:attr:`SizePlan.stored`). ``alongside``: the options pricing rounded this tensor in
        together over all its rows, when it did (a target that keeps pricing's roundings rounds them together
        again, so that a run with cached prices writes the same bytes)."""
        raise NotImplementedError

    def file_plan(self, plan, request):
        """The writer's plan for the size plan ``plan`` (:class:`~compressor.sizing.plan.SizePlan`), in the
        format's own terms: what the size stage hands the writer (:meth:`~compressor.output.base.Writer.write`)."""
        raise NotImplementedError

    def anchor_plan(self, run, preset: dict):
        """The anchor as a :class:`~compressor.sizing.plan.SizePlan` of the run's own options, when it is
        one (its compensated tensors are then rounded in the same pass as the file's); default None."""
        return None

    def measure_anchor(self, run, preset: dict) -> dict:
        """The anchor's scores per gate domain (``name → WindowScores``), made if need be (``run``: the
        :class:`~compressor.pipeline.size.stage.SizeRun`)."""
        raise NotImplementedError

    def measured(self, budget, priced: list, calibration, windows: torch.Tensor, workdir: Path) -> None:
        """Once the prices are measured, before any plan: what the anchor takes of the run's statistics
        (``priced``; ``calibration``: the recipe's section, ``windows`` its tokens), which may set the budget's
        bytes (a GGUF's preset made again with the run's importance matrix). Default nothing."""

    def measure_rivals(self, run, preset: dict) -> list[tuple[dict, dict]]:
        """Other anchors of no more bytes, each with its scores per gate domain (the smaller presets measured
        beside a GGUF's); default none."""
        return []

    def output_files(self) -> dict[str, Path]:
        """Files the run made that go into the output beside the planned file (name → path); default none."""
        return {}

    # How the report words this format's file (compressor.reports.wording.FormatWords): the summary `compressor
    # run` prints and the model card; the defaults name the format plainly.
    runs_in: ClassVar[str] = "its runtime"
    """Where the planned file runs and was measured, as the summary's per-domain lines name it ("llama.cpp")."""
    choices: ClassVar[str] = "types"
    """What a plan chooses per weight, plural ("tensor types"): the summary's word, and the card's."""

    def shipped(self, folder: Path) -> Path:
        """The planned file in the output folder ``folder``, as the summary names it (default: the folder)."""
        return folder

    def beside(self, preset: dict) -> str:
        """The anchor measured beside the file (a verification entry's ``preset``), as the summary names it
        (default: what the entry calls it, else :meth:`anchor_called`)."""
        return preset.get("called") or self.anchor_called(preset["name"])

    def check_line(self, check: dict, size: dict) -> str | None:
        """The summary's line on this format's verification entry ``check`` of a file written as it is, with no
        size plan (``size``: the report's ``size`` section); None (the default): none."""
        return None

    def card_words(self) -> dict[str, str]:
        """The phrases of a size-planned file's model card, placeholders and all: the fields of
        :class:`compressor.reports.wording.CardWords` (``file``, ``choice``, ``where``, ``anchor``, ``anchor_line``,
        ``unchanged``, ``best_line``, ``load``, ``library``)."""
        return {"file": f"{self.what or self.format} of {{bytes:,}} bytes", "choice": f"every weight's {self.choices}",
                "where": f"in {self.runs_in}", "anchor": "{name}", "anchor_line": "{name} ({bytes:,} bytes)",
                "unchanged": f"the file's {self.choices}", "load": f"Load it with {self.runs_in}.",
                "library": "transformers"}
