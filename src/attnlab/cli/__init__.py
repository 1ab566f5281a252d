"""The ``attnlab`` command: a table of subcommands, one module each, with an example in each help.

    attnlab train TASK ...      cli/train.py      (one sub-command per registered task)
    attnlab translate RUN ...   cli/translate.py
    attnlab generate RUN ...    cli/generate.py
    attnlab eval RUN ...        cli/eval.py       (dispatches on the run's recorded task)
    attnlab viz RUN ...         cli/viz.py

A command module defines ``HELP``, ``EXAMPLE``, ``add_arguments(parser)`` and ``run(args)``; the
work itself lives in the library (tasks/, generate/, viz/), imported when the command runs, so
that ``attnlab --help`` stays fast. Errors that come from the user's input (a malformed file, a
bad option, a checkpoint of the wrong kind) are printed as one line, without a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .. import __version__

__all__ = ["main", "build_parser", "UserError", "COMMANDS"]

COMMANDS = ("train", "translate", "generate", "eval", "viz")


class UserError(Exception):
    """An error in the user's input, shown as one clear line."""


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Attention and the Transformer family: train, translate, generate, look inside.",
        epilog="Run 'attnlab COMMAND --help' for a command's options and an example.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = _module(name)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=f"example:\n  {mod.EXAMPLE}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    from ..tasks.run import RunError
    return (UserError, RunError, ValueError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except _user_errors() as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


# what each kind of model is used with (the model registry's kinds; a task records the kind it trains)
COMMAND_FOR_KIND = {"causal-lm": "attnlab generate", "seq2seq": "attnlab translate"}


def open_model_path(path: str, command: str, kinds: tuple[str, ...]):
    """Classify ``path`` (:func:`attnlab.tasks.inspect_path`) and return (PathInfo, kind); a model of
    another kind is a UserError naming what it is and which command takes it."""
    from ..tasks import get_task, inspect_path
    info = inspect_path(path)
    if info.kind == "run":
        kind = get_task(info.run.task).kind
    else:
        from ..tasks.run import architecture_for
        kind = architecture_for(info.model_type, info.architectures, f"{path}/config.json").kind
    if kind not in kinds:
        other = COMMAND_FOR_KIND.get(kind)
        hint = f"; use '{other}'" if other else ""
        raise UserError(f"{path}: {info.describe()}, which 'attnlab {command}' does not take{hint}")
    return info, kind
