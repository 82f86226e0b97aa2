"""``adapt`` command line.  Each subcommand lives next to the code it drives and registers itself.

A subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func=handler``; ``handler(args) -> int`` returns the exit code.  Errors derived from
``AdaptError`` become one line on stderr and their exit code; nothing prints a traceback
unless ``ADAPT_DEBUG=1``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from adapt.core.errors import EXIT_BAD_INPUT, AdaptError
from adapt.core.inputs import config_error_line, is_config_validation_error
from adapt.core.interrupts import Terminated, exit_code_of_interrupt, sigterm_raises

# Modules that contribute subcommands, in the order they appear in --help.
SUBCOMMAND_MODULES = [
    "adapt.app.commands.inspect",
    "adapt.app.commands.ops",
    "adapt.app.commands.run",
    "adapt.app.commands.report",
    "adapt.app.commands.gate",
    "adapt.app.commands.validate",
    "adapt.app.commands.generate_check",
    "adapt.app.commands.plan",
    "adapt.app.commands.train",
    "adapt.app.commands.launch",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors are bad input too: exit 2, one line
        raise SystemExit(_fail(f"{self.prog}: {message} (see {self.prog} --help)", EXIT_BAD_INPUT))


def _fail(message: str, code: int) -> int:
    print(f"adapt: error: {message}", file=sys.stderr)
    return code


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; given the subcommand about to run, only its module is imported when it registers it
    (subcommands live in modules of their name), so one command never pays for another's imports."""
    parser = _Parser(
        prog="adapt",
        description="Day-0 model adaptation: inspect, validate, plan and train a new model correctly and fast.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    likely = [name for name in SUBCOMMAND_MODULES if name.rsplit(".", 1)[-1] == command]
    for name in likely:
        importlib.import_module(name).register(sub)
    if command not in sub.choices:
        for name in SUBCOMMAND_MODULES:
            if name not in likely:
                importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(next((a for a in argv if not a.startswith("-")), None))
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        with sigterm_raises():
            return int(args.func(args) or 0)
    except AdaptError as err:
        if os.environ.get("ADAPT_DEBUG"):
            raise
        return _fail(_one_line(str(err)), err.exit_code)
    except KeyboardInterrupt as err:
        return _fail(
            "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted", exit_code_of_interrupt(err)
        )
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except Exception as err:  # a bug in adapt, not the user's fault: one line, traceback on request
        if os.environ.get("ADAPT_DEBUG"):
            raise
        if is_config_validation_error(err):  # transformers rejected a value of the user's config.json
            return _fail(f"config.json: transformers rejects it: {config_error_line(err)}", EXIT_BAD_INPUT)
        message = _one_line(f"{type(err).__name__}: {err}")
        return _fail(f"internal error: {message} (set ADAPT_DEBUG=1 for the traceback)", 1)


def _one_line(text: str) -> str:
    """Messages are one line: a wrapped library error keeps its first non-empty line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines[:1]) if lines else text


if __name__ == "__main__":
    sys.exit(main())
