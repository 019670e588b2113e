"""The gate's second look: the search's final choice measured once on windows the search never saw.

A search that keeps the largest cut passing on its windows keeps the cut whose noise there was most
favourable (a winner's curse). So each evaluation domain's windows are split
(``policy.confirm_fraction``, :meth:`~compressor.evaluation.gate.Evaluator.split`): the search
(bisection, greedy) measures only the *search* windows, and its final choice is measured once on
the *confirmation* windows with the same rule (the upper confidence bound of the change within
budget on every domain). A choice that fails there is stepped back from (allocate: its cut counts
as failing and the bisection goes on above it; greedy: the last kept block is rolled back), and the
new choice is confirmed in turn.

>>> confirm = Confirmation(confirm_baseline, lambda desc: confirm_evaluator(model, desc), policy)  # doctest: +SKIP
>>> ok, why = confirm("keep 62.5 %")                                                            # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import Callable

from compressor.evaluation.gate import DomainEvaluations, gate_check

logger = logging.getLogger(__name__)


class Confirmation:
    """Measures a choice on the confirmation windows and remembers what happened.

    ``baseline`` None: confirmation is off (``policy.confirm_fraction: 0``) and :attr:`enabled` is
    False."""

    def __init__(self, baseline: DomainEvaluations | None, evaluate: Callable[[str], DomainEvaluations] | None,
                 policy) -> None:
        self.baseline, self.evaluate, self.policy = baseline, evaluate, policy
        self.final: DomainEvaluations | None = None
        """The confirmation windows' evaluation of the last choice confirmed (or tried)."""
        self.passed: bool | None = None
        self.why = ""
        self.count = 0
        self.notes: list[str] = []
        """What the confirmation changed, one sentence a step back."""
        self.failures: list[str] = []
        """Each failed confirmation: what was tried and the gate's words."""

    @property
    def enabled(self) -> bool:
        return self.baseline is not None

    def __call__(self, what: str) -> tuple[bool, str]:
        """Is the model as it stands (the choice ``what``) within budget on the confirmation windows?"""
        self.final = self.evaluate(f"confirm: {what}")
        ok, why, _ = gate_check(self.baseline, self.final, self.policy)
        self.passed, self.why, self.count = ok, why, self.count + 1
        if ok:
            logger.info("confirmed on the held-out windows (%s): %s", what, why)
        else:
            self.failures.append(f"{what}: {why}")
            logger.warning("%s passed on the search windows but not on the held-out confirmation windows: %s",
                           what, why)
        return ok, why

    def stepped_back(self, sentence: str) -> None:
        self.notes.append(sentence)
        logger.warning("%s", sentence)

    def reset(self) -> None:
        """Nothing is chosen (every choice failed): the model is the original."""
        self.final = None

    def failed_message(self) -> str:
        """The exit-3 message when the search split passed but no choice confirmed."""
        tried = "; ".join(self.failures)
        return (f"the search windows passed, but confirmation failed: no choice the search found stayed within the "
                f"budget on the held-out confirmation windows (policy.confirm_fraction "
                f"{self.policy.confirm_fraction:g}) after {self.count} confirmation(s) ({tried}). The search's "
                "passes were its noise: give more evaluation text (evaluation.max_tokens) so both splits measure "
                "more windows, or raise the budget by the confirmation's margin (report.json: evaluation)")
