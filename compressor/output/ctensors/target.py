"""The compressed-tensors size target: every linear layer's integer scheme, for plain transformers and vLLM.

Options are the schemes compressed-tensors describes and vLLM serves (:data:`~compressor.output.ctensors.grids.SCHEMES`:
int4 with a scale per 128 or per 32 inputs, int8 per 128) or the layer left in the saved dtype. The layers
vLLM fuses (q/k/v, gate/up: :data:`~compressor.output.ctensors.FUSED_SIBLINGS`) take one scheme together, so
they are one unit of the allocation. The embedding stays in the saved dtype, as llm-compressor leaves it; an
output head with a weight of its own is one more unit (``output.ct_head: plan``, the default: at W4A16's size
the head and the embedding hold most of the bytes, and a head in fewer bits pays for many layers in int8), or
stays in the saved dtype with ``keep``; a tied head stays with the embedding. Each option is priced by the
rounding it will get — GPTQ through the layer's Ĥ onto the scheme's grid (``output.rounding: gptq``) or
round-to-nearest — in closed form, ``½ Σ_o F_o (ΔW Ĥ ΔWᵀ)_oo``.

Sizes count the bytes of the tensors the checkpoint stores (:meth:`IntScheme.nbytes`; the safetensors JSON
index, a few kB, aside), so a plan's bytes are exact before it is written. ``W4A16`` (``W8A16``,
``W4A16_G32``) is that uniform scheme's size for this model, and the anchor measured beside the file is that
uniform checkpoint itself (its head in the saved dtype), rounded by the same GPTQ — what llm-compressor's
``GPTQModifier`` writes for the scheme. A size in bytes or bits per weight is measured beside the largest
uniform scheme that fits it.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from compressor.output.ctensors.grids import Rounded
from compressor.sizing.budget import Budget, Layout
from compressor.sizing.target import SizeTarget
from compressor.policy.options import Option
from compressor.sizing.plan import Choice
from compressor.recipe.schema import CT_SIZE_SCHEMES

logger = logging.getLogger(__name__)

#: What a layer left in the saved dtype is called in a plan.
FLOAT = "unquantized"



def units_of(model: nn.Module, head: bool = True) -> dict[str, list[str]]:
    """Allocation unit → its linear layers: the fused siblings of one parent together, every other
    quantizable linear alone (in module order); an untied output head among them when ``head``."""
    from compressor.output.ctensors.schemes import fused_units, linear_names

    return fused_units(linear_names(model, head=head))


def _dtype(request) -> torch.dtype:
    return request.dtype or request.model.dtype


def option_bytes(scheme: str, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Stored bytes of an ``[out, in]`` weight in ``scheme`` (:data:`FLOAT`: the saved dtype)."""
    from compressor.output.ctensors.grids import weight_bytes

    return weight_bytes(None if scheme == FLOAT else scheme, *shape, dtype)


class CompressedTensorsTarget(SizeTarget):
    format = "compressed-tensors"
    presets = CT_SIZE_SCHEMES
    what = "the compressed-tensors checkpoint"
    heldout_prices = True
    reload_check = True
    gptq_options = 6  # the integer schemes (SCHEMES)
    full_roundings = 2  # the plan and the uniform anchor
    streams = True

    def __init__(self, output=None) -> None:
        super().__init__(output)
        self.dtype = torch.bfloat16
        self.head = getattr(output, "ct_head", "plan") == "plan"

    def anchor_called(self, name: str) -> str:
        return f"the uniform {name} checkpoint"

    # the report's words for a compressed-tensors checkpoint (compressor.reports.wording)
    runs_in = "transformers"
    choices = "layer schemes"

    def card_words(self) -> dict[str, str]:
        return {
            "file": "a compressed-tensors checkpoint (`pack-quantized`) of {bytes:,} bytes of tensors",
            "choice": "every linear layer's integer scheme (fused q/k/v and gate/up together)",
            "where": "in plain transformers after reloading the folder",
            "anchor": "uniform {name}",
            "anchor_line": (
                "the uniform {name} checkpoint of the same model ({bytes:,} bytes of tensors; every linear layer "
                "in {name}, rounded the same way — what llm-compressor's GPTQModifier writes for that scheme)"
            ),
            "unchanged": "the checkpoint's layer schemes",
            "load": (
                "```python\n# pip install compressed-tensors\nfrom transformers import AutoModelForCausalLM\n"
                'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")\n```\n\n'
                "```bash\nvllm serve path/to/this/folder\n```"
            ),
            "library": "transformers",
        }

    def refusal(self, model_type: str, src, config=None) -> str | None:
        from compressor.output.ctensors.writer import CompressedTensorsWriter

        return CompressedTensorsWriter().unsupported(model_type, "none")

    def namer(self, model) -> Callable[[str], str | None]:
        """A linear layer's weight is planned under its own module name (fused siblings are joined when
        priced); the embedding is not planned, nor the output head unless ``ct_head: plan`` and it is untied."""
        planned = {f"{m}.weight": m for unit in units_of(model, self.head).values() for m in unit}
        return planned.get

    def price_all(self, sites: list, rounding: str, kept=None) -> dict:
        """Every layer priced in every scheme its rows take (GPTQ through Ĥ, or to nearest, as ``rounding``
        says), then the fused siblings summed into one unit per scheme they all take. Nothing is offered to
        ``kept``: a fused unit is rounded through its first layer's Ĥ as one, after the plan."""
        from compressor.core.progress import progress
        from compressor.output.ctensors.schemes import fused_units

        by_module = {}
        for site in progress(sites, desc="price: integer schemes", unit="layer"):
            by_module[site.name] = price_layer(site, rounding, self.dtype)
        units: dict[str, list[Option]] = {}
        # options in order of bytes, then name: two schemes can tie exactly (W8A16 and W8A16_CH on a layer of 128
        # inputs are one grid), and a set's order changes with the process's string hashing
        for unit, parts in fused_units(by_module).items():
            common = set.intersection(*(set(by_module[p]) for p in parts))
            units[unit] = [Option(unit, s, sum(by_module[p][s][0] for p in parts),
                                  sum(by_module[p][s][1] for p in parts),
                                  payload=Choice(s, False, rounding == "gptq" and s != FLOAT))
                           for s in sorted(common, key=lambda s: (by_module[parts[0]][s][0], s))]
        return units

    def priced(self, sites: list) -> list:
        """One entry per unit: its first layer (whose input the unit shares: its Ĥ rounds them all), the rows of
        all its layers."""
        from compressor.output.ctensors.schemes import fused_units
        from compressor.sizing.plan import Priced

        by = {s.name: s for s in sites}
        out = []
        for unit, parts in fused_units(by).items():
            first = by[parts[0]]
            rows = sum(by[p].weight.shape[0] for p in parts)
            out.append(Priced(unit, first.module, (rows, first.weight.shape[1]), first.imatrix))
        return out

    def payload(self, name: str, weighted: bool, compensated: bool) -> Choice:
        return Choice(name, weighted, compensated)

    def cache_settings(self) -> dict:
        from compressor.output.ctensors.grids import SCHEMES
        from compressor.sizing.sites import MAX_PRICED_ELEMENTS

        return {"schemes": sorted(SCHEMES), "saved_dtype": str(self.dtype), "max_elements": MAX_PRICED_ELEMENTS,
                "head": self.head}

    def budget(self, size, request, workdir: Path) -> Budget:
        """The bytes of the tensors the checkpoint stores: every planned unit in the saved dtype as the layout's
        "F16", everything else fixed; a scheme's name is that uniform checkpoint's bytes (its head, if planned,
        in the saved dtype)."""
        from compressor.core.params import count_params
        from compressor.output.ctensors.schemes import head_name, linear_bytes, tensor_bytes

        self.dtype = _dtype(request)
        model = request.model
        units = units_of(model, self.head)
        shapes = {u: [tuple(model.get_submodule(m).weight.shape) for m in ms] for u, ms in units.items()}
        planned = {u: sum(option_bytes(FLOAT, s, self.dtype) for s in ss) for u, ss in shapes.items()}
        floats = {m: None for ms in units.values() for m in ms}
        fixed = tensor_bytes(model, floats, self.dtype) - linear_bytes(model, floats, self.dtype)
        layout = Layout(data_offset=0, alignment=1, fixed_bytes=fixed, planned=planned,
                        file_bytes=fixed + sum(planned.values()))

        head = head_name(model)

        def uniform(scheme: str) -> int:
            return fixed + sum(option_bytes(anchor_scheme(scheme, u, ss, head), s, self.dtype)
                               for u, ss in shapes.items() for s in ss)
        kind, value = size.kind, size.value
        preset = None
        if kind == "preset":
            limit = uniform(value)
            preset = _anchor(value, limit)
        elif kind == "smallest":
            limit = layout.file_bytes
        else:
            limit = int(value * count_params(model) / 8) if kind == "bpw" else int(value)
            fitting = [(uniform(s), s) for s in self.presets if uniform(s) <= limit]
            preset = _anchor(max(fitting)[1], max(fitting)[0]) if fitting else None
        return Budget(size, limit, layout, preset)

    def round_full(self, name: str, option: str, weight, h, priced, request, alongside=None):
        """GPTQ of every layer of the unit onto ``option``'s grid through the unit's shared Ĥ (fused siblings
        read the same input), scales in the saved dtype: ``module → Rounded``."""
        from compressor.output.ctensors.grids import gptq
        from compressor.output.ctensors.schemes import GPTQ_ORDER, unit_members

        # h: Ĥ or its act-order factor (shared by every option of the unit); Rounded kept without the float
        # weight (the writer decodes it): 6 GB for 1.5B
        from compressor.core import onload

        return {m: gptq(weight if m == priced.module else onload.weight(request.model, m), h, option,
                        scale_dtype=self.dtype, decode=False, **GPTQ_ORDER)
                for m in unit_members(name)}

    def spill(self, raw, path: Path, at_least: int):
        """A unit's ``{module: Rounded}`` (int8 codes and scales: a byte a weight, 1.3 GB for a 1.5B model's plan and
        as much for its anchor) saved with torch and mapped back."""
        held = sum(r.ints.nbytes + r.scales.nbytes for r in raw.values())
        if held < at_least:
            return raw
        path = path.with_name(path.name + ".pt")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({m: {"scales": r.scales, "ints": r.ints} for m, r in raw.items()}, path)
        back = torch.load(path, mmap=True, weights_only=True)
        return {m: Rounded(None, t["scales"], t["ints"]) for m, t in back.items()}

    def file_plan(self, plan, request):
        """The plan's scheme per unit as a scheme per layer, with the layers the size stage rounded by GPTQ;
        measured on the gate's domains where it runs."""
        from compressor.output.ctensors.schemes import SchemePlan, unit_members

        schemes = {m: s for u, s in plan.types.items() for m in unit_members(u)}
        rounded = {m: r for _, by in plan.stored.values() for m, r in by.items()}
        return SchemePlan(schemes, rounded, measured=True)

    def anchor_plan(self, run, preset: dict):
        """The uniform checkpoint of ``preset['name']`` as a plan of the run's options (each unit in the first
        scheme of the family its rows take; the output head in the saved dtype)."""
        from compressor.output.ctensors.schemes import head_name, unit_members
        from compressor.sizing.plan import SizePlan

        model = run.request.model
        chosen, head = {}, head_name(model)
        for u, opts in run.planner.units.items():
            name = anchor_scheme(preset["name"], u, [tuple(model.get_submodule(m).weight.shape)
                                                     for m in unit_members(u)], head)
            chosen[u] = next(o for o in opts if o.name == name)
        return SizePlan({u: o.name for u, o in chosen.items()}, {}, sum(int(o.size) for o in chosen.values()),
                        preset["file_bytes"], sum(o.cost for o in chosen.values()),
                        compensated={u for u, o in chosen.items() if o.payload.compensated})

    def measure_anchor(self, run, preset: dict) -> dict:
        """The uniform checkpoint of ``preset['name']``: planned, rounded by the run's own rounding (in the pass
        that rounded the file, :meth:`anchor_plan`), written and reloaded by plain transformers like the file,
        scored on the gate's windows, then removed."""
        from compressor.output.registry import get_writer
        from compressor.output.ctensors.writer import reload_dtype, score_folder

        scheme = preset["name"]
        plan = run.anchor_plan()
        run.compensator.fill(plan)
        folder = run.workdir / f"anchor-{scheme}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        request = dataclasses.replace(run.request, extra_files={})
        try:
            get_writer(self.format).write(request, folder, self.file_plan(plan, run.request))
            return score_folder(folder, run.request.options.get("gate_domains") or [],
                                reload_dtype(run.request.model, _dtype(run.request)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def in_family(scheme: str, shapes: list[tuple[int, int]]) -> str:
    """The scheme a unit of ``shapes`` takes in a checkpoint named ``scheme``: the first of its family
    (:data:`~compressor.output.ctensors.grids.FAMILIES`) whose group divides every row, else the saved dtype."""
    from compressor.output.ctensors.grids import FAMILIES, SCHEMES

    return next((f for f in FAMILIES[scheme] if all(SCHEMES[f].fits(s[1]) for s in shapes)), FLOAT)


def anchor_scheme(scheme: str, unit: str, shapes: list[tuple[int, int]], head: str | None) -> str:
    """The scheme ``unit`` has in the uniform checkpoint named ``scheme`` (llm-compressor's layout): the output
    head (module ``head``, :func:`~compressor.output.ctensors.head_name`) in the saved dtype (its
    ``ignore=["lm_head"]``), every other unit :func:`in_family`."""
    return FLOAT if unit == head else in_family(scheme, shapes)


def _anchor(scheme: str, nbytes: int) -> dict:
    from compressor.output.ctensors.grids import FAMILIES

    also = f" (or {', '.join(FAMILIES[scheme][1:])} where its group does not divide a layer's rows)" if len(
        FAMILIES[scheme]) > 1 else ""
    return {"name": scheme, "file_bytes": nbytes,
            "made_by": f"compressor: every linear layer in {scheme}{also}, embeddings and output head in the saved "
                       "dtype, rounded as the plan is — what llm-compressor's GPTQModifier writes for that scheme"}


def price_layer(site, rounding: str, dtype: torch.dtype) -> dict[str, tuple[int, float]]:
    """One layer's options: scheme → (stored bytes, predicted loss increase), each scheme its rows take
    rounded as ``rounding`` says (GPTQ through the layer's Ĥ, sharing one factor; or to nearest), and the
    saved dtype at no cost."""
    from compressor.output.ctensors.grids import SCHEMES, gptq, rtn
    from compressor.output.ctensors.schemes import GPTQ_ORDER

    shape = tuple(site.weight.shape)
    w = site.priced_weight()
    out = {FLOAT: (option_bytes(FLOAT, shape, dtype), 0.0)}
    gptq_on = rounding == "gptq" and site.h is not None
    factors = site.fit_factors() if gptq_on else []
    for name, s in SCHEMES.items():
        if not s.fits(shape[1]):
            continue
        if factors:
            cost = site.fitted_cost(factors, lambda f: gptq(w, f, s, scale_dtype=dtype,
                                                            **GPTQ_ORDER).weight - w.float())
        else:
            cost = site.cost(rtn(w, s, scale_dtype=dtype).weight - w.float())
        out[name] = (s.nbytes(*shape, dtype), max(cost, 0.0))
    return out
