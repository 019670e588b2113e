"""How a format words its file where the report speaks of it: the summary's and the model card's phrases.

Each format a size plans says them once, in its size target (:class:`compressor.sizing.target.SizeTarget`, in
the format's package): what its plan chooses, where the file runs, the anchor beside it, how to load it. The
output registry registers each format's target here when the format is registered
(:func:`compressor.output.registry.register_format`), so the report's views ask for a format's words by name
without importing the formats, which sit above them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

from pydantic import BaseModel, ConfigDict, Field


class FormatWords(Protocol):
    """What the report's views ask of a format (a :class:`~compressor.sizing.target.SizeTarget` is one)."""

    runs_in: str
    """Where the planned file runs and was measured ("llama.cpp")."""
    choices: str
    """What a plan chooses per weight, plural ("tensor types")."""

    def shipped(self, folder: Path) -> Path:
        """The planned file in the output folder."""

    def beside(self, preset: dict) -> str:
        """The anchor measured beside the file (a verification entry's ``preset``), as the summary names it."""

    def check_line(self, check: dict, size: dict) -> str | None:
        """The summary's line on this format's verification entry of a file written as it is; None: none."""

    def card_words(self) -> dict[str, str]:
        """The size card's phrases (:class:`CardWords`)."""


class CardWords(BaseModel):
    """The phrases of a size-planned file's model card, with their placeholders."""

    model_config = ConfigDict(extra="forbid")

    file: str = Field(description="the file and its bytes: {bytes}")
    choice: str = Field(description="what the plan chose for every weight")
    where: str = Field(description="where the file was measured")
    anchor: str = Field(description="the anchor's column head: {name}")
    anchor_line: str = Field(description="the anchor, in a sentence: {name}, {bytes}")
    unchanged: str = Field(description="what a size plan changes only, beside a Hugging Face folder")
    best_line: str = Field("", description="a better anchor of no more bytes: {called}, {bytes}, {rows}")
    load: str = Field(description="how to load the file (Markdown)")
    library: str = Field(description="the Hub's library_name")


_WORDS: dict[str, Callable[[], FormatWords]] = {}


def register_words(fmt: str, make: Callable[[], FormatWords]) -> None:
    """Make ``make()`` the words of format ``fmt`` (called by the output registry for each size target)."""
    _WORDS[fmt] = make


def words_for(fmt: str) -> FormatWords | None:
    """The words of format ``fmt``; None for a format no size plans (its package registered none)."""
    make = _WORDS.get(fmt)
    return None if make is None else make()


def planned_words(fmt: str) -> FormatWords:
    """The words of the format a size planned; an error naming the fix when its package is not imported."""
    words = words_for(fmt)
    if words is None:
        known = ", ".join(sorted(_WORDS)) or "none"
        raise LookupError(f"no words for the planned format {fmt!r} (registered: {known}): its package registers "
                          "them with its size target; call compressor.output.registry.formats() first")
    return words
