"""The ``attnlab`` command: a table of subcommands, each a function with an example in its help.

Each subcommand below registers itself in ``COMMANDS`` with (help, example, add_arguments,
run); the work itself lives in the library (train/, generate.py, viz/), imported lazily so
that ``attnlab --help`` stays fast. Errors that come from the user's input (a malformed file, a bad option) are raised as
``UserError`` (or ValueError) and printed as one line, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from . import __version__


class UserError(Exception):
    """An error in the user's input, shown as one clear line."""


@dataclass
class Command:
    help: str
    example: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, example: str):
    """Register ``run(args)``; the decorated function's ``add_arguments`` attribute adds options."""
    def wrap(run):
        COMMANDS[name] = Command(help, example, getattr(run, "add_arguments", lambda p: None), run)
        return run
    return wrap


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Attention and the Transformer family: train, translate, generate, look inside.",
        epilog="Run 'attnlab COMMAND --help' for a command's options and an example.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help,
                           epilog=f"example:\n  {cmd.example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- subcommands


if __name__ == "__main__":
    sys.exit(main())
