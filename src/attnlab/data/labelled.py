"""Labelled texts: reading TSV, CSV and JSON-lines files, and the embedded sentiment data set.

File formats, chosen by the file's extension:
- ``.tsv``: one example per line, fields split on tabs (no quoting: a quote is text);
- ``.csv``: comma-separated fields as RFC 4180 has them: a quoted field may hold commas,
  doubled quotes and line breaks;
- ``.jsonl`` / ``.json``: one JSON object per line, e.g. ``{"text": "...", "label": "pos"}``.

A TSV or CSV may start with a header line. The first row is a header only if it names the
columns: it holds one of :data:`TEXT_COLUMNS` or :data:`LABEL_COLUMNS`, or the name given as
``text_column`` / ``label_column``. Otherwise it is data (AG News and many other sets come
without a header): the label is the column with the fewest distinct values (of equals, the shorter),
the text is the other columns joined by a space, and ``text_column`` / ``label_column`` may name
columns by their 1-based number instead. :attr:`Examples.layout` says which reading was chosen.

With a header, the text column defaults to the first of :data:`TEXT_COLUMNS` the header has, the
label column to the first of :data:`LABEL_COLUMNS`. Labels are kept as strings (a JSON number 1
is "1"). A field may be of any length. A bad line raises :class:`DataFormatError` naming the
file and line (a CSV record's first line); with ``skip_malformed`` it is counted in ``skipped``
instead. A file with no example at all is always an error.

:func:`sentiment_corpus` generates the embedded data set: short English reviews whose label
(negative / positive) follows from their words, including a negation ("not good" is
negative), so that a model must look at more than single words to get every one right.
"""
from __future__ import annotations

import csv
import json
import os
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from .files import DataFormatError, _lines

__all__ = ["TEXT_COLUMNS", "LABEL_COLUMNS", "Examples", "read_labelled", "sentiment_corpus", "sort_labels"]

TEXT_COLUMNS = ("text", "sentence", "review", "content")
LABEL_COLUMNS = ("label", "labels", "class", "category")
FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass
class Examples:
    """Texts and their labels, with the line each came from (for messages), what was skipped,
    and how the file was read (``layout``: the header's columns, or which columns of a
    headerless file are text and label)."""
    path: str
    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skipped: int = 0
    layout: str = ""

    def __len__(self) -> int:
        return len(self.texts)


def sort_labels(labels) -> list[str]:
    """The distinct labels in order: numerically when every one is an integer ("2" before "10"),
    else alphabetically."""
    distinct = set(labels)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)


def _column(path: str, columns: list[str], given: str | None, guesses: tuple[str, ...], what: str, flag: str) -> str:
    if given is not None:
        if given not in columns:
            raise ValueError(f"{path}: no {what} column {given!r} (columns: {', '.join(columns)})")
        return given
    found = next((c for c in guesses if c in columns), None)
    if found is None:
        raise ValueError(f"{path}: no {what} column (looked for {', '.join(guesses)}; found {', '.join(columns)}); "
                         f"name it with {flag}")
    return found


@contextmanager
def _any_field_size():
    """Let the csv module read fields of any length (its default stops at 128 KB), for this read only."""
    before = csv.field_size_limit()
    csv.field_size_limit(min(sys.maxsize, 2 ** 31 - 1))
    try:
        yield
    finally:
        csv.field_size_limit(before)


def _records(path: str, fmt: str) -> Iterator[tuple[int, list[str] | DataFormatError | None]]:
    """(first line number, fields) for every record of a TSV or CSV: None for a blank line, a
    DataFormatError for a line that is not UTF-8 (a CSV record holding such a line)."""
    if fmt == "tsv":
        for number, text in _lines(path):
            yield number, text if isinstance(text, DataFormatError) else (text.split("\t") if text.strip() else None)
        return
    bad: dict[int, DataFormatError] = {}

    def text_lines():
        for number, text in _lines(path):
            if isinstance(text, DataFormatError):
                bad[number] = text
                text = ""
            yield text + "\n"                       # the reader needs the line breaks inside quoted fields

    reader = csv.reader(text_lines())
    first = 1
    with _any_field_size():
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                yield first, DataFormatError(path, first, f"not readable CSV ({e})")
                return
            errors = [bad.pop(n) for n in range(first, reader.line_num + 1) if n in bad]
            if errors:
                yield first, errors[0]
            else:
                yield first, fields if any(f.strip() for f in fields) else None
            first = reader.line_num + 1


def _is_header(fields: list[str], text_column: str | None, label_column: str | None) -> bool:
    names = {f.strip() for f in fields}
    known = set(TEXT_COLUMNS) | set(LABEL_COLUMNS) | {c for c in (text_column, label_column) if c is not None}
    return bool(names & known)


def _index(path: str, given: str | None, width: int, what: str) -> int | None:
    """The 0-based column a headerless file's ``given`` names by number (None: not given)."""
    if given is None:
        return None
    if not given.isdigit() or not 1 <= int(given) <= width:
        raise ValueError(f"{path}: no header line (its first line is data), so the {what} column is a number "
                         f"from 1 to {width}, got {given!r}")
    return int(given) - 1


def _json_rows(path: str) -> Iterator[tuple[int, dict | DataFormatError | None]]:
    """(line number, the line's object, or a DataFormatError; None for a blank line) of a JSON-lines file."""
    for number, text in _lines(path):
        if isinstance(text, DataFormatError) or not text.strip():
            yield number, text if isinstance(text, DataFormatError) else None
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            yield number, DataFormatError(path, number, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        yield number, row if isinstance(row, dict) else DataFormatError(
            path, number, f"expected a JSON object, found {type(row).__name__}")


def read_labelled(path: str | os.PathLike, text_column: str | None = None, label_column: str | None = None,
                  skip_malformed: bool = False) -> Examples:
    """The (text, label) examples of a TSV, CSV or JSON-lines file (module docstring)."""
    path = os.fspath(path)
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown format; give a .tsv or .csv file (a header line naming the columns is "
                         "optional), or a .jsonl file")
    out = Examples(path)
    rows = _json_examples(path, text_column, label_column, out) if fmt == "jsonl" else \
        _table_examples(path, fmt, text_column, label_column, out)
    for number, row in rows:
        if isinstance(row, DataFormatError):
            if not skip_malformed:
                raise row
            out.skipped += 1
            continue
        out.texts.append(row[0])
        out.labels.append(row[1])
        out.lines.append(number)
    if not out.texts:
        raise ValueError(f"{path}: no examples found" + (f" ({out.layout})" if out.layout else ""))
    return out


def _json_examples(path: str, text_column, label_column, out: Examples):
    """(line, (text, label) or DataFormatError) of a JSON-lines file; the first object decides the fields."""
    text_col = label_col = None
    for number, row in _json_rows(path):
        if row is None:
            continue
        if isinstance(row, dict) and text_col is None:
            keys = list(row)
            text_col = _column(path, keys, text_column, TEXT_COLUMNS, "text", "--text-column")
            label_col = _column(path, keys, label_column, LABEL_COLUMNS, "label", "--label-column")
            out.layout = f"JSON lines: text field {text_col!r}, label field {label_col!r}"
        yield number, _example(path, number, row, text_col, label_col) if isinstance(row, dict) else row


def _table_examples(path: str, fmt: str, text_column, label_column, out: Examples):
    """(line, (text, label) or DataFormatError) of a TSV or CSV, with or without a header line."""
    records = _records(path, fmt)
    first = next(((n, f) for n, f in records if f is not None), None)
    if first is None:
        raise ValueError(f"{path}: empty file; expected one example a line, its text and its label (after a "
                         "header line naming the columns, if it has one)")
    if isinstance(first[1], DataFormatError):
        raise first[1]                    # before the first row there is no layout to go on with
    fields = first[1]
    if _is_header(fields, text_column, label_column):
        columns = [f.strip() for f in fields]
        text_col = _column(path, columns, text_column, TEXT_COLUMNS, "text", "--text-column")
        label_col = _column(path, columns, label_column, LABEL_COLUMNS, "label", "--label-column")
        out.layout = f"a header line: text column {text_col!r}, label column {label_col!r}"
        rows, width, where = list(records), len(columns), "the header names"
        text_at, label_at = [columns.index(text_col)], columns.index(label_col)
    else:
        rows, width, where = [first, *records], len(fields), "line 1 has"
        if width < 2:
            raise ValueError(f"{path}, line {first[0]}: one field and no header line; expected a text and a label "
                             f"separated by {'a tab' if fmt == 'tsv' else 'a comma'}")
        text_at, label_at = _headerless_columns(path, rows, width, text_column, label_column)
        values = len({f[label_at].strip() for _, f in rows if isinstance(f, list) and len(f) == width})
        texts = ", ".join(str(i + 1) for i in text_at)
        plural = "s" if len(text_at) > 1 else ""
        out.layout = (f"no header line (its first line names no column, so it is data): column {label_at + 1} is the "
                      f"label ({values} distinct), column{plural} {texts} the text")
    for number, fields in rows:
        if fields is None or isinstance(fields, DataFormatError):
            if fields is not None:
                yield number, fields
            continue
        if len(fields) != width:
            yield number, DataFormatError(path, number, f"{len(fields)} fields, but {where} {width}")
            continue
        yield number, _checked(path, number, " ".join(fields[i].strip() for i in text_at).strip(),
                               fields[label_at].strip())


def _headerless_columns(path: str, rows: list, width: int, text_column, label_column) -> tuple[list[int], int]:
    """(text columns, label column) of a headerless file: as numbered, else the label is the column
    with the fewest distinct values (of equals, the shorter, then the last) and the text the others."""
    label_at = _index(path, label_column, width, "label")
    text_given = _index(path, text_column, width, "text")
    if label_at is None:
        whole = [f for _, f in rows if isinstance(f, list) and len(f) == width]
        candidates = [i for i in range(width) if i != text_given]
        label_at = min(reversed(candidates), key=lambda i: (len({f[i].strip() for f in whole}),
                                                             sum(len(f[i]) for f in whole)))
    text_at = [text_given] if text_given is not None else [i for i in range(width) if i != label_at]
    if label_at in text_at:
        raise ValueError(f"{path}: --text-column and --label-column name the same column, {label_at + 1}")
    return text_at, label_at


def _checked(path: str, number: int, text: str, label: str) -> tuple[str, str] | DataFormatError:
    if not text:
        return DataFormatError(path, number, "empty text")
    if not label:
        return DataFormatError(path, number, "empty label")
    return text, label


def _example(path: str, number: int, row: dict, text_col: str, label_col: str) -> tuple[str, str] | DataFormatError:
    for col in (text_col, label_col):
        if col not in row:
            return DataFormatError(path, number, f"no field {col!r}")
    text, label = row[text_col], row[label_col]
    if not isinstance(text, str):
        return DataFormatError(path, number, f"the text ({text_col!r}) is not a string")
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        return DataFormatError(path, number, f"the label ({label_col!r}) must be a string or an integer, "
                                             f"got {json.dumps(label)}")
    return _checked(path, number, text.strip(), str(label).strip())


# ----------------------------------------------------------------------------- the embedded data set
_SUBJECTS = ["the movie", "this film", "the acting", "the plot", "the story", "the music", "the ending",
             "the cast", "the script", "the director's work", "this book", "the show", "the soundtrack",
             "the dialogue", "the pacing", "the food", "the service", "this album", "the game", "the hotel"]
_POSITIVE = ["great", "wonderful", "excellent", "delightful", "brilliant", "moving", "charming", "superb",
             "enjoyable", "fantastic", "beautiful", "clever", "funny", "gripping", "lovely", "fresh"]
_NEGATIVE = ["terrible", "boring", "awful", "dull", "bad", "painful", "weak", "tedious", "clumsy", "ugly",
             "annoying", "predictable", "lifeless", "bland", "poor", "messy"]
_VERBS = ["was", "is", "felt", "seemed", "looked", "sounded"]
_ADVERBS = ["", "really ", "very ", "quite ", "truly ", "rather ", "so ", "incredibly "]
_OPENERS = ["", "honestly , ", "overall , ", "i think ", "to be fair , ", "in the end "]
_CLOSERS = ["", " .", " !", " , to be honest .", " from start to finish .", " and i told my friends ."]


def _review(rng: random.Random) -> tuple[str, str]:
    positive = rng.random() < 0.5
    negated = rng.random() < 0.25                 # "not great" is negative, "not boring" positive
    word = rng.choice(_NEGATIVE if positive == negated else _POSITIVE)
    adverb = "" if negated else rng.choice(_ADVERBS)
    text = (f"{rng.choice(_OPENERS)}{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {'not ' if negated else ''}"
            f"{adverb}{word}{rng.choice(_CLOSERS)}")
    return text, "positive" if positive else "negative"


def sentiment_corpus(n_train: int = 4000, n_valid: int = 400, n_test: int = 400,
                     seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, valid, test) lists of (text, label): generated reviews, labels "negative" and
    "positive" in about equal numbers; the same seed gives the same sets."""
    rng = random.Random(f"sentiment:{seed}")
    examples = [_review(rng) for _ in range(n_train + n_valid + n_test)]
    return examples[:n_train], examples[n_train:n_train + n_valid], examples[n_train + n_valid:]
