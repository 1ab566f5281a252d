"""What a data file looks like, and which files of a data directory are which split.

Each task reads its own layout (:mod:`attnlab.data.files`: ``source<TAB>target`` pairs;
:mod:`attnlab.data.labelled`: texts and labels; :mod:`attnlab.data.text`: plain text), and most
files of one layout also parse as another: a labelled TSV is a file of tab-separated pairs, and
any file is text. :func:`describe_file` looks at the start of a file (its first
``SAMPLE_LINES`` lines) and names the layout it most resembles, so that a command given another
task's file can say so instead of scoring it:

- ``"labelled"``: a TSV or CSV whose first line names a text and a label column, or whose last
  column takes few distinct one-word values (at most a quarter as many as there are lines);
- ``"jsonl"``: one JSON object per line;
- ``"pairs"``: one tab on every line, and not labelled;
- ``"text"``: anything else.

:func:`split_files` finds a directory's training, validation and test files by their usual
names (``train.tsv``, ``dev.tsv`` or ``valid.tsv``, ``test.tsv``; a second part such as
``train.de-en.tsv`` is allowed); :func:`data_directory` turns ``--data DIR`` into those files.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import islice

from .files import DataFormatError, _lines

__all__ = ["FileShape", "describe_file", "split_files", "data_directory", "scored_file", "SPLIT_NAMES"]

SAMPLE_LINES = 200
SPLIT_NAMES = {"train": ("train", "training"), "valid": ("valid", "validation", "dev", "val"), "test": ("test",)}
_TEXT_NAMES = ("text", "sentence", "review", "content")       # the column names attnlab.data.labelled reads
_LABEL_NAMES = ("label", "labels", "class", "category")


@dataclass(frozen=True)
class FileShape:
    """``kind`` (module docstring) and a description for messages, such as "labelled texts (a
    header line naming the columns text, label)"."""
    kind: str
    description: str


def describe_file(path: str | os.PathLike) -> FileShape:
    """The layout the start of the file at ``path`` resembles (module docstring)."""
    path = os.fspath(path)
    sample = [t for _, t in islice(_lines(path), SAMPLE_LINES) if not isinstance(t, DataFormatError) and t.strip()]
    if not sample:
        return FileShape("text", "an empty file")
    if all(_is_object(t) for t in sample):
        return FileShape("jsonl", "JSON lines (labelled texts for a classifier)")
    delimiter = "," if path.lower().endswith(".csv") else "\t"
    first = [f.strip().lower() for f in sample[0].split(delimiter)]
    if set(first) & set(_TEXT_NAMES) and set(first) & set(_LABEL_NAMES):
        return FileShape("labelled", f"labelled texts (a header line naming the columns {', '.join(first)})")
    rows = [t.split(delimiter) for t in sample]
    if len(rows) >= 8 and all(len(r) >= 2 for r in rows):
        last = [r[-1].strip() for r in rows]
        distinct = set(last)
        if len(distinct) * 4 <= len(rows) and all(v and " " not in v for v in distinct):
            return FileShape("labelled", f"labelled texts (the last column takes {len(distinct)} values in the "
                                         f"first {len(rows)} lines)")
    if all(t.count("\t") == 1 for t in sample):
        return FileShape("pairs", "sentence pairs (source<TAB>target on every line)")
    return FileShape("text", "plain text")


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def split_files(directory: str | os.PathLike, extensions: tuple[str, ...], flag: str = "--data",
                need: str = "train") -> dict[str, str]:
    """{"train": path, "valid": path, "test": path} for the splits ``directory`` holds, each a file
    whose name's first part is one of :data:`SPLIT_NAMES` and whose name ends with one of
    ``extensions``; ValueError naming ``flag`` if split ``need`` is missing or a split has two."""
    directory = os.fspath(directory)
    names = sorted(n for n in os.listdir(directory) if os.path.isfile(os.path.join(directory, n)))
    found: dict[str, str] = {}
    for split, stems in SPLIT_NAMES.items():
        hits = [n for n in names if n.lower().endswith(extensions) and n.split(".")[0].lower() in stems]
        if len(hits) > 1:
            raise ValueError(f"{flag} {directory}: {len(hits)} {split} files ({', '.join(hits)}); name one with "
                             f"{flag} FILE")
        if hits:
            found[split] = os.path.join(directory, hits[0])
    if need not in found:
        wanted = ", ".join(f"{stem}{e}" for stem in SPLIT_NAMES[need][:3] for e in extensions[:2])
        held = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "no file"
        what = "training" if need == "train" else "validation"
        raise ValueError(f"{flag} {directory}: a directory without a {what} file (looked for {wanted}, ...; it "
                         f"holds {held})")
    return found


def data_directory(data: str | None, valid: str | None, extensions: tuple[str, ...]) -> tuple[str | None, str | None]:
    """(training file, validation file) for ``--data`` and ``--valid``: unchanged where they are
    files; a directory gives its training file (``--data``) or its validation file (``--valid``),
    and ``--data DIR`` without ``--valid`` gives the directory's validation file too, if it has
    one (:func:`split_files`). A test file stays for ``attnlab eval``."""
    if valid is not None and os.path.isdir(valid):
        valid = split_files(valid, extensions, "--valid", need="valid")["valid"]
    if data is None or not os.path.isdir(data):
        return data, valid
    files = split_files(data, extensions)
    return files["train"], valid if valid is not None else files.get("valid")


def scored_file(data: str, extensions: tuple[str, ...]) -> str:
    """The file ``attnlab eval --data`` scores: ``data`` itself, or a directory's test file, else its
    validation file (:func:`split_files`)."""
    if not os.path.isdir(data):
        return data
    try:
        files = split_files(data, extensions, need="test")
    except ValueError:
        files = split_files(data, extensions, need="valid")
    return files.get("test") or files["valid"]
