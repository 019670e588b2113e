"""The documentation stays a short README plus pages in ``docs/``, and stays wired.

* the README is a page (≤ 200 lines) and keeps its two commands, which CI runs;
* every relative link in the README and in ``docs/*.md`` points to a file that
  exists, and a ``#anchor`` to a heading of that file (GitHub's slug rules);
* every ``compressor.<name>`` used in the README's Python examples exists.
  Nothing is executed: the examples load models;
* every file of ``tools/`` the pages quote (a benchmark, a result) exists, where
  ``tools/README.md`` says it is.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^(```|~~~)")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
CODE_SPAN = re.compile(r"(`+).*?\1")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def _blocks(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The lines outside fenced code, and every fenced block as (info string, body)."""
    prose, blocks = [], []
    fence, info, body = None, "", []
    for line in text.splitlines():
        m = FENCE.match(line.strip())
        if fence is None and m:
            fence, info, body = m.group(1), line.strip()[3:].strip(), []
        elif fence is not None and line.strip().startswith(fence):
            blocks.append((info, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lowercase, spaces → '-',
    punctuation dropped except '-' and '_'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links → their text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())  # drops `code` and *emphasis* marks too
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = _blocks(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    prose, _ = _blocks(path.read_text(encoding="utf-8"))
    out = []
    for line in prose:
        line = CODE_SPAN.sub("", line)
        out += INLINE_LINK.findall(line)
        m = REFERENCE_DEF.match(line)
        if m:
            out.append(m.group(1))
    return out


def test_slug_follows_github():
    assert slug("Does the gate transfer?") == "does-the-gate-transfer"
    assert slug("Large models: onloading, the memory model") == "large-models-onloading-the-memory-model"
    assert slug("What is measured (`profile.json`, per block)") == "what-is-measured-profilejson-per-block"
    assert slug("keep_fraction and R²_lin") == "keep_fraction-and-r²_lin"


def test_readme_is_a_page():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 200, f"README.md has {n} lines; keep it ≤ 200 and move reference material to docs/"


def test_readme_reads_in_five_minutes():
    """At most ~1,200 words above the documentation links, and no table cell a screen would wrap."""
    text = README.read_text(encoding="utf-8")
    above = text.split("## Documentation")[0]
    words = len(above.split())
    assert words <= 1200, f"README.md has {words} words above its documentation links; move numbers to docs/"
    prose, _ = _blocks(text)
    long = [len(c.strip()) for line in prose if line.startswith("|") for c in line.split("|")[1:-1]
            if len(c.strip()) > 300]
    assert not long, f"README.md has table cells of {long} characters; keep each ≤ 300 and move the rest to docs/"


def test_readme_keeps_its_two_commands():
    _, blocks = _blocks(README.read_text(encoding="utf-8"))
    lines = {line.split(" #")[0].strip() for info, body in blocks if info in ("bash", "sh", "") for line in body.splitlines()}
    for command in ("bash tools/quickstart.sh", "bash tools/test.sh"):
        assert command in lines, f"README.md must show the command `{command}` on a line of its own (CI runs it)"


def test_docs_exist():
    assert DOCS, "docs/ has no pages"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:, …
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name} "
                       f"(has: {', '.join(sorted(anchors(dest)))})")
    assert not bad, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(bad)


TOOLS_README = ROOT / "tools" / "README.md"
QUOTING = [*PAGES, TOOLS_README, *sorted((ROOT / "recipes").glob("*.yaml"))]
TOOL_PATH = re.compile(r"(?<![\w.-])tools/[\w./*{},-]*[\w*}/]")  # tools/size/results/x.json, …/{a,b}_*.json
GROUP_PATH = re.compile(r"`((?!tools/)[\w-]+/results/[^`\s]+)`")  # tools/README.md's: size/results/x.json
PLACEHOLDER = re.compile(r"(^|/)[A-Z]+(/|\.|$)")  # tools/GROUP/NAME.py


def expand(pattern: str) -> list[str]:
    """A shell brace pattern's alternatives: ``a_{x,y}.json`` → ``a_x.json``, ``a_y.json``."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [p for alt in m.group(1).split(",") for p in expand(pattern[: m.start()] + alt + pattern[m.end():])]


def quoted_tool_files(page: Path) -> list[tuple[str, Path]]:
    """Every ``tools/…`` path ``page`` names (a glob or brace pattern expanded), and in ``tools/README.md``
    the ``GROUP/results/…`` paths of its tables, each with where it must be."""
    text = page.read_text(encoding="utf-8")
    found = [(q, ROOT) for q in TOOL_PATH.findall(text)]
    if page == TOOLS_README:
        found += [(q, page.parent) for q in GROUP_PATH.findall(text)]
    return [(p, base / p) for q, base in found if not PLACEHOLDER.search(q) for p in expand(q)]


@pytest.mark.parametrize("page", QUOTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_tool_files_exist(page: Path):
    """A benchmark or result moved (tools/ is laid out by purpose) leaves no page quoting its old path."""
    missing = sorted({q for q, path in quoted_tool_files(page)
                      if not (sorted(path.parent.glob(path.name)) if "*" in q else path.exists())})
    assert not missing, (f"{page.relative_to(ROOT)} quotes tools/ files that do not exist (see tools/README.md "
                         f"for where each benchmark and its results are): {missing}")


def test_the_quoted_tool_files_are_found():
    """The check above sees the paths it is meant to: a results JSON, a glob, braces, a tool, a group's result."""
    docs = {q for page in PAGES for q, _ in quoted_tool_files(page)}
    assert "tools/size/results/size_frontier_smollm2.json" in docs
    assert "tools/structural/results/independent_qwen_wt_prune_stdlib.json" in docs  # from {wikitext,stdlib}
    assert any("*" in q for q in docs) and "tools/checks/independent_check.py" in docs
    assert "speed/results/bench_speed.json" in {q for q, _ in quoted_tool_files(TOOLS_README)}


def test_every_doc_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def _readme_names() -> set[str]:
    """Every ``compressor.<name>`` and ``from compressor import <name>`` in the README's Python blocks."""
    _, blocks = _blocks(README.read_text(encoding="utf-8"))
    names = set()
    for info, body in blocks:
        if info not in ("python", "py"):
            continue
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "compressor":
                names.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and node.module == "compressor":
                names.update(a.name for a in node.names)
    return names


def test_readme_python_names_exist():
    import compressor

    names = _readme_names()
    assert names, "README.md shows no compressor.<name> in a python block"
    missing = sorted(n for n in names if not hasattr(compressor, n))
    assert not missing, f"README.md uses compressor.{missing} which do not exist"


def _schema_sections():
    from compressor.recipe import schema

    return {"model": schema.ModelConfig, "calibration": schema.CalibrationConfig,
            "evaluation": schema.EvaluationConfig, "measure": schema.MeasureConfig, "policy": schema.PolicyConfig,
            "output": schema.OutputConfig}


def test_every_policy_and_evaluation_field_is_in_the_recipe_reference():
    """The gate's own fields cannot be added without documenting them (docs/recipes.md)."""
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    sections = _schema_sections()
    missing = [f"{sec}.{name}" for sec in ("policy", "evaluation") for name in sections[sec].model_fields
               if f"`{sec}.{name}`" not in text and f"`.{name}`" not in text and f"/ `.{name}`" not in text
               and name != "refit"]
    assert not missing, f"undocumented in docs/recipes.md: {missing}"


def test_schema_names_no_version_that_does_not_exist():
    """A field description saying 'removed in 0.2' while the tool is 0.1 misleads (issue 34)."""
    import re

    from compressor.core.version import __version__

    current = tuple(int(x) for x in __version__.split(".")[:2])
    for sec, cls in _schema_sections().items():
        for name, field in cls.model_fields.items():
            for major, minor in re.findall(r"\b(?:in|since|from|version) (\d+)\.(\d+)\b", field.description or ""):
                assert (int(major), int(minor)) <= current, f"{sec}.{name} names version {major}.{minor}"


def test_the_gate_docs_name_the_code_domain_files():
    from compressor.inputs.data import EMBEDDED_CODE_FILES

    text = (ROOT / "docs" / "gate.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in text for name in EMBEDDED_CODE_FILES)
    assert all(name.startswith("_") for name in EMBEDDED_CODE_FILES)  # outside the public-stdlib check


def test_the_default_recipe_gates_as_the_schema_does():
    """recipes/smollm2-135m.yaml and the schema's defaults tell one story about the gate."""
    from compressor.recipe import Recipe, load_recipe

    r, d = load_recipe(ROOT / "recipes" / "smollm2-135m.yaml"), Recipe()
    assert [e.dataset for e in r.evaluation_domains()] == [e.dataset for e in d.evaluation_domains()]
    for got, want in zip(r.evaluation_domains(), d.evaluation_domains()):
        assert (got.seq_len, got.stride, got.max_tokens) == (want.seq_len, want.stride, want.max_tokens)
    for name in ("metric", "ppl_budget", "confidence", "budget_mode"):
        assert getattr(r.policy, name) == getattr(d.policy, name), name


def test_the_default_recipe_is_the_schema_defaults():
    """recipes/smollm2-135m.yaml and an empty recipe run the same search (issue 34: the schema defaulted to
    affine swaps and a greedy search while the default recipe pruned with allocate): every calibration,
    evaluation, policy and replacement field the recipe sets is the schema's default."""
    from compressor.recipe import Recipe, load_recipe

    r, d = load_recipe(ROOT / "recipes" / "smollm2-135m.yaml"), Recipe()
    assert r.strategy() == d.strategy() == "allocate"
    assert r.replacement.model_dump() == d.replacement.model_dump()
    for sec in ("calibration", "policy", "measure"):
        # the recipe names its strategy (allocate) where the schema says auto, which resolves to it
        assert getattr(r, sec).model_dump(exclude={"strategy"}) == getattr(d, sec).model_dump(exclude={"strategy"}), sec
    assert [e.model_dump() for e in r.evaluation_domains()] == [e.model_dump() for e in d.evaluation_domains()]
