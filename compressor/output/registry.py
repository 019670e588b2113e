"""The one registry of output formats.

Each format's package (:mod:`compressor.output.gguf`, :mod:`compressor.output.ctensors`,
:mod:`compressor.output.hf`) registers one :class:`Format`: its writer (:class:`~compressor.output.base.Writer`:
what it can represent, write, verify) and, when a size can be planned into it, its size target
(:class:`~compressor.sizing.target.SizeTarget`: options, prices, budget, anchor). Nothing else keys anything
by a format's name: a new format is a new package with one :func:`register_format` call, named in
:data:`BUILT_IN` (see
``docs/architecture.md``), the shape llama.cpp's ``convert_hf_to_gguf.py`` gives its architectures
(``@ModelBase.register(...)``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from compressor.core.errors import InputError

if TYPE_CHECKING:
    from compressor.output.base import Writer
    from compressor.sizing.target import SizeTarget


@dataclass(frozen=True)
class Format:
    """One output format: its name (``output.formats``), its writer and, if a size plans into it, its target."""

    name: str
    writer: type[Writer]
    target: type[SizeTarget] | None = None
    folder: bool = False
    """Whether it writes a Hugging Face folder's ``config.json`` and ``model.safetensors`` into the output folder
    (one such format per output)."""


#: format name -> :class:`Format`; filled by each format package's :func:`register_format`.
FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Make ``fmt`` the format of its name; its writer and target must say the same name. A target also words the
    format's file where the report speaks of it (:mod:`compressor.reports.wording`)."""
    from compressor.reports.wording import register_words

    for part in (fmt.writer, fmt.target):
        if part is not None and part.format != fmt.name:
            raise ValueError(f"{part.__name__} is for format {part.format!r}, registered as {fmt.name!r}")
    FORMATS[fmt.name] = fmt
    if fmt.target is not None:
        register_words(fmt.name, fmt.target)
    return fmt


#: The packages that register the built-in formats, imported by :func:`formats` on first use (a format
#: defined elsewhere registers itself when its module is imported).
BUILT_IN = ("compressor.output.ctensors", "compressor.output.gguf", "compressor.output.hf")


def formats() -> dict[str, Format]:
    """Every registered format, the built-in ones imported first."""
    for package in BUILT_IN:
        importlib.import_module(package)
    return FORMATS


def get_writer(name: str) -> Writer:
    """The writer of format ``name``; the error lists the formats that exist."""
    if name not in formats():
        raise ValueError(f"unknown output format {name!r}; known formats: {', '.join(sorted(FORMATS))}")
    return FORMATS[name].writer()


def targets() -> dict[str, type[SizeTarget]]:
    """The formats a size can plan into, and their targets."""
    return {n: f.target for n, f in formats().items() if f.target is not None}


def preset_format(size: str) -> str | None:
    """The format whose anchor ``size`` names (None: a size in bytes, bits per weight, or ``smallest``)."""
    name = str(size).strip().upper()
    return next((f for f, cls in targets().items() if name in cls.presets), None)


def target_for(formats: list[str], size: str, output=None) -> SizeTarget:
    """The one target a recipe's ``output.formats`` plans, checked against the size's name; ``output``: the
    recipe's ``output`` section, for the target's own settings."""
    sized = [f for f in formats if f in targets()]
    named = preset_format(size)
    if not sized:
        add = named or " or ".join(sorted(targets()))
        raise InputError(f"output.size: {size} is the size of the file a deployer ships, but output.formats is "
                         f"{formats}; add {add} to output.formats (or remove output.size)")
    if len(sized) > 1:
        raise InputError(f"output.size plans one file, but output.formats lists {', '.join(sized)}; keep one of "
                         "them (a second run plans the other)")
    if named is not None and named != sized[0]:
        raise InputError(f"output.size: {size} is a {named} size, but the planned format is {sized[0]}; give one of "
                         f"{', '.join(targets()[sized[0]].presets)}, bytes or bits per weight, or plan {named}")
    return targets()[sized[0]](output)


def check_folders(writers: list[str]) -> None:
    """Formats share one output folder: two that each write ``config.json`` and ``model.safetensors`` would
    overwrite each other (:attr:`Format.folder`)."""
    folders = [w for w in writers if w in formats() and FORMATS[w].folder]
    if len(folders) > 1:
        alone = next((f for f in folders if FORMATS[f].target is not None), folders[-1])
        raise InputError(f"output.formats: {', '.join(folders)} each write config.json and model.safetensors into "
                         f"the output folder; keep {alone} alone (with a single-file format beside it if you like), "
                         "and write the other folder in a second run to another output.path")


def source_format(src) -> str | None:
    """The format whose writer re-writes a source file like ``src`` by default (a GGUF source: gguf), or None."""
    name = getattr(src, "gguf_file", None) or ""
    return next((f for f, fmt in formats().items()
                 if fmt.writer.source_suffix and name.endswith(fmt.writer.source_suffix)), None)


def default_format(size: str) -> str:
    """The format a size plans when the recipe names none: the one whose anchor the size names, else gguf."""
    return preset_format(size) or "gguf"
