"""The package's prose stays readable: no line over 120 characters and no module docstring over 25 lines.

A module docstring says what the module is for in a few lines; measurements and history belong in docs/ and the
CHANGELOG (issue 70). Both limits are checked on every module of ``compressor/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "compressor"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINE = 120
MAX_DOCSTRING_LINES = 25


def test_the_package_has_modules():
    assert len(MODULES) > 50, f"found only {len(MODULES)} modules under {PACKAGE}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_line_over_120_characters(path: Path):
    long = [(i, len(line)) for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if len(line) > MAX_LINE]
    assert not long, f"{path.name}: lines over {MAX_LINE} characters (line, length): {long}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_module_docstring_is_a_few_lines(path: Path):
    body = ast.parse(path.read_text(encoding="utf-8")).body
    first = body[0] if body else None
    has_doc = (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
               and isinstance(first.value.value, str))
    n = first.end_lineno - first.lineno + 1 if has_doc else 0  # the lines it takes in the file, quotes included
    assert n <= MAX_DOCSTRING_LINES, (f"{path.name}: module docstring of {n} lines; keep it ≤ {MAX_DOCSTRING_LINES} "
                                      "(what the module is for) and move the rest to docs/")


def test_the_limits_can_fail(tmp_path: Path):
    """The checks above catch what they are meant to (a guard against a test that cannot fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text('"""' + "\n".join(["x"] * 30) + '"""\n' + "y = 1  # " + "z" * 130 + "\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="over 120"):
        test_no_line_over_120_characters(bad)
    with pytest.raises(AssertionError, match="docstring of 30 lines"):
        test_module_docstring_is_a_few_lines(bad)
