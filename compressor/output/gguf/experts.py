"""A layer's routed experts, priced as the one GGUF tensor llama.cpp stores them in.

llama.cpp's converter stacks a layer's experts into one ``ffn_{gate,up,down}_exps`` tensor, which takes one
GGML type. Each expert is priced on its own statistics — Ĥ over the tokens the router sent it, F (its output's
loss gradient, scaled by the router's weight) over all tokens, so that an expert the router rarely picks costs
little — and the tensor's option for a type is the sum over its experts of their bytes and predicted costs.

An expert that saw fewer than :data:`MIN_EXPERT_TOKENS` calibration tokens is priced as its layer's average
expert: Ĥ pooled over the tokens of every expert of the tensor, F their mean. The report lists every stacked
tensor's tokens per expert and which were pooled (``size_plan.experts``).

Experts are rounded to nearest by ggml (with the importance matrix where it prices lower), not by GPTQ: the
stored bytes of error-compensating rounding are one weight's rows in the file's order, and a stack of them is
not built yet.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from compressor.policy.options import Option

logger = logging.getLogger(__name__)

#: Below this many calibration tokens an expert's own Ĥ (rank at most its tokens) and F are too few to price
#: it: it is priced as its layer's average expert.
MIN_EXPERT_TOKENS = 32


class ExpertStacks:
    """Collects the sites of stacked tensors across pricing calls (a layer's experts may be measured in more
    than one group) and prices each stack once it is complete."""

    def __init__(self, parts_of, checkpoint_name) -> None:
        self.parts_of, self.checkpoint_name = parts_of, checkpoint_name
        self.pending: dict[str, list] = {}
        self.done: dict[str, object] = {}
        """Stacked tensor → its :class:`~compressor.sizing.plan.Priced` (emitted once by :meth:`priced`)."""
        self.report: dict[str, dict] = {}

    def stacked(self, name: str) -> bool:
        return len(self.parts_of(name)) > 1

    def price(self, sites: list, price_all) -> dict[str, list[Option]]:
        """Options of every stack these ``sites`` complete (``price_all``: the target's pricing of sites)."""
        units: dict[str, list[Option]] = {}
        for s in sites:
            self.pending.setdefault(s.name, []).append(s)
        for name in [n for n, members in self.pending.items() if len(members) == len(self.parts_of(n))]:
            members = self._ordered(name, self.pending.pop(name))
            members = self._pooled(name, members)
            parts = price_all([dataclasses.replace(s, name=f"{name}#{i}") for i, s in enumerate(members)])
            units[name] = _summed(name, [parts[f"{name}#{i}"] for i in range(len(members))])
            self.done[name] = _priced(name, members)
        return units

    def priced(self, sites: list) -> list:
        """The stacks these sites completed, each once."""
        out = []
        for name in dict.fromkeys(s.name for s in sites):
            if name in self.done:
                out.append(self.done.pop(name))
        return out

    def incomplete(self) -> list[str]:
        return sorted(self.pending)

    def _ordered(self, name: str, members: list) -> list:
        order = {hf: i for i, hf in enumerate(self.parts_of(name))}
        return sorted(members, key=lambda s: order[self.checkpoint_name(f"{s.module}.weight")])

    def _pooled(self, name: str, members: list) -> list:
        """Experts with fewer than :data:`MIN_EXPERT_TOKENS` tokens priced as the layer's average expert."""
        tokens = [s.tokens if s.tokens is not None else -1 for s in members]
        few = [i for i, n in enumerate(tokens) if 0 <= n < MIN_EXPERT_TOKENS]
        self.report[name] = {"tokens": tokens, "pooled": few}
        if not few:
            return members
        weights = [max(n, 0) for n in tokens]
        total = sum(weights)
        if total == 0:
            h = torch.stack([s.h for s in members]).mean(0)
        else:
            h = sum(w * s.h for w, s in zip(weights, members) if w) / total
        f = torch.stack([s.f for s in members]).mean(0)
        from compressor.sizing.sites import _imatrix

        imat = _imatrix(torch.diagonal(h))
        logger.info("size plan: %s: experts %s saw fewer than %d calibration tokens; priced as the layer's "
                    "average expert", name, few, MIN_EXPERT_TOKENS)
        return [dataclasses.replace(s, h=h, f=f, imatrix=imat) if i in few else s for i, s in enumerate(members)]


def _summed(name: str, per_expert: list[list[Option]]) -> list[Option]:
    """One option per type every expert takes: bytes and cost summed. Imatrix: used for the stack when every
    expert's cheaper rounding of that type used it (mixed: used — ggml's importance-weighted scales for an
    expert that priced lower without them is a small, unpriced difference)."""
    from compressor.sizing.plan import Choice

    by_type = [{o.name: o for o in opts} for opts in per_expert]
    common = set.intersection(*(set(b) for b in by_type))
    out = []
    for t in sorted(common):
        picked = [b[t] for b in by_type]
        weighted = any(o.payload.weighted for o in picked)
        out.append(Option(name, t, sum(o.size for o in picked), sum(o.cost for o in picked),
                          Choice(picked[0].payload.type, weighted, False)))
    return out


def _priced(name: str, members: list):
    """What planning keeps of a stack: its experts' rows as one tensor, an importance matrix per expert."""
    from compressor.sizing.plan import Priced

    rows, cols = members[0].weight.shape
    module = members[0].module.rpartition(".")[0].rpartition(".")[0]  # …mlp.experts
    return Priced(name, module, (rows * len(members), cols), np.stack([s.imatrix for s in members]))
