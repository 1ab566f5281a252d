"""The ``attnlab`` command: a table of subcommands, one module each, with an example in each help.

    attnlab train TASK ...      cli/train.py      (one sub-command per registered task)
    attnlab translate RUN ...   cli/translate.py
    attnlab generate RUN ...    cli/generate.py
    attnlab chat MODEL ...      cli/chat.py       (a chat model's conversation, streamed)
    attnlab classify RUN ...    cli/classify.py
    attnlab embed DIR ...       cli/embed.py
    attnlab ask RUN IMAGE ...   cli/ask.py        (a vision-language run answers about an image)
    attnlab eval RUN ...        cli/eval.py       (dispatches on the run's recorded task)
    attnlab viz RUN ...         cli/viz.py
    attnlab export RUN OUT      cli/export.py     (a run as a Hugging Face directory)
    attnlab serve MODEL         cli/serve.py      (an OpenAI-compatible HTTP server)
    attnlab quantize MODEL OUT  cli/quantize.py   (4-/8-bit weights, RTN, GPTQ or HQQ, as GGUF)
    attnlab prune MODEL OUT     cli/prune.py      (magnitude or Wanda, unstructured or N:M)
    attnlab transcribe RUN WAV  cli/transcribe.py (a speech run's words for WAV files)

A command module defines ``HELP``, ``EXAMPLE``, ``add_arguments(parser)`` and ``run(args)``; the
work itself lives in the library (tasks/, generate/, viz/), imported when the command runs, so
that ``attnlab --help`` stays fast.

Errors. An error in the user's input (a malformed file, a bad option, a checkpoint of the wrong
kind) is printed as one line naming the file, line or option, exit status 2; docs/errors.md
lists them. Anything else is a bug and keeps its traceback. Which is which:

- :class:`UserError`, :class:`attnlab.tasks.run.RunError` and
  :class:`attnlab.data.files.DataFormatError` are always the user's;
- a ValueError (or FileNotFoundError) is the user's when attnlab's own code raised it, i.e.
  the innermost frame of its traceback lies in attnlab's source: attnlab validates input and
  says what is wrong, while a ValueError from deep inside torch, NumPy or the standard library
  means attnlab passed something it should not have (a JSON or safetensors error that attnlab
  wants to show as one line is caught where the file is read and re-raised naming the file);
- an OSError naming a file (permission denied, disk full, no such file) is the environment's,
  shown as one line wherever it was raised;
- a run directory another training holds (:class:`attnlab.train.lock.RunDirectoryBusy`) is one
  line naming the holder.

A loader that uses another checkpoint than the one asked for (a run whose best is damaged)
says so in one line, ``attnlab COMMAND: warning: ...``, once per command.

``attnlab --debug COMMAND ...`` (or ``ATTNLAB_DEBUG=1``) shows the traceback of every error.
Ctrl-C exits 130; during training the Trainer first saves a checkpoint (cli/train.py).

The process. The command owns its process, so it tunes glibc's allocator for tensor work
(:func:`keep_freed_memory`); the library never touches a user's process.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from .. import __version__

__all__ = ["main", "build_parser", "UserError", "COMMANDS", "texts_anywhere", "keep_freed_memory"]

COMMANDS = ("train", "translate", "generate", "chat", "classify", "embed", "ask", "transcribe", "eval", "viz",
            "export", "serve", "quantize", "prune")


class UserError(Exception):
    """An error in the user's input, shown as one clear line."""


def texts_anywhere(p: argparse.ArgumentParser) -> None:
    """Let the ``texts`` positional take texts after options too (``RUN --top 2 "text"``): argparse
    binds an empty ``nargs="*"`` positional with the first one and would reject the later texts as
    unrecognized arguments, so those are moved back into ``texts``."""
    plain = p.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, extras = plain(args, namespace)
        texts = [a for a in extras if not a.startswith("-")]
        namespace.texts = list(namespace.texts or []) + texts
        return namespace, [a for a in extras if a.startswith("-")]

    p.parse_known_args = parse_known_args


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Attention and the Transformer family: train, translate, generate, look inside.",
        epilog="Run 'attnlab COMMAND --help' for a command's options and an example.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error (also: ATTNLAB_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = _module(name)
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, epilog=f"example:\n  {mod.EXAMPLE}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


_SOURCE = Path(__file__).resolve().parents[1]          # the attnlab package


def _raised_by_attnlab(e: BaseException) -> bool:
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    try:
        return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_SOURCE)
    except (OSError, ValueError):
        return False


def is_user_error(e: BaseException) -> bool:
    """Whether ``e`` is shown as one line (the user's input or environment) or with its
    traceback (a bug); see the module docstring."""
    from ..data.files import DataFormatError
    from ..tasks.run import RunError
    from ..train.lock import RunDirectoryBusy
    if isinstance(e, (UserError, RunError, DataFormatError, RunDirectoryBusy)):
        return True
    if isinstance(e, OSError) and e.filename is not None:
        return True
    return isinstance(e, (ValueError, FileNotFoundError)) and _raised_by_attnlab(e)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse instead of returning it to the OS; True if done.

    By default glibc serves each allocation of 128 KiB and more (every sizeable tensor) from
    fresh pages of its own mmap, and unmaps them when freed, so every intermediate tensor of a
    forward pass page-faults its memory in again. A BERT-base forward of 1,024 tokens ran about a
    tenth faster after this call, transformers' alike; small models' steps showed no difference
    beyond noise (benchmarks/results/code.md).
    Raising the mmap threshold to glibc's maximum (32 MiB) and the trim threshold to 1 GiB keeps
    those pages for the next tensor; the cost is that the process's resident memory stays at its
    peak. Nothing is done off Linux/glibc, when the user set ``MALLOC_MMAP_THRESHOLD_`` or
    ``MALLOC_TRIM_THRESHOLD_`` themselves, or with ``ATTNLAB_MALLOC=default``."""
    if sys.platform != "linux" or os.environ.get("ATTNLAB_MALLOC", "").strip().lower() == "default" \
            or any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    import ctypes
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):                  # not glibc (musl, ...)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    keep_freed_memory()
    debug = args.debug or os.environ.get("ATTNLAB_DEBUG", "") not in ("", "0")
    try:
        with _checkpoint_warnings(args.command):
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        _say(f"attnlab {args.command}: interrupted")
        return 130
    except Exception as e:
        if debug or not is_user_error(e):
            raise
        message = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
        _say(f"attnlab {args.command}: error: {message}")
        return 2


def _say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write: under torchrun every rank shares the
    terminal or pipe, and ``print`` (text, then newline, in two writes) lets another rank's line
    land between them, gluing two error lines into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextmanager
def _checkpoint_warnings(command: str):
    """Show a :class:`attnlab.train.checkpoint.CheckpointWarning` as one line on stderr, once;
    other warnings as Python shows them."""
    from ..train.checkpoint import CheckpointWarning
    with warnings.catch_warnings():
        plain = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, CheckpointWarning):
                print(f"attnlab {command}: warning: {message}", file=sys.stderr)
            else:
                plain(message, category, filename, lineno, file, line)

        warnings.simplefilter("default", CheckpointWarning)
        warnings.showwarning = show
        yield


def open_model_path(path: str, command: str, kinds: tuple[str, ...]):
    """Classify ``path`` (:func:`attnlab.tasks.inspect_path`) and return (PathInfo, kind); a model of
    another kind is a UserError naming what it is and which command takes it (the kind's own
    ``command`` in the model registry)."""
    from ..tasks import get_task, inspect_path
    info = inspect_path(path)
    if info.kind == "run":
        kind = get_task(info.run.task).kind
    else:
        from ..tasks.run import architecture_for
        kind = architecture_for(info.model_type, info.architectures, f"{path}/config.json").kind
    if kind not in kinds:
        from ..models.registry import KINDS
        other = KINDS[kind].command if kind in KINDS else None
        hint = f"; use '{other}'" if other else ""
        raise UserError(f"{path}: {info.describe()}, which 'attnlab {command}' does not take{hint}")
    return info, kind
