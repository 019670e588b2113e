"""Recipes: one YAML file describes a whole run (schema and loader)."""

from compressor.core.errors import RecipeError
from compressor.recipe.loader import apply_overrides, load_recipe, recipe_from_dict
from compressor.recipe.schema import (
    RECIPE_VERSION, REPLACEMENT_CONFIGS, AffineReplacement, CalibrationConfig, EvaluationConfig, HybridReplacement,
    LowRankReplacement, MeasureConfig, ModelConfig, OutputConfig, PolicyConfig, PruneReplacement, Recipe,
)

__all__ = [
    "RECIPE_VERSION", "REPLACEMENT_CONFIGS", "AffineReplacement", "CalibrationConfig", "EvaluationConfig",
    "HybridReplacement", "LowRankReplacement", "MeasureConfig", "ModelConfig", "OutputConfig", "PolicyConfig",
    "PruneReplacement", "Recipe", "RecipeError", "apply_overrides", "load_recipe", "recipe_from_dict",
]
