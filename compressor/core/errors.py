"""Every error class whose type decides an exit code, and the exit codes.

One class per exit code: :class:`InputError` (and its subclasses) → 2, :class:`GateFailed` → 3,
Ctrl-C (``KeyboardInterrupt``) → 130, :class:`Terminated` (SIGTERM) → 143, anything else → 1
(:func:`exit_code_for`).

The bottom of the package: it imports nothing. A module that detects bad input
raises one of these (or a subclass), and the CLI maps the type to the exit
code documented in ``docs/exit-codes.md``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # runtime error
EXIT_INVALID = 2  # invalid recipe / bad input (nothing was loaded or written)
EXIT_GATE = 3  # perplexity gate failed: nothing written
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2, the shell's convention
EXIT_TERMINATED = 143  # SIGTERM (timeout, docker stop, Slurm): 128 + 15


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


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by a signal other than Ctrl-C (SIGTERM: ``timeout``, ``docker stop``,
    Slurm at its time limit), raised where the run stands as Ctrl-C raises ``KeyboardInterrupt`` — a subclass
    of it, so the run unwinds the same way (its work folder and staging removed) — and exiting with
    128 + the signal's number (:data:`EXIT_TERMINATED` for SIGTERM)."""

    def __init__(self, signum: int = 15, name: str = "SIGTERM") -> None:
        super().__init__(name)
        self.signum = signum
        self.name = name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_name(error: KeyboardInterrupt) -> str:
    """How a stop is named to the user: ``terminated (SIGTERM)`` or ``interrupted (Ctrl-C)``."""
    return f"terminated ({error.name})" if isinstance(error, Terminated) else "interrupted (Ctrl-C)"


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
        return error.exit_code if isinstance(error, Terminated) else EXIT_INTERRUPTED
    if isinstance(error, GateFailed):
        return EXIT_GATE
    return EXIT_INVALID if isinstance(error, INVALID_INPUT_ERRORS) else EXIT_ERROR
