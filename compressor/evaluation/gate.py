"""What the gate measures and decides: every evaluation domain at once, and the budget rule.

:class:`Evaluator` holds one :class:`~compressor.evaluation.teacher.TeacherCache`
per evaluation text (a *domain*) and returns :class:`DomainEvaluations`; its
:meth:`~Evaluator.split` holds windows out for confirmation
(:func:`confirmation_windows`). :func:`gate_check` decides on the upper
confidence bound of the change on every domain (:func:`upper_quantile`), held
to :func:`gate_budget` (the policy's budget less its headroom).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from compressor.engine.records import register_record
from compressor.evaluation.perplexity import Evaluation, Perplexity, pool
from compressor.evaluation.teacher import TeacherCache, evaluate


@dataclass(frozen=True)
class DomainEvaluations:
    """One :class:`Evaluation` per domain; attribute access reads the first (primary) domain.

    The primary-domain attributes (``ppl``, ``tokens``…) keep single-domain code
    working; the gate itself looks at every domain through :func:`gate_check`.
    """

    domains: dict[str, Evaluation]

    @property
    def primary(self) -> Evaluation:
        return next(iter(self.domains.values()))

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "domains":
            raise AttributeError(name)
        return getattr(self.primary, name)

    def to_json(self) -> dict:
        return dict(self.primary.to_json(), domains={k: v.to_json() for k, v in self.domains.items()})

    def pooled(self, other: "DomainEvaluations") -> "DomainEvaluations":
        """Each domain's evaluation over this one's windows and ``other``'s together (:func:`pool`)."""
        return DomainEvaluations({n: pool(ev, other.domains[n]) for n, ev in self.domains.items()})


def confirmation_windows(windows: int, fraction: float) -> list[int]:
    """The windows (of ``windows``, in order) held out for confirmation: a share ``fraction`` of them,
    spread evenly and chosen by position alone (window ``i`` when ``⌊(i+1)·f⌋ > ⌊i·f⌋``; every 4th at
    0.25, every other at 0.5), so the split needs no random seed and no second baseline pass.

    >>> confirmation_windows(8, 0.25), confirmation_windows(5, 0.5), confirmation_windows(8, 0)
    ([3, 7], [1, 3], [])
    """
    eps = 1e-9  # 10 · 0.1 is not always 1.0 in floating point
    return [i for i in range(windows) if math.floor((i + 1) * fraction + eps) > math.floor(i * fraction + eps)]


class Evaluator:
    """Teacher caches for every evaluation domain, built once from the original model.

    >>> ev = Evaluator.build(model, {"wiki": wiki_ids, "code": code_ids}, seq_len=256, stride=128)  # doctest: +SKIP
    >>> baseline = ev.baseline                      # no extra pass: the teacher's own NLL
    >>> after = ev(model)                           # after a swap
    >>> gate_check(baseline, after, recipe.policy)  # doctest: +SKIP
    """

    def __init__(self, teachers: list[TeacherCache]):
        names = [t.name for t in teachers]
        if len(set(names)) != len(names) or not teachers:
            raise ValueError(f"evaluation domains need distinct names, got {names}")
        self.teachers = teachers

    @classmethod
    def build(
        cls, model: nn.Module, domains: dict[str, torch.Tensor], *, seq_len: int | dict[str, int] = 256,
        stride: int | dict[str, int] = 128, batch_size: int | dict[str, int] = 8, top_k: int = 64,
    ) -> "Evaluator":
        """``seq_len`` / ``stride`` / ``batch_size`` are one value or one per domain name."""
        def get(v, name):
            return v[name] if isinstance(v, dict) else v

        return cls([
            TeacherCache.build(model, ids, seq_len=get(seq_len, n), stride=get(stride, n),
                               batch_size=get(batch_size, n), top_k=top_k, name=n, desc=f"teacher: {n}")
            for n, ids in domains.items()
        ])

    @property
    def baseline(self) -> DomainEvaluations:
        return DomainEvaluations({t.name: t.baseline for t in self.teachers})

    def split(self, fraction: float) -> tuple["Evaluator", "Evaluator | None"]:
        """(search, confirmation): every domain's windows split by :func:`confirmation_windows`, as two
        evaluators sharing these teacher caches (no pass of the model); ``fraction`` 0: (self, None).

        >>> search, confirm = ev.split(0.25)   # doctest: +SKIP
        >>> len(confirm.teachers[0].windows)   # 8 of 32 windows                 # doctest: +SKIP
        """
        if not fraction:
            return self, None
        search, confirm = [], []
        for t in self.teachers:
            every = t.windows
            held = {every[j] for j in confirmation_windows(len(every), fraction)}
            search.append(t.subset([w for w in every if w not in held]))
            confirm.append(t.subset(sorted(held)))
        return Evaluator(search), Evaluator(confirm)

    def __call__(self, model: nn.Module, desc: str = "evaluate") -> DomainEvaluations:
        many = len(self.teachers) > 1
        return DomainEvaluations({
            t.name: evaluate(model, t, desc=f"{desc} [{t.name}]" if many else desc) for t in self.teachers
        })


def _as_domains(x) -> dict[str, Perplexity]:
    if isinstance(x, DomainEvaluations):
        return x.domains
    if isinstance(x, dict):
        return x
    return {getattr(x, "name", "") or "evaluation": x}


def ppl_limit(base: float, budget: float, mode: str) -> float:
    return base * (1.0 + budget) if mode == "relative" else base + budget


#: One-sided confidence of the gate's upper bound when the policy does not say (``policy.confidence``).
DEFAULT_CONFIDENCE = 0.9


def upper_quantile(confidence: float, windows: int | None) -> float:
    """The one-sided Student-t quantile for ``windows − 1`` degrees of freedom (windows are the sampling
    unit), by the Cornish-Fisher expansion around the normal quantile (within 0.5 % of the exact value
    from 10 degrees of freedom on); the normal quantile when the window count is unknown. 0 at 0.5.

    >>> round(upper_quantile(0.9, 32), 3), round(upper_quantile(0.5, 32), 3)
    (1.309, 0.0)
    """
    from statistics import NormalDist

    z = NormalDist().inv_cdf(confidence)
    if not windows or windows < 3:
        return z
    v = windows - 1
    return z + (z**3 + z) / (4 * v) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * v**2)


def _change_se(b, c) -> tuple[float | None, bool]:
    """Standard error of the candidate's mean NLL minus the baseline's, and whether it is paired.

    Paired by window (the same windows scored by both models, :attr:`Evaluation.nll_delta_se`) when the
    candidate came from :func:`evaluate`; else the two perplexities' own errors taken as independent,
    which overstates the noise of a difference (conservative); None with one window."""
    paired = getattr(c, "nll_delta_se", None)
    if paired is not None:
        return paired, True
    if getattr(c, "nll_se", None) is None:
        return None, False
    return math.sqrt(c.nll_se**2 + (getattr(b, "nll_se", None) or 0.0) ** 2), False


def gate_budget(policy, metric: str | None = None) -> float:
    """The budget the gate's bound is held to: the policy's ``kl_budget`` (``metric`` kl; default: the
    policy's metric) or ``ppl_budget``, less its ``headroom`` (the share kept for text unlike the gate's;
    0 where the policy has none)."""
    metric = metric or getattr(policy, "metric", "ppl")
    budget = policy.kl_budget if metric == "kl" else policy.ppl_budget
    return budget * (1.0 - getattr(policy, "headroom", 0.0))


def headroom_note(headroom: float) -> str:
    """What the limit is, in words, when ``policy.headroom`` lowers it ('' without headroom)."""
    return f" (the budget less policy.headroom {headroom:.0%})" if headroom else ""


def gate_ppl_limit(base: float, policy) -> float:
    """The perplexity the gate's bound must stay under: :func:`ppl_limit` at :func:`gate_budget`."""
    return ppl_limit(base, gate_budget(policy, "ppl"), policy.budget_mode)


def gate_check(baseline, candidate, policy) -> tuple[bool, str, dict[str, dict]]:
    """Does ``candidate`` stay within ``policy``'s budget on *every* domain, with confidence?

    ``baseline`` / ``candidate``: a :class:`DomainEvaluations`, a ``{name:
    Evaluation}`` dict, or one :class:`Perplexity`. The decision is on the **upper confidence
    bound** of the change (one-sided, ``policy.confidence``, default 0.9), not on the measured
    change alone: with windows as the sampling unit, the paired per-window differences give the
    change and its standard error ``se``, and the bound is the change plus ``t · se`` (``t``:
    :func:`upper_quantile` for the domain's window count).

    * ``ppl``: the bound of the perplexity, ``ppl · exp(t · se_ΔNLL)``, must be ≤
      ``limit(baseline ppl, gate_budget(policy), policy.budget_mode)``;
    * ``kl``: the bound of the mean KL from the original model, ``kl + t · se_KL``, must be ≤
      ``gate_budget(policy)`` nats/token.

    :func:`gate_budget` is the budget less ``policy.headroom`` (default 0.2: a +5 % budget is held at +4 %),
    the share kept for text unlike the gate's.

    ``policy.confidence: 0.5`` is the bare point test. Returns ``(passed, message, per_domain)``;
    each row holds the measured change, its standard error, the bound and the limit, and the
    message names every domain over budget.
    """
    metric = getattr(policy, "metric", "ppl")
    confidence = getattr(policy, "confidence", DEFAULT_CONFIDENCE)
    base, cand = _as_domains(baseline), _as_domains(candidate)
    if set(base) != set(cand):
        raise ValueError(f"baseline domains {sorted(base)} differ from candidate domains {sorted(cand)}")
    per, failed = {}, []
    level = f"{confidence:.0%} bound"
    budget = gate_budget(policy)
    for name, b in base.items():
        c = cand[name]
        q = upper_quantile(confidence, getattr(c, "windows", None))
        se, paired = _change_se(b, c)
        row = {"metric": metric, "confidence": confidence, "quantile": q, "paired": paired,
               "baseline_ppl": b.ppl, "ppl": c.ppl, "ppl_se": c.ppl_se, "relative_delta": c.ppl / b.ppl - 1,
               "kl": getattr(c, "kl", None), "kl_se": getattr(c, "kl_se", None)}
        # the perplexity's upper bound, whatever the metric: reports show it next to the change
        row["ppl_upper"] = c.ppl * math.exp(q * se) if se is not None else c.ppl
        row["relative_delta_upper"] = row["ppl_upper"] / b.ppl - 1
        if metric == "kl":
            if row["kl"] is None:
                raise ValueError("policy.metric=kl needs evaluations with a teacher (Evaluator / evaluate)")
            row["limit"] = budget
            row["kl_upper"] = row["kl"] + q * (row["kl_se"] or 0.0)
            row["passed"] = row["kl_upper"] <= budget
            shown = (f"KL {row['kl']:.4f} ({level} {row['kl_upper']:.4f}) {'≤' if row['passed'] else '>'} "
                     f"{budget:.4f} nats/token")
        else:
            row["limit"] = gate_ppl_limit(b.ppl, policy)
            row["passed"] = row["ppl_upper"] <= row["limit"]
            shown = (f"perplexity {c.ppl:.4f} ({row['relative_delta']:+.2%}; {level} "
                     f"{row['relative_delta_upper']:+.2%}) {'≤' if row['passed'] else '>'} limit {row['limit']:.4f}")
        row["summary"] = shown
        per[name] = row
        if not row["passed"]:
            failed.append(f"{name}: {shown}")
    if failed:
        return False, "over budget on " + "; ".join(failed), per
    if len(per) == 1:
        return True, next(iter(per.values()))["summary"], per
    return True, "; ".join(f"{n}: {r['summary']}" for n, r in per.items()), per


register_record(DomainEvaluations)
