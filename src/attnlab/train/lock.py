"""One run at a time per run directory: an advisory lock on ``DIR/.lock``.

Two trainings writing into one directory interleave their metrics, overwrite each other's
configuration and checkpoints, and one's restart sweeps the other's half-written checkpoint
away. So a training run holds an exclusive ``flock`` on the file ``.lock`` in its directory for
as long as it runs, and a second run into the directory is refused with one line naming the
holder (pid, host, start time, command), which the holder wrote into the file.

The lock belongs to the open file, not to a pid written somewhere: the operating system drops
it when the holder exits, however it exits (SIGKILL included), so there is never a stale lock to
clean up. The file itself stays (removing it on release would let a process that opened it just
before lock an unlinked file while a third locks a new one); an unlocked ``.lock`` means nothing.

Within one process the lock is re-entrant: the command line and the Trainer it builds both take
it, and consecutive Trainers of a script or a notebook reuse it; the file lock is released when
the last holder in the process releases it (or is garbage-collected). Ranks other than 0 of a
distributed run write nothing and take no lock. On a file system without locks (some network
mounts refuse ``flock``) and off POSIX, runs go unprotected rather than not at all.
"""
from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

try:
    import fcntl
except ImportError:                   # Windows
    fcntl = None

__all__ = ["RunDirectoryBusy", "RunLock", "lock_run", "LOCK_FILE"]

LOCK_FILE = ".lock"
_HELD: dict[str, list] = {}           # resolved directory -> [open lock file, holders in this process]


class RunDirectoryBusy(RuntimeError):
    """Another process is training into the directory; the message is one line naming it."""


def _command() -> str:
    argv = list(sys.argv) or ["python"]
    if argv[0].endswith("__main__.py"):                  # python -m attnlab.cli ...
        argv[0] = "attnlab"
    else:
        argv[0] = os.path.basename(argv[0]) or argv[0]
    text = shlex.join(argv)
    return text if len(text) <= 300 else text[:297] + "..."


def _holder(f) -> str:
    """What the holder wrote into the lock file (read again briefly: it writes just after locking)."""
    for _ in range(10):
        f.seek(0)
        text = f.read()
        try:
            info = json.loads(text)
            return (f"pid {info['pid']} on {info['host']}, started {info['started']}: "
                    f"{info['command']}")
        except (ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "a process that has not said who it is"


class RunLock:
    """A hold on a run directory's lock (see the module docstring); :meth:`release` lets go.
    Also a context manager."""

    def __init__(self, key: str | None):
        self._key = key

    def release(self) -> None:
        key, self._key = self._key, None
        entry = _HELD.get(key) if key is not None else None
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _HELD[key]
            entry[0].close()                      # closing the file drops the flock

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):
        self.release()


def lock_run(directory: str | Path) -> RunLock:
    """Hold the lock of the run directory ``directory`` (created if missing); RunDirectoryBusy
    naming the holder if another process holds it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    key = str(directory.resolve())
    if key in _HELD:
        _HELD[key][1] += 1
        return RunLock(key)
    f = open(directory / LOCK_FILE, "a+")
    if fcntl is not None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                f.close()                         # a file system without locks: run unprotected
                return RunLock(None)
            holder = _holder(f)
            f.close()
            raise RunDirectoryBusy(f"{directory}: another run is training into it ({holder}); wait for it to "
                                   "end or stop it, or train into another directory (--out)") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": _command()}
    f.seek(0)
    f.truncate()
    f.write(json.dumps(info) + "\n")
    f.flush()
    _HELD[key] = [f, 1]
    return RunLock(key)
