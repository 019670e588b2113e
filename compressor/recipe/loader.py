"""Reading recipes: YAML text → :class:`~compressor.recipe.schema.Recipe`.

YAML is read by :mod:`compressor.recipe.yamlsafe` (safe, bounded, no
duplicate keys); validation errors are reformatted so that each names
the field path, the bad value and what is allowed.
"""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from compressor.core.errors import RecipeError
from compressor.recipe import yamlsafe
from compressor.recipe.schema import REPLACEMENT_CONFIGS, Recipe
from compressor.recipe.yamlsafe import shorten


def _section_model(annotation) -> type[BaseModel] | None:
    """The section model of a field annotation: ``X``, ``X | list[X]`` and ``list[X]`` all give X."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_model(arg)
        if found is not None:
            return found
    return None


def _union_branch(loc: tuple, data: Any) -> tuple | None:
    """Errors of the ``evaluation: section | list of sections`` union: keep the branch
    matching what was given and drop the branch tag; None = drop this error."""
    if len(loc) < 2 or loc[0] != "evaluation" or not isinstance(loc[1], str):
        return loc
    if "EvaluationConfig" not in loc[1]:  # pydantic's branch tag, e.g. list[function-after[…, EvaluationConfig]]
        return loc
    given = data.get("evaluation") if isinstance(data, dict) else None
    return (loc[0], *loc[2:]) if loc[1].startswith("list[") == isinstance(given, list) else None


def _dataset_branch(loc: tuple, data: Any) -> tuple | None:
    """The same for ``calibration.dataset: name | list of sources`` (a value that is neither keeps the name's
    error alone); None = drop this error."""
    tag = str(loc[2]) if len(loc) > 2 and loc[:2] == ("calibration", "dataset") else ""
    if tag != "str" and "CalibrationSource" not in tag:
        return loc
    cal = data.get("calibration") if isinstance(data, dict) else None
    given = cal.get("dataset") if isinstance(cal, dict) else None
    listed = isinstance(given, list) if isinstance(given, (str, list)) else False
    return (*loc[:2], *loc[3:]) if tag.startswith("list[") == listed else None


def _format_errors(err: ValidationError, data: Any) -> str:
    lines = []
    for e in err.errors():
        e = dict(e, loc=_union_branch(tuple(e["loc"]), data))
        e["loc"] = e["loc"] if e["loc"] is None else _dataset_branch(e["loc"], data)
        if e["loc"] is None:
            continue
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        if e["type"] == "model_type" and e["loc"] == ("evaluation",):
            lines.append(
                f"evaluation: expected a section (mapping) or a list of sections (got {shorten(e.get('input'))})"
            )
            continue
        if e["type"] == "extra_forbidden":
            parent = Recipe
            parts = list(e["loc"][:-1])
            if parts[:1] == ["replacement"] and len(parts) > 1 and parts[1] in REPLACEMENT_CONFIGS:
                # the discriminated union puts the kind tag in the path
                parent, parts = REPLACEMENT_CONFIGS[parts[1]], []
                loc = f"replacement.{e['loc'][-1]} (kind {e['loc'][1]})"
            for part in parts:
                if isinstance(part, int):
                    continue  # list index: same section model
                field = parent.model_fields.get(str(part))
                parent = _section_model(field.annotation) if field is not None else None
                if parent is None:
                    break
            allowed = f"; allowed keys here: {', '.join(parent.model_fields)}" if parent else ""
            lines.append(f"{loc}: unknown key{allowed}")
        else:
            bad = e.get("input")
            shown = "" if isinstance(bad, dict) else f" (got {shorten(bad)})"
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{loc}: {msg}{shown}")
    return "invalid recipe:\n  " + "\n  ".join(lines)


def recipe_from_dict(data: Any) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"invalid recipe: the top level must be a mapping of sections, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, data)) from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.path=value`` overrides (values parsed as YAML). An empty value stays the empty string
    the shell gave, for the schema to judge: YAML would read it as null, and ``--set output.size=$SIZE``
    with ``SIZE`` unset must not silently mean "no size" (``null`` says that)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {shorten(item)}: expected key.path=value, e.g. policy.threshold=0.95")
        try:
            value = raw if not raw.strip() else yamlsafe.load(raw)
        except yamlsafe.YAMLLimitError as e:
            raise RecipeError(f"--set {shorten(item)}: the value is refused: {e}") from None
        except yaml.YAMLError as e:
            raise RecipeError(f"--set {shorten(item)}: value is not valid YAML: {e}") from None
        node = data
        parts = key.split(".")
        for i, p in enumerate(parts[:-1]):
            node = _step(node, p, parts[i + 1], item)
        last = parts[-1]
        if isinstance(node, list):
            node[_index(node, last, parts[-2], item)] = value
        else:
            node[last] = value
    return data


def _step(node, part: str, following: str, item: str):
    """One step down an override's path: a section by name, or a list's item by its index
    (``evaluation.2.seed``)."""
    if isinstance(node, list):
        return _checked(node[_index(node, part, None, item)], part, item)
    if part not in node and following.isdigit():
        raise RecipeError(f"--set {shorten(item)}: {shorten(part)}.{following} names item {following} of a list "
                          f"that this recipe does not write out; write the whole list (--set '{shorten(part)}=[...]' "
                          "or in the recipe)")
    return _checked(node.setdefault(part, {}), part, item)


def _checked(nxt, part: str, item: str):
    if not isinstance(nxt, (dict, list)):
        raise RecipeError(f"--set {shorten(item)}: {shorten(part)} is not a section")
    return nxt


def _index(items: list, part: str, name: str | None, item: str) -> int:
    """``part`` as an index of ``items`` (a list of sections such as ``evaluation``)."""
    where = f"{shorten(name)} " if name else ""
    if not part.isdigit():
        raise RecipeError(f"--set {shorten(item)}: {where}is a list of {len(items)} sections; name one by its "
                          f"index (0..{len(items) - 1}) before {shorten(part)}, e.g. evaluation.0.max_tokens=4096")
    i = int(part)
    if i >= len(items):
        raise RecipeError(f"--set {shorten(item)}: index {i} is past the end of a list of {len(items)} sections "
                          f"(0..{len(items) - 1})")
    return i


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a YAML recipe. Raises :class:`RecipeError`."""
    p = Path(path).expanduser()
    text = _read_recipe_text(p, str(path))
    try:
        data = yamlsafe.load(text)
    except yamlsafe.YAMLLimitError as e:
        raise RecipeError(f"recipe {str(path)!r} is refused: {e}. Write the values out plainly") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {str(path)!r} is not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise RecipeError(
            f"invalid recipe {str(path)!r}: the top level must be a mapping of sections (model:, calibration:, …), "
            f"got {type(data).__name__}"
        )
    recipe = recipe_from_dict(apply_overrides(data or {}, overrides or []))
    recipe._source_file = p.resolve()
    return recipe


def _read_recipe_text(p: Path, shown: str) -> str:
    if p.is_dir():
        raise RecipeError(
            f"recipe {shown!r} is a folder; expected a YAML recipe file, e.g. recipes/smollm2-135m.yaml"
        )
    if not p.exists():
        raise RecipeError(
            f"recipe file {shown!r} does not exist; expected a YAML recipe file, e.g. recipes/smollm2-135m.yaml"
        )
    if not p.is_file():
        raise RecipeError(f"recipe {shown!r} is not a regular file; expected a YAML recipe file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"recipe {shown!r} cannot be read: {e.strerror}; check its permissions") from None
    if b"\0" in raw[:8192]:
        raise RecipeError(
            f"recipe {shown!r} is a binary file, not a YAML recipe; give the path of a .yaml recipe "
            "(see recipes/ for examples)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(
            f"recipe {shown!r} is not UTF-8 text (bad byte at offset {e.start}); a recipe is a YAML file in UTF-8. "
            "Re-save it as UTF-8"
        ) from None
