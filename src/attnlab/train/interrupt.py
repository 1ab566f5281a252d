"""Stopping training on SIGINT (Ctrl-C) or SIGTERM (job schedulers, torchrun) with a checkpoint.

:meth:`attnlab.train.Trainer.fit` runs under :func:`catch_stop_signals`: the first signal only sets
a flag, read at the next optimizer-step boundary, where the Trainer saves a checkpoint and
raises :class:`TrainingInterrupted`; a second signal stops at once (KeyboardInterrupt).
"""
from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Callable

__all__ = ["TrainingInterrupted", "catch_stop_signals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Raised by :meth:`Trainer.fit` after SIGINT or SIGTERM, once a checkpoint of the last
    complete step is written; ``checkpoint`` is its path, ``exit_code`` 128 + the signal
    (130, 143: what a shell reports for a process those signals end)."""

    def __init__(self, signum: int, checkpoint: Path | None):
        self.signum, self.checkpoint, self.exit_code = signum, checkpoint, 128 + signum
        super().__init__(f"{signal.Signals(signum).name}: stopped at an optimizer-step boundary; "
                         f"checkpoint {checkpoint}")


def catch_stop_signals(on_signal: Callable[[int], None], announce: bool = True) -> Callable[[], None]:
    """Until the returned function is called, SIGINT and SIGTERM call ``on_signal(signum)`` (the
    first one) or raise KeyboardInterrupt (the second); calling it puts the previous handlers
    back. Handlers can only be installed from the main thread; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    received: list[int] = []

    def handler(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        if announce:
            print(f"\n{signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                  "(send it again to stop at once)", file=sys.stderr)
        on_signal(signum)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)
    return restore
