"""The package's layers: imports only go down, never round in a circle.

The folder tree is the architecture: ``core`` at the bottom, then the recipe,
fitting, the layer-sequential engine, evaluation and inputs, the policy,
reports, output writers, the pipeline, and the CLI on top. Every import of a
compressor module — including imports inside functions — must go to the same
package or a lower layer. Peers (same rank, different package) do not import
each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "compressor"

LAYERS = {
    "core": 0, "recipe": 1, "fitting": 2, "engine": 3, "evaluation": 4, "inputs": 4,
    "policy": 5, "reports": 6, "analysis": 6, "sizing": 6, "output": 7, "pipeline": 8, "cli": 9, "__main__": 10, "": 10,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """Every compressor module ``name`` imports, anywhere in the file (function bodies too)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "compressor")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "compressor":
                continue
            out.add(mod)
            for a in node.names:  # `from compressor.x import y` where y is a module
                out.add(f"{mod}.{a.name}")
    known = _modules()
    return {m for m in out if m in known and m != name}


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_has_a_layer():
    packages = {_package(m) for m in _modules()}
    assert packages <= set(LAYERS), f"new package(s) without a layer in LAYERS: {sorted(packages - set(LAYERS))}"


def test_imports_only_go_down():
    bad = []
    for mod, path in _modules().items():
        src_pkg = _package(mod)
        for dep in _imports(mod, path):
            dep_pkg = _package(dep)
            if dep_pkg == src_pkg:
                continue
            if dep == "compressor" or LAYERS[dep_pkg] >= LAYERS[src_pkg]:
                bad.append(f"{mod} ({src_pkg or 'top'}, layer {LAYERS[src_pkg]}) imports {dep} "
                           f"({dep_pkg or 'top'}, layer {LAYERS[dep_pkg]})")
    assert not bad, "upward or sideways imports:\n" + "\n".join(sorted(bad))


def test_no_import_circles():
    graph = {m: _imports(m, p) for m, p in _modules().items()}
    # A package's __init__ re-exporting its own modules is how a package shows its API, not a
    # circle of the code: drop the edges from a package to the modules inside it.
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _names_from_own_package(name: str, path: Path) -> set[str]:
    """``pkg.name`` for every name a module inside ``pkg`` takes from ``pkg``'s ``__init__`` (not a submodule):
    the ``__init__`` imports its modules, so that is a circle, however late the import runs."""
    known = _modules()
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and name.startswith(node.module + "."):
            out.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" not in known)
    return out


def test_no_module_takes_names_from_its_own_package():
    """The circle the package-to-its-modules exemption above would hide: ``gguf/target.py`` importing
    ``GGUFWriter`` from ``compressor.output.gguf``, whose ``__init__`` imports ``target`` to register it."""
    bad = sorted(f"{m} imports {n}" for m, p in _modules().items() for n in _names_from_own_package(m, p))
    assert not bad, "names taken from the module's own package __init__ (import them from their module):\n" + "\n".join(bad)


def test_the_own_package_check_sees_a_circle(tmp_path):
    g = tmp_path / "target.py"
    g.write_text("def f():\n    from compressor.output.gguf import GGUFWriter, read  # noqa\n")
    assert _names_from_own_package("compressor.output.gguf.target", g) == {"compressor.output.gguf.GGUFWriter"}


@pytest.mark.parametrize("bottom", ["compressor.core.errors", "compressor.core.version"])
def test_bottom_modules_import_nothing_of_the_package(bottom):
    path = PKG.parent / (bottom.replace(".", "/") + ".py")
    assert _imports(bottom, path) == set()


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The walk must not miss a lazy import: it is how the old circles hid."""
    g = tmp_path / "errors.py"
    g.write_text((PKG / "core" / "errors.py").read_text()
                 + "\n\ndef _lazy():\n    from compressor.pipeline import run  # noqa\n")
    assert "compressor.pipeline" in _imports("compressor.core.errors", g)
