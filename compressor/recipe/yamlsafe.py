"""A bounded YAML reader for recipes.

``yaml.safe_load`` runs no code, but it will happily expand aliases: a few
hundred bytes of nested anchors (the "billion laughs") become gigabytes, and
formatting such a value in an error message hangs. Recipes are small, so this
reader refuses what no recipe needs:

* a document larger than :data:`MAX_BYTES`;
* more than :data:`MAX_ALIASES` aliases, or more than :data:`MAX_NODES` nodes
  after expansion (counted while composing, before anything is built);
* nesting deeper than :data:`MAX_DEPTH`;
* a key given twice in one mapping (YAML keeps the last silently; a recipe
  with two ``ppl_budget:`` lines is a mistake, not a choice).

It also reads ``1e-3`` as the number it looks like: YAML 1.1 (PyYAML) needs a
dot (``1.0e-3``) and would give the string "1e-3".
"""

from __future__ import annotations

import re
import reprlib

import yaml

MAX_BYTES = 1 << 20
MAX_ALIASES = 64
MAX_NODES = 20_000
MAX_DEPTH = 32

_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class YAMLLimitError(ValueError):
    """The document is over one of this module's limits."""


_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


def shorten(value) -> str:
    """``repr`` of a user value, cut to a readable length (never the whole of a huge value)."""
    return _short.repr(value)


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._nodes = 0
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: D401 - PyYAML hook
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YAMLLimitError(f"more than {MAX_ALIASES} aliases (*name); a recipe needs none")
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise YAMLLimitError(f"nested deeper than {MAX_DEPTH} levels")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._nodes += _expanded_size(node)
        if self._nodes > MAX_NODES:
            raise YAMLLimitError(f"expands to more than {MAX_NODES} values (nested aliases?)")
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    hash(key)
                except TypeError:
                    continue  # PyYAML reports unhashable keys itself
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"the key {shorten(key)} appears twice (first on line {seen[key] + 1}); "
                        "keep one of them", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _expanded_size(node, _memo=None) -> int:
    """Nodes under ``node`` with every alias expanded (shared sub-trees counted each time they are used)."""
    memo = {} if _memo is None else _memo
    key = id(node)
    if key in memo:
        return memo[key]
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_size(c, memo) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[key] = n
    return n


def load(text: str):
    """Parse one YAML document within the limits; raises :class:`YAMLLimitError` or ``yaml.YAMLError``."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YAMLLimitError(f"larger than {MAX_BYTES // 1024} KiB; a recipe is a few KiB")
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
