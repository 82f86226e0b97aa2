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

from adapt.errors import EXIT_BAD_INPUT, AdaptError

# Modules that contribute subcommands, in the order they appear in --help.
SUBCOMMAND_MODULES = [
    "adapt.commands.inspect",
    "adapt.commands.ops",
    "adapt.commands.run",
    "adapt.commands.report",
    "adapt.commands.gate",
    "adapt.commands.validate",
    "adapt.commands.generate_check",
    "adapt.commands.plan",
    "adapt.commands.train",
    "adapt.commands.launch",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors are bad input too: exit 2
        self.print_usage(sys.stderr)
        raise SystemExit(_fail(f"{self.prog}: {message}", EXIT_BAD_INPUT))


def _fail(message: str, code: int) -> int:
    print(f"adapt: error: {message}", file=sys.stderr)
    return code


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; given the subcommand about to run, only its module is imported when it registers it
    (subcommands live in modules of their name), so one command never pays for another's imports."""
    parser = _Parser(prog="adapt", description="Day-0 model adaptation: run, train and serve a new model correctly and fast.")
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
        return int(args.func(args) or 0)
    except AdaptError as err:
        if os.environ.get("ADAPT_DEBUG"):
            raise
        return _fail(str(err), err.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # output piped into head & co.
        return 0
    except Exception as err:  # a bug in adapt, not the user's fault: one line, traceback on request
        if os.environ.get("ADAPT_DEBUG"):
            raise
        return _fail(f"internal error: {type(err).__name__}: {err} (set ADAPT_DEBUG=1 for the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
