"""The size stage's loop: plan → allocate → write → gate → back off.

One :class:`SizeRun` per run. Each attempt plans a tensor budget (:class:`~.planner.Planner`), hands the
plan to the format's writer as an argument (in the format's terms:
:meth:`~compressor.sizing.target.SizeTarget.file_plan`; :func:`~compressor.pipeline.writing.write`), verifies
what it wrote where it runs (:func:`~compressor.pipeline.writing.verify`), and judges the file
(:mod:`.gate`). ``output.size: smallest`` searches the tensor budget with the gate's own search
(:class:`compressor.policy.search.TargetSearch`: each budget measured once, the fewest bytes that pass; when
the first plan passes, the search goes on below it); a size in bytes, bits per weight or a preset's name is one
attempt at that size.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from compressor.core.errors import GateFailed, InputError
from compressor.evaluation.gate import gate_budget, gate_ppl_limit
from compressor.output.base import VerificationError, WriteRequest
from compressor.pipeline.products import Checked
from compressor.pipeline.size.rounding import Compensator
from compressor.pipeline.writing import verify, write
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import Recipe
from compressor.sizing.target import SizeTarget
from compressor.pipeline.size.gate import best_anchor, judge, message, preset_rows
from compressor.sizing.budget import Budget
from compressor.pipeline.size.planner import Planner
from compressor.sizing.plan import SizePlan
from compressor.policy.search import Attempt, TargetSearch

logger = logging.getLogger(__name__)

#: ``output.size: smallest`` first plans for this share of the gate's limit on the change (predicted, in nats):
#: the gate measures the upper confidence bound of the change, so a plan predicted right at the limit fails
#: about half the time. When that fails, the search bisects the tensor bytes between it and the F16 file.
SMALLEST_START_SHARE = 0.6


@dataclass
class SizeRun:
    """One size run's state: what every attempt needs, and what the report says of them."""

    recipe: Recipe
    request: WriteRequest
    checked: Checked
    report: dict
    result: CompressionResult
    planner: Planner
    workdir: Path
    compensator: Compensator | None
    """Rounds the compensated tensors of a chosen plan over all their rows (:mod:`.rounding`); None: nearest."""
    target: SizeTarget
    """The format planned."""
    head: dict = field(default_factory=dict)
    """What the report's ``size_plan`` says before any plan: the budget, prices, timings."""
    target_nll: float | None = None
    records: list[dict] = field(default_factory=list)
    preset_scores: dict | None = None
    """The preset's scores per gate domain, measured once (every attempt is compared with the same file)."""
    rival_scores: list = field(default_factory=list)
    """Other anchors of no more bytes with their scores (:meth:`SizeTarget.measure_rivals`), measured once."""
    gate_scores: dict | None = None
    """The scores of the anchor the gate's preset rule compares with: the best of the size's own and its rivals."""
    _anchor_plan: SizePlan | None = None
    _kept: list = field(default_factory=list)
    """``(tensor bytes, folder)`` of the passing attempts set aside in the work folder."""
    plan: SizePlan | None = None
    """The plan last handed to the writer (:meth:`hand`)."""

    def anchor_plan(self):
        """The anchor as a plan of this run's own options, made once (None when the target's anchor is a file
        made elsewhere, as llama.cpp's preset is, or the size names none)."""
        if self._anchor_plan is None and self.budget.preset is not None:
            self._anchor_plan = self.target.anchor_plan(self, self.budget.preset)
        return self._anchor_plan

    @property
    def budget(self) -> Budget:
        return self.planner.budget

    def search(self) -> Path:
        """The verified staging folder of the chosen file; :class:`GateFailed` when none passed."""
        pol = self.recipe.policy
        if self.budget.kind == "smallest":
            self.target_nll = SMALLEST_START_SHARE * self._limit_nats()
            start = self.planner.smallest_within(self.target_nll).tensor_bytes
            search = TargetSearch(self.attempt, key=self.planner.key, between=self._between,
                                  floor=self.planner.floor - self.planner.fixed, ceiling=self.planner.ceiling,
                                  describe=self.planner.describe)
            best = search.run(steps=pol.max_backoff, start=start, gate=pol.gate)
            if pol.gate and best is not None and best.target == start:  # fewer bytes may pass too: search below
                best = search.bisect(pol.max_backoff)
        else:
            best = self.attempt(self.planner.tensor_budget)
            best = best if best.passed else None
        return self._take(best)

    def _limit_nats(self) -> float:
        """The gate's limit as a loss increase in nats per token: the perplexity budget's log-ratio, or the KL
        budget (the predicted loss increase is the second-order KL to the original)."""
        pol = self.recipe.policy
        if pol.metric == "kl":
            nats = gate_budget(pol)
        else:
            base = self.result.baseline.ppl
            nats = math.log(gate_ppl_limit(base, pol) / base) if base else 0.0
        if nats <= 0:
            budget = "policy.kl_budget" if pol.metric == "kl" else "policy.ppl_budget"
            raise InputError(f"output.size: smallest needs a budget above the original ({budget} > 0); give one, "
                             "or a size")
        return nats

    def _between(self, failed: float, passed: float) -> int | None:
        tolerance = max(4096, self.planner.ceiling // 500)
        return None if passed - failed <= tolerance else int((failed + passed) // 2)

    def attempt(self, tensor_bytes: float, variant: str = "none") -> Attempt:
        """Write the plan at ``tensor_bytes``, measure it where it runs, and judge it."""
        size_plan = self.planner.at(int(tensor_bytes))
        if self.compensator is not None:  # the anchor's tensors, still to measure, rounded in the same pass
            anchor = self.anchor_plan() if self.preset_scores is None else None
            self.compensator.fill(size_plan, *([anchor] if anchor is not None else []))
        self.plan = size_plan
        logger.info("size plan: %s of tensor data, predicted perplexity %+.2f %%; types %s",
                    f"{size_plan.tensor_bytes / 1e6:.2f} MB", 100 * math.expm1(size_plan.predicted_nll_increase),
                    size_plan.to_json()["types_used"])
        tmp = self.write_and_verify(size_plan)
        check = self.report["verification"][self.target.format]
        try:
            self._measure(check, size_plan)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        passed, why = judge(check, self.result, self.recipe.policy, self.gate_scores)
        record = _record(size_plan, check, passed)
        self.records.append(record)
        kept = None
        if passed:  # set aside: a later attempt writes the same staging folder
            kept = self.workdir / f"attempt-{len(self.records)}"
            shutil.move(tmp, kept)  # a rename, or a copy where output.workdir is on another disk
            # the search takes the passing file of fewest bytes: a larger one kept before is never taken
            for older in [k for k in self._kept if k[0] > size_plan.tensor_bytes]:
                shutil.rmtree(older[1], ignore_errors=True)
                self._kept.remove(older)
            self._kept.append((size_plan.tensor_bytes, kept))
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        self.report["message"] = message(check, self.recipe.policy)
        return Attempt(tensor_bytes, passed, why, outcome=(kept, check, size_plan, self.report["message"]),
                       record=record)

    def write_and_verify(self, size_plan: SizePlan) -> Path:
        """Every requested format into a staging folder, the planned one written from ``size_plan`` in its own
        terms (the target's :meth:`~compressor.sizing.target.SizeTarget.file_plan`), each verified; the folder."""
        oc, fmt = self.recipe.output, self.target.format
        staged = write(oc, self.request, self.checked, self.report["timings"],
                       plans={fmt: self.target.file_plan(size_plan, self.request)})
        verify(oc, self.request, staged, self.report)
        return staged.folder

    def _measure(self, check: dict, size_plan: SizePlan) -> None:
        """Bytes against the budget (exact: the plan's are known before writing), and the preset beside the file."""
        expected = self.planner.file_bytes(size_plan)
        check.update(quant="plan", planned_format=self.target.format, budget_bytes=self.budget.limit,
                     planned_file_bytes=expected,
                     predicted_relative_change=math.expm1(size_plan.predicted_nll_increase))
        if check["file_bytes"] > self.budget.limit:
            raise VerificationError(f"the planned file is {check['file_bytes']:,} bytes, over its budget of "
                                    f"{self.budget.limit:,} (planned {expected:,}); nothing was published")
        if check["file_bytes"] != expected:
            logger.warning("size plan: the file is %d bytes, %d planned", check["file_bytes"], expected)
        preset = self.budget.preset
        if preset is None:
            return
        if self.preset_scores is None:
            self.preset_scores = self.target.measure_anchor(self, preset)
            self.rival_scores = self.target.measure_rivals(self, preset)
        preset_rows(check, preset, self.preset_scores, self.target.anchor_called(preset["name"]))
        self.gate_scores = best_anchor(check, preset, self.preset_scores, self.rival_scores, self.recipe.policy,
                                       self.target.anchor_called)

    def _take(self, best: Attempt | None) -> Path:
        """The chosen attempt's folder back at the staging name, and the report describing it."""
        from compressor.output.base import staging_folder
        from compressor.reports.card import model_card

        if best is None:
            self._refuse()
        kept, check, size_plan, message = best.outcome
        self.plan = size_plan
        self.report["verification"][self.target.format] = check
        self.report["message"] = message
        self.report["size_plan"] = self.to_json(size_plan)
        tmp = staging_folder(self.checked.out)
        tmp.rmdir()
        shutil.move(kept, tmp)
        for name, path in self.target.output_files().items():  # e.g. the importance matrix the preset was made with
            shutil.copyfile(path, tmp / name)
        # the card describes the file chosen (its types, bytes and measured change), whatever else was written
        (tmp / "README.md").write_text(model_card(self.report))
        return tmp

    def _refuse(self) -> None:
        smallest = self.budget.kind == "smallest"
        budget = "policy.kl_budget" if self.recipe.policy.metric == "kl" else "policy.ppl_budget"
        fix = (f"raise {budget}, or policy.max_backoff for more attempts" if smallest else
               f"give a larger output.size or raise {budget}")
        last = self.records[-1] if self.records else {}
        self.report["size_plan"] = self.to_json(self.plan)
        self.report.update(status="rejected", exit_code=3, output=None)
        self.report["message"] += f". Over the gate ({_over(last)}): nothing was written; {fix}"
        raise GateFailed(self.report["message"], report=self.report)

    def to_json(self, size_plan: SizePlan | None) -> dict:
        out = {**self.head, **self.budget.to_json(), **(size_plan.to_json() if size_plan is not None else {})}
        out["planned_file_bytes"] = self.planner.file_bytes(size_plan) if size_plan is not None else None
        if self.target_nll is not None:
            out["search"] = {"mode": "smallest", "start_share": SMALLEST_START_SHARE,
                             "target_predicted_ppl_change": math.expm1(self.target_nll), "attempts": self.records}
        return out


def _record(size_plan: SizePlan, check: dict, passed: bool) -> dict:
    return {
        "tensor_bytes": size_plan.tensor_bytes,
        "predicted_ppl_change": math.expm1(size_plan.predicted_nll_increase),
        "file_bytes": check.get("file_bytes"),
        "passed": passed,
        "measured": {
            d["name"]: {
                "relative_change": d.get("relative_change"),
                "upper_bound": d.get("relative_delta_upper"),
                "kl_mean": d.get("kl_mean"),
                "kl_upper": d.get("kl_upper"),
            }
            for d in check.get("domains", [])
        },
    }


def _over(record: dict) -> str:
    over = [f"{n} bound {100 * m['upper_bound']:+.2f} %" + (f", KL {m['kl_upper']:.4f}" if m.get("kl_upper") else "")
            for n, m in (record.get("measured") or {}).items() if m.get("upper_bound") is not None]
    return ", ".join(over) or "no file passed"


def check_floor(planner: Planner, budget: Budget) -> None:
    """A size below the smallest file this model's rows allow is refused with that file's exact bytes."""
    if planner.floor <= budget.limit:
        return
    types = sorted({min(o, key=lambda x: x.size).name for o in planner.units.values()})
    raise InputError(f"output.size: {budget.size} ({budget.limit:,} bytes) cannot be met: the smallest types this "
                     f"model's rows take ({', '.join(types)}) make a file of {planner.floor:,} bytes; give a size of "
                     f"at least {planner.floor:,} bytes")
