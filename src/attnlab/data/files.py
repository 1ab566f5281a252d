"""Readers for parallel data on disk, streamed line by line.

Two layouts: one TSV file of ``source<TAB>target`` lines (``read_tsv``), or two aligned text
files, line i of one translating line i of the other (``read_parallel``). Files are UTF-8;
a leading byte-order mark and Windows line endings (\\r\\n) are accepted. Each side is
stripped of surrounding whitespace.

A bad line raises ``DataFormatError`` (a ValueError) whose message names the file, the
1-based line number and the problem. With ``skip_malformed=True`` bad lines are skipped
instead, counted in the reader's ``skipped`` and ``skipped_lines`` (the first few line
numbers), and reported by one warning at the end of the pass, so nothing vanishes silently.
Aligned files of different lengths always raise: that means the alignment is wrong.

    pairs = read_tsv("train.tsv", skip_malformed=True)
    for source, target in pairs:
        ...
    print(pairs.skipped, pairs.skipped_lines)
"""
from __future__ import annotations

import codecs
import os
import warnings
from itertools import zip_longest
from typing import Iterator

Pair = tuple[str, str]
_REPORTED_LINES = 10


class DataFormatError(ValueError):
    """A problem at one line of a data file: ``path``, ``line`` (1-based) and ``problem``."""

    def __init__(self, path: str, line: int, problem: str):
        self.path, self.line, self.problem = path, line, problem
        super().__init__(f"{path}, line {line}: {problem}")


def _lines(path: str) -> Iterator[tuple[int, str | DataFormatError]]:
    """Yield (line number, text) lazily; an undecodable line yields its error instead of text."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8):]
            raw = raw.rstrip(b"\n")
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, DataFormatError(
                    path, number, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start})")


class PairReader:
    """An iterable of (source, target) pairs; each pass re-reads the file(s) lazily."""

    def __init__(self, paths: tuple[str, ...], skip_malformed: bool):
        self.paths, self.skip_malformed = paths, skip_malformed
        self.skipped = 0
        self.skipped_lines: list[int] = []

    def _items(self) -> Iterator[Pair | DataFormatError]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Pair]:
        self.skipped, self.skipped_lines = 0, []
        for item in self._items():
            if isinstance(item, DataFormatError):
                if not self.skip_malformed:
                    raise item
                self.skipped += 1
                if len(self.skipped_lines) < _REPORTED_LINES:
                    self.skipped_lines.append(item.line)
                continue
            yield item
        if self.skipped:
            warnings.warn(f"{' and '.join(self.paths)}: skipped {self.skipped} malformed line(s), "
                          f"first at line(s) {', '.join(map(str, self.skipped_lines))}", stacklevel=2)


class _TsvReader(PairReader):
    def _items(self) -> Iterator[Pair | DataFormatError]:
        path = self.paths[0]
        for number, text in _lines(path):
            if isinstance(text, DataFormatError):
                yield text
                continue
            tabs = text.count("\t")
            if not text.strip():
                problem = "empty line, expected 'source<TAB>target'"
            elif tabs != 1:
                problem = (f"expected 'source<TAB>target' with one tab, found {tabs} tabs" if tabs else
                           "expected 'source<TAB>target', found no tab")
            else:
                source, target = (side.strip() for side in text.split("\t"))
                if source and target:
                    yield source, target
                    continue
                problem = "empty source" if not source else "empty target"
            yield DataFormatError(path, number, problem)


class _ParallelReader(PairReader):
    def _items(self) -> Iterator[Pair | DataFormatError]:
        src_path, tgt_path = self.paths
        last = 0
        for src, tgt in zip_longest(_lines(src_path), _lines(tgt_path)):
            if src is None or tgt is None:
                ended, other = (src_path, tgt_path) if src is None else (tgt_path, src_path)
                raise DataFormatError(ended, last + 1, f"file ended after {last} lines but {other} continues: "
                                                       "aligned files must have the same number of lines")
            last = src[0]
            for path, (number, text) in ((src_path, src), (tgt_path, tgt)):
                if isinstance(text, DataFormatError):
                    yield text
                    break
                if not text.strip():
                    yield DataFormatError(path, number, "empty line")
                    break
            else:
                yield src[1].strip(), tgt[1].strip()


def read_tsv(path: str | os.PathLike, skip_malformed: bool = False) -> PairReader:
    """Stream (source, target) pairs from a file of ``source<TAB>target`` lines."""
    return _TsvReader((os.fspath(path),), skip_malformed)


def read_parallel(src_path: str | os.PathLike, tgt_path: str | os.PathLike,
                  skip_malformed: bool = False) -> PairReader:
    """Stream (source, target) pairs from two aligned files, one sentence per line."""
    return _ParallelReader((os.fspath(src_path), os.fspath(tgt_path)), skip_malformed)
