"""``tools/`` stays laid out by purpose and wired one way.

* every benchmark sits in the folder of what it measures, a package, with its results beside it, and
  ``tools/README.md`` lists it under that folder's heading;
* a tool run as a file imports the harness as ``tools.benchlib`` through the same short bootstrap;
* the independent checks run without compressor: run as files, they import none of it.
Nothing heavy runs: the checks are started with ``--help`` only.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
GROUPS = sorted(p for p in TOOLS.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "benchlib")
SCRIPTS = sorted(p for g in GROUPS for p in g.glob("*.py") if p.name != "__init__.py")
BOOTSTRAP = ('if not __package__:  # run as a file: the repository root on the path, for `tools.benchlib`\n'
             '    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))\n')
INDEPENDENT = [TOOLS / "checks" / "independent_check.py", TOOLS / "checks" / "llamacpp_perplexity.py"]


def test_tools_is_grouped_by_purpose():
    assert (TOOLS / "__init__.py").exists() and (TOOLS / "benchlib" / "__init__.py").exists()
    assert {g.name for g in GROUPS} >= {"size", "structural", "speed", "distributed", "memory", "checks"}
    loose = sorted(p.name for p in TOOLS.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"tools/ has scripts outside a group folder: {loose}; move each to the folder of what it measures"
    assert not (TOOLS / "results").exists(), "results live beside their tools: tools/GROUP/results/"
    assert len(SCRIPTS) > 40


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g.name)
def test_the_readme_lists_each_tool_under_its_folder(group: Path):
    sections = re.split(r"^## ", (TOOLS / "README.md").read_text(encoding="utf-8"), flags=re.M)
    section = next((s for s in sections if f"`{group.name}/`" in s.splitlines()[0]), None)
    assert section is not None, f"tools/README.md has no heading naming `{group.name}/`"
    missing = [p.name for p in group.glob("*.py") if p.name != "__init__.py" and f"| `{p.name}` |" not in section]
    assert not missing, f"tools/README.md's `{group.name}/` table does not list {missing}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(TOOLS)))
def test_a_tool_imports_the_harness_one_way(script: Path):
    text = script.read_text(encoding="utf-8")
    first = re.search(r"^from tools\.", text, flags=re.M)
    if first:
        assert BOOTSTRAP in text[: first.start()], f"{script.name}: put the bootstrap before its first tools import"
    assert not re.search(r"^\s*(from|import) (benchlib|bench_\w+|offgrid|independent_check)\b", text, flags=re.M), (
        f"{script.name} imports a tool by its bare name; import it as tools.GROUP.NAME (or from tools.benchlib)")


@pytest.mark.parametrize("script", INDEPENDENT, ids=lambda p: p.name)
def test_the_independent_checks_import_no_compressor(script: Path):
    """Run as a file (``--help``: nothing is loaded), the check's imports hold no compressor module."""
    proc = subprocess.run([sys.executable, "-X", "importtime", str(script), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert "tools.benchlib" in imported or script.name == "llamacpp_perplexity.py"
    leaked = [m for m in imported if m == "compressor" or m.startswith("compressor.")]
    assert not leaked, f"{script.name} imports {leaked}: an independent check must run without compressor"


def test_block_compressor_refuses_it_wherever_it_is_installed():
    """The checks' guard: compressor is installed (editable) in this venv, and its source is on the path (``-c``
    puts the working folder, the repository root, there)."""
    code = "from tools.benchlib import block_compressor; block_compressor(); import compressor"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "compressor is blocked in this check" in proc.stderr, proc.stderr[-2000:]
