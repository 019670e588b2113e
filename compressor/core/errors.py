"""Every error class whose type decides an exit code, and the exit codes.

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


class RecipeError(ValueError):
    """The recipe (or a command-line value standing for a recipe field) is invalid (exit 2)."""


class UnsupportedModelError(ValueError):
    """The model's architecture is not in :data:`compressor.core.archs.ARCHITECTURES` (exit 2)."""


class DataFileError(ValueError):
    """A calibration or evaluation data file cannot be used (exit 2)."""


class NonFiniteWeightsError(ValueError):
    """The checkpoint holds NaN or Inf weights (exit 2)."""


class NonFiniteActivationError(FloatingPointError):
    """A block's activations became NaN/Inf during the forward pass (runtime error, exit 1)."""


class GateFailed(RuntimeError):
    """The quality gate was not met: nothing was written (exit 3). ``attempts``: what was tried."""

    def __init__(self, message: str, attempts: list | None = None):
        super().__init__(message)
        self.attempts = list(attempts or [])


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
