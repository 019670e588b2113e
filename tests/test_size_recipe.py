"""``output.size`` in a recipe: what the schema and the ``--set`` overrides take and refuse.

All of it is decided on the recipe alone, before any model loads: an empty size (an unset shell
variable) is an error, not "no size"; a size in plain bytes may be an integer; and the fields a size
plan never reads (the structural policy, the replacement) are errors naming the field; the KL metric is read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from compressor.recipe import RecipeError, load_recipe, recipe_from_dict
from compressor.recipe.loader import apply_overrides
from compressor.recipe.schema import OutputConfig, Recipe

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, data: dict | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def _sized(**sections) -> dict:
    return {"output": {"size": "Q4_K_M", **sections.pop("output", {})}, **sections}


# -------------------------------------------------------------------------------------------------
# 1. an empty size is an error, not "no size"
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("override", ["output.size=", "output.size=  ", 'output.size=""'])
def test_an_empty_size_from_set_is_an_error_naming_the_forms(tmp_path, override):
    path = _write(tmp_path / "r.yaml", {"output": {"path": str(tmp_path / "out")}})
    with pytest.raises(RecipeError) as err:
        load_recipe(path, [override])
    msg = str(err.value)
    assert "output.size" in msg and "empty" in msg
    for form in ("750MB", "123456789", "4.5bpw", "Q4_K_M", "smallest"):
        assert form in msg
    assert "remove" in msg  # how to not plan a size at all


def test_an_empty_size_in_the_recipe_or_the_api_is_an_error():
    for value in ("", "   "):
        with pytest.raises(RecipeError, match=r"output\.size.*empty"):
            recipe_from_dict({"output": {"size": value}})
        with pytest.raises(ValueError, match=r"empty"):
            OutputConfig(size=value)
    assert recipe_from_dict({"output": {"size": None}}).output.size is None  # null: no size, as documented


def test_set_keeps_an_empty_value_as_given_and_null_as_null():
    """An empty ``--set`` value is what the shell gave (an empty string, for the schema to judge), not null."""
    assert apply_overrides({}, ["output.size="]) == {"output": {"size": ""}}
    assert apply_overrides({}, ["output.size=null"]) == {"output": {"size": None}}


def test_validate_refuses_an_empty_size_from_set(tmp_path, capsys):
    from checkpoints import save_tiny_checkpoint

    from compressor.cli import main

    src = save_tiny_checkpoint(tmp_path / "in", "llama")
    path = _write(tmp_path / "recipe.yaml", {
        "model": {"source": str(src)}, "calibration": {"max_tokens": 2048, "seq_len": 32},
        "evaluation": {"max_tokens": 1024, "seq_len": 64, "stride": 32},
        "policy": {"threshold": -100, "ppl_budget": 0.5}, "replacement": {"kind": "affine"},
        "measure": {"cache": False}})
    assert main(["validate", str(path), "--set", "output.size="]) == 2
    assert "output.size" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------
# 2. a size in bytes may be an integer
# -------------------------------------------------------------------------------------------------


def test_an_integer_size_is_bytes_in_yaml_set_and_the_api(tmp_path):
    path = _write(tmp_path / "r.yaml", "output:\n  size: 123456789\n")
    assert load_recipe(path).output.size == "123456789"
    assert load_recipe(tmp_path / "r.yaml", ["output.size=3582592"]).output.size == "3582592"
    assert recipe_from_dict({"output": {"size": 3582592}}).output.size == "3582592"
    assert recipe_from_dict({"output": {"size": 2.0e6}}).output.size == "2000000"  # a whole float: bytes
    r = Recipe()
    r.output.size = 4096  # assignment is validated the same way
    assert r.output.size == "4096"


def test_oneshot_takes_an_integer_size_override(tmp_path, monkeypatch):
    import compressor
    from compressor.pipeline import runner

    seen = {}
    monkeypatch.setattr(runner, "_execute", lambda recipe, *a, **k: seen.setdefault("recipe", recipe))
    compressor.oneshot(str(tmp_path / "model"), {}, output_dir=tmp_path / "out",
                       overrides={"output.size": 3582592})
    assert seen["recipe"].output.size == "3582592"


@pytest.mark.parametrize("value", [0, -5, 1.5, -2.0, True])
def test_a_size_that_is_not_a_positive_whole_number_of_bytes_is_refused(value):
    with pytest.raises(RecipeError, match=r"output\.size"):
        recipe_from_dict({"output": {"size": value}})


# -------------------------------------------------------------------------------------------------
# 3. the KL metric gates size plans too
# -------------------------------------------------------------------------------------------------


def test_the_kl_metric_with_a_size_is_read_and_its_budget_is_not_an_ignored_field():
    r = recipe_from_dict(_sized(policy={"metric": "kl", "kl_budget": 0.02}))
    assert r.policy.metric == "kl" and r.policy.kl_budget == 0.02
    recipe_from_dict({"policy": {"metric": "kl"}})  # without a size the KL gate runs as before


# -------------------------------------------------------------------------------------------------
# 4. structural fields a size plan never reads
# -------------------------------------------------------------------------------------------------


GREEDY = {"policy": {"strategy": "greedy"}}


@pytest.mark.parametrize("sections, field, alone", [
    ({"policy": {"ffn_keep": 0.5}}, "policy.ffn_keep", None),
    ({"replacement": {"kind": "affine"}}, "replacement.kind", None),
    ({"replacement": {"kind": "prune", "keep": 0.5}}, "replacement.keep", GREEDY),
    ({"replacement": {"kind": "hybrid"}}, "replacement.kind", None),
    ({"policy": {"strategy": "greedy"}}, "policy.strategy", {"replacement": {"kind": "affine"}}),
    ({"policy": {"threshold": 0.8}}, "policy.threshold", {"replacement": {"kind": "affine"}}),
    ({"policy": {"exclude": [1]}}, "policy.exclude", None),
    ({"policy": {"allocation": "uniform"}}, "policy.allocation", None),
    ({"policy": {"confirm_fraction": 0.0}}, "policy.confirm_fraction", None),
    ({"policy": {"max_backoff": 2}}, "policy.max_backoff", None),  # read by `smallest` only
    ({"measure": {"swap_sweep": True}}, "measure.swap_sweep", {"replacement": {"kind": "affine"}}),
])
def test_a_structural_field_with_a_size_is_an_error_naming_it(sections, field, alone):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(_sized(**sections))
    msg = str(err.value)
    assert field in msg and "output.size" in msg and "tensor types" in msg
    assert re.search(rf"[Rr]emove {re.escape(field)}", msg)
    without = dict(sections)
    for name, extra in (alone or {}).items():  # without a size the field is read
        without[name] = {**extra, **without.get(name, {})}
    recipe_from_dict(without)


def test_what_a_size_plan_reads_is_still_taken():
    r = recipe_from_dict(_sized(
        policy={"ppl_budget": 0.02, "confidence": 0.8, "headroom": 0.1, "budget_mode": "absolute", "gate": False},
        replacement={"kind": "prune"},  # the default kind, written out
        measure={"cache": False}))
    assert r.output.size == "Q4_K_M" and not r.policy.gate
    recipe_from_dict(_sized(output={"size": "smallest"}, policy={"max_backoff": 2}))  # smallest steps back
    recipe_from_dict(_sized(policy={"ffn_keep": None}))  # set to its default: nothing ignored


def test_the_shipped_recipes_with_a_size_still_load():
    sized = [p for p in sorted((REPO / "recipes").glob("*.yaml")) if re.search(r"^\s*size:", p.read_text(), re.M)]
    assert sized
    for p in sized:
        assert load_recipe(p).output.size is not None
