"""Every error class whose type decides an exit code, and the exit codes.

One class per exit code: :class:`InputError` (and its subclasses) → 2, :class:`GateFailed` → 3,
anything else → 1 (:func:`exit_code_for`).

The bottom of the package: it imports nothing. A module that detects bad input
raises one of these (or a subclass), and the CLI maps the type to the exit
code documented in ``docs/exit-codes.md``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # runtime error
EXIT_INVALID = 2  # invalid recipe / bad input (nothing was loaded or written)
EXIT_GATE = 3  # perplexity gate failed: nothing written
EXIT_INTERRUPTED = 130


class InputError(ValueError):
    """Bad input (exit 2): the message names the input, what is wrong and the fix."""


class RecipeError(InputError):
    """The recipe (or a command-line value standing for a recipe field) is invalid (exit 2)."""


class UnsupportedModelError(InputError):
    """The model's architecture is not in :data:`compressor.core.archs.ARCHITECTURES` (exit 2)."""


class DataFileError(InputError):
    """A calibration or evaluation data file cannot be used (exit 2)."""


class NonFiniteWeightsError(InputError):
    """The checkpoint holds NaN or Inf weights (exit 2)."""


class NonFiniteActivationError(FloatingPointError):
    """A block's activations became NaN/Inf during the forward pass (runtime error, exit 1)."""


class GateFailed(RuntimeError):
    """The gate could not be met (exit 3): nothing was written.

    ``report`` is the run report (``status: rejected``), ``attempts`` every global target the
    allocation tried (empty for the greedy strategy) and ``result`` the
    :class:`~compressor.policy.compress.CompressionResult` (its model holds what the gate last
    left installed)."""

    def __init__(self, message: str, *, report: dict | None = None, attempts: list | None = None,
                 result=None) -> None:
        super().__init__(message)
        self.message = message
        self.report = report or {}
        self.attempts = list(attempts or [])
        self.result = result


class MissingExtraError(InputError):
    """A recipe asks for something an optional extra provides, and it is not installed (exit 2)."""


#: Errors that mean "bad input" (exit code EXIT_INVALID) wherever they surface.
INVALID_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    InputError, RecipeError, UnsupportedModelError, DataFileError, NonFiniteWeightsError,
    FileExistsError, FileNotFoundError,
)


def exit_code_for(error: BaseException) -> int:
    """The CLI's exit code for an exception (see ``docs/exit-codes.md``)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, GateFailed):
        return EXIT_GATE
    return EXIT_INVALID if isinstance(error, INVALID_INPUT_ERRORS) else EXIT_ERROR
