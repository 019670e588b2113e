"""The policy's shape: plan → allocate → gate → apply, in functions small enough to read.

* no function (or method) in ``compressor/policy/`` is over 80 lines;
* the gate's search (:mod:`compressor.policy.search`) and the options (:mod:`compressor.policy.options`)
  import nothing of the package, so the FFN allocation and a size planner share them;
* the search measures each choice once, takes a given target first, and, when the smallest target
  the bisection can reach fails, bisects above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from compressor.policy.search import Attempt, TargetSearch

POLICY = Path(__file__).resolve().parents[1] / "compressor" / "policy"
MAX_LINES = 80


def _functions():
    for path in sorted(POLICY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.name, node


def test_no_policy_function_is_over_80_lines():
    long = [f"{name}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for name, fn in _functions() if fn.end_lineno - fn.lineno + 1 > MAX_LINES]
    assert not long, f"functions over {MAX_LINES} lines in compressor/policy/:\n" + "\n".join(long)


def test_the_checker_counts_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    fn = ast.parse(f"def f():\n{body}\n").body[0]
    assert fn.end_lineno - fn.lineno + 1 == MAX_LINES + 1


@pytest.mark.parametrize("module", ["search", "options"])
def test_shared_policy_modules_import_nothing_of_the_package(module):
    tree = ast.parse((POLICY / f"{module}.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] == "compressor"]


def _search(passes_from: float, key=lambda t: round(t, 4), floor: float = 0.0):
    measured: list[tuple[float, str]] = []

    def measure(t: float, variant: str) -> Attempt:
        measured.append((t, variant))
        return Attempt(t, t >= passes_from, f"at {t:g}")

    return TargetSearch(measure, key, lambda f, p: (f + p) / 2, floor=floor), measured


def test_each_choice_is_measured_once():
    search, measured = _search(0.5, key=lambda t: int(t * 4))  # quarter steps: targets share choices
    first = search.measured(0.55)
    assert search.measured(0.6) is first and measured == [(0.55, "none")]
    assert search.measured(0.6, "teacher") is not first and len(search.attempts) == 2


def test_a_passing_start_is_taken_without_a_search():
    search, measured = _search(0.5)
    assert search.run(6, start=0.7).target == 0.7 and measured == [(0.7, "none")]


def test_without_the_gate_only_the_start_is_taken():
    search, measured = _search(2.0)  # nothing passes
    assert search.run(6, start=0.7, gate=False).target == 0.7
    search, measured = _search(2.0)
    assert search.run(6, gate=False) is None and measured == []


def test_a_failing_floor_moves_the_bisection_above_it():
    search, measured = _search(0.99)
    best = search.run(3)
    # the floor a 3-step bisection from 0 reaches is 0.875; it fails, so the steps run above it
    assert measured[0][0] == 0.875 and [t for t, _ in measured[1:]] == [0.9375, 0.96875, 0.984375]
    assert best is None and search.failed == 0.984375


def test_a_passing_floor_leaves_the_bisection_where_it_was():
    search, measured = _search(0.3)
    best = search.run(3)
    assert [t for t, _ in measured] == [0.875, 0.5, 0.25, 0.375]
    assert best.target == 0.375 and search.passed == 0.375


def test_a_rejected_choice_steps_back_and_the_bisection_goes_on_above_it():
    """A confirmation on other windows rejects the choice: the next passing attempt above it is the
    best, and the search bisects between them, measuring only what it has not measured."""
    search, measured = _search(0.3)
    search.run(3)  # 0.875, 0.5, 0.25, 0.375 (best)
    assert search.step_back().target == 0.5 and (search.failed, search.passed) == (0.375, 0.5)
    assert search.bisect(1).target == 0.4375 and len(measured) == 5
    search, _ = _search(0.3)
    search.run(1, start=0.4)
    assert search.step_back() is None and (search.failed, search.passed) == (0.4, 1.0)


def test_a_target_that_chooses_the_rejected_choice_fails_too():
    """Targets a step apart can choose the same (one measurement): after a step back, a target between
    that chooses the rejected choice counts as failing, not as the passing attempt it shares."""
    search, measured = _search(0.3, key=lambda t: round(t, 1))  # 0.375 and 0.4 choose the same (0.4)
    search.run(3)  # 0.875, 0.5, 0.25, 0.375 (best)
    search.step_back()
    best = search.bisect(3)  # 0.4375 chooses what 0.375 chose: it fails; 0.46875 chooses what 0.5 chose
    assert best.target == 0.5 and search.failed == 0.4375 and len(measured) == 4
