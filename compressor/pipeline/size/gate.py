"""The size gate: the written file, measured by its writer where it runs, judged by the gate's rule.

The writer measures (:meth:`compressor.output.base.Writer.verify`: per window of every gate domain, the
summed NLL in llama.cpp); this module decides, once, through
:func:`compressor.evaluation.evaluate.gate_check` — the upper confidence bound of the change against the
original (transformers; paired by window) within ``policy.ppl_budget`` less ``policy.headroom`` on every
domain. llama.cpp's preset of the size, when the size names one, is measured on the same windows and
reported beside the file.
"""

from __future__ import annotations

import math
from pathlib import Path

from compressor.evaluation.evaluate import gate_check, window_evaluation
from compressor.policy.compress import CompressionResult
from compressor.recipe.schema import PolicyConfig


def preset_changes(preset: dict, domains: list[dict]) -> dict[str, float]:
    """llama.cpp's perplexity of the preset file on each gate domain's windows (``name → ppl``)."""
    from compressor.output.gguf import read

    out = {}
    for d in domains:
        sums, counts = read.llama_cpp_window_nll(Path(preset["path"]), d["tokens"], d["seq_len"], d["stride"])
        out[d["name"]] = math.exp(sum(sums) / sum(counts))
    return out


def judge(check: dict, result: CompressionResult, pol: PolicyConfig) -> tuple[bool, str]:
    """The gate on the file ``check`` measured (its ``domains`` carry per-window NLL): every domain's row
    gets its bound, limit and verdict; returns (passed, the gate's words)."""
    base = getattr(result.baseline, "domains", None) or {}
    candidates = {d["name"]: window_evaluation(d["window_nll"], d["window_tokens"], name=d["name"],
                                               seq_len=base[d["name"]].seq_len, stride=base[d["name"]].stride,
                                               teacher=result.teacher_windows.get(d["name"]))
                  for d in check["domains"]}
    ok, why, per = gate_check({n: base[n] for n in candidates}, candidates, pol)
    for d in check["domains"]:
        d.update({k: per[d["name"]][k] for k in ("relative_delta_upper", "limit", "passed", "paired", "quantile",
                                                  "confidence")})
        d.pop("window_nll", None), d.pop("window_tokens", None)
    check["gate_passed"] = ok or not pol.gate
    return check["gate_passed"], why


def message(check: dict, pol: PolicyConfig) -> str:
    """One line: the file's bytes against the budget, each domain's change with its bound, the preset's."""
    preset = check.get("preset")
    changes = "; ".join(
        f"{d['name']} {100 * d['relative_change']:+.2f} % ({pol.confidence:.0%} bound "
        f"{100 * d['relative_delta_upper']:+.2f} %" + (
            f"; llama.cpp's {preset['name']}: {100 * d['preset_relative_change']:+.2f} %)"
            if preset else ")") for d in check["domains"])
    return (f"GGUF of {check['file_bytes']:,} bytes (budget {check['budget_bytes']:,}); perplexity in "
            f"llama.cpp against the original's: {changes}; budget {pol.ppl_budget:+.0%} ({pol.budget_mode}"
            f"{f', the bound held to {1 - pol.headroom:.0%} of it' if pol.headroom else ''})")
