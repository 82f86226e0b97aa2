"""Errors that the CLI turns into one readable line and an exit code (never a traceback)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # a stage or a check ran and failed
EXIT_BAD_INPUT = 2  # the input could not be used at all


class AdaptError(Exception):
    """Base class: ``str(error)`` is the one-line message shown to the user."""

    exit_code = EXIT_FAILED


class BadInput(AdaptError):
    """The user's input (path, config, weights, cluster, plan, flags) cannot be used."""

    exit_code = EXIT_BAD_INPUT


class CheckFailed(AdaptError):
    """A stage ran to completion and its verdict is a failure."""

    exit_code = EXIT_FAILED


class ModelCannotRun(BadInput):
    """The model's own forward refuses a valid batch of token ids: no stage can run it, so the run stops here."""
