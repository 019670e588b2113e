"""What a compressed-tensors size plan chose under each of several cached pricings, side by side.

A size run caches every unit's priced options (``~/.cache/compressor/prices-<key>.safetensors``). Given
two or more such files of the same model (e.g. GPTQ priced on the Ĥ it was fitted to, and cross-fitted on
two halves of the calibration), this re-runs the allocation at a uniform scheme's bytes for each, and
records per layer kind which schemes it chose, the predicted cost of the plan and of the uniform checkpoint,
and every option's price for a few named units. No model is loaded; it takes seconds.

    python tools/size/price_cache_plans.py --label in-sample=PATH --label cross-fitted=PATH \\
        --scheme W4A16 --unit model.layers.5.mlp.down_proj --output tools/size/results/X.json
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchlib.cli import tool_parser
from tools.benchlib.results import command_line, write_json


def plans(path: Path, scheme: str, units_shown: list[str]) -> dict:
    """The allocation at the uniform ``scheme``'s bytes under the prices cached in ``path``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from compressor.output.ctensors.target import CompressedTensorsTarget
    from compressor.sizing.plan import from_tensors, plan

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["prices"])
    units, priced = from_tensors(load_file(str(path)), meta, CompressedTensorsTarget().payload)
    uniform = {u: next(o for o in opts if o.name == scheme) for u, opts in units.items()}
    chosen = plan(units, priced, int(sum(o.size for o in uniform.values())))
    kinds = collections.Counter(f"{u.rsplit('.', 1)[-1]} {s}" for u, s in chosen.types.items())
    return {"prices_file": str(path), "plan_units": dict(collections.Counter(chosen.types.values())),
            "by_layer_kind": dict(sorted(kinds.items())),
            "predicted_nll_increase": {"plan": chosen.predicted_nll_increase,
                                       "uniform": sum(o.cost for o in uniform.values())},
            "options": {u: {o.name: {"bytes": int(o.size), "cost": o.cost} for o in units[u]} for u in units_shown}}


def main(argv=None) -> None:
    ap = tool_parser(__doc__)
    ap.add_argument("--label", action="append", required=True, help="LABEL=PATH of a prices cache file")
    ap.add_argument("--scheme", default="W4A16", help="the uniform scheme whose bytes the plans take")
    ap.add_argument("--unit", action="append", default=[], help="a unit whose option prices are recorded")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    out = {"tool": "tools/size/price_cache_plans.py", "command": command_line(), "scheme": args.scheme,
           "pricings": {lab: plans(Path(p), args.scheme, args.unit)
                        for lab, p in (x.split("=", 1) for x in args.label)}}
    write_json(Path(args.output), out)


if __name__ == "__main__":
    main()
