"""Progress that suits where it goes: a tqdm bar on a terminal (or in a notebook), plain lines in a log.

A bar redraws itself with carriage returns, which a log file (CI, ``nohup``, a job scheduler:
stderr not a terminal) keeps as hundreds of partial lines. There :class:`LogProgress` writes one
line every ``every_s`` seconds, and one at the end:

    train: step 120/1,056 (11 %), loss 3.2104, lr 1.20e-03, tok_s 12345, elapsed 1:02, eta 8:10
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

__all__ = ["progress_bar", "LogProgress", "LogWindow", "interactive"]


@dataclass
class LogWindow:
    """The Trainer's sums since its last log line (saved in checkpoints, so a resumed run's first
    line averages over the same steps)."""
    loss: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    extras: dict = field(default_factory=dict)


def interactive(stream: TextIO) -> bool:
    """Whether ``stream`` shows a live bar: a terminal, or a notebook (whose widget needs no \\r)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) or "ipykernel" in sys.modules


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class LogProgress:
    """The part of tqdm's interface the Trainer uses (``update``, ``set_postfix``, ``total``,
    ``refresh``, ``close``), writing a plain line every ``every_s`` seconds of ``clock``."""

    def __init__(self, total: int | None, initial: int = 0, desc: str = "", unit: str = "step",
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None):
        self.total, self.n, self.desc, self.unit, self.every_s, self.clock = total, initial, desc, unit, every_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.postfix: dict[str, str] = {}
        self._start_n, self._start = initial, clock()
        self._last_n, self._last = initial, self._start

    def update(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if now - self._last >= self.every_s:
            self._line(now)

    def set_postfix(self, **values) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def refresh(self) -> None:
        """A new total shows in the next line; nothing is redrawn."""

    def close(self) -> None:
        if self.n > self._last_n:
            self._line(self.clock())

    def _line(self, now: float) -> None:
        elapsed = now - self._start
        done = self.n - self._start_n
        where = f"{self.unit} {self.n:,}"
        eta = ""
        if self.total:
            where += f"/{self.total:,} ({100 * self.n / self.total:.0f} %)"
            if done > 0 and self.n < self.total:
                eta = f", eta {_clock_text((self.total - self.n) * elapsed / done)}"
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc}: {where}{extra}, elapsed {_clock_text(elapsed)}{eta}\n")
        self.stream.flush()
        self._last_n, self._last = self.n, now


def progress_bar(total: int | None, *, desc: str, initial: int = 0, unit: str = "step", enabled: bool = True,
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic, stream: TextIO | None = None):
    """A tqdm bar on stderr where it is :func:`interactive`, else a :class:`LogProgress`;
    ``enabled=False``: a bar that shows nothing."""
    from tqdm.auto import tqdm
    stream = stream if stream is not None else sys.stderr
    if not enabled:
        return tqdm(total=total, initial=initial, disable=True)
    if interactive(stream):
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, file=stream)
    return LogProgress(total, initial, desc, unit, every_s, clock, stream)
