"""Labelled texts: reading TSV, CSV and JSON-lines files, and the embedded sentiment data set.

File formats, chosen by the file's extension:
- ``.tsv``: a header line naming the columns, then one example per line, fields split on tabs
  (no quoting: a quote is text);
- ``.csv``: a header line, then comma-separated fields (quoted fields may hold commas);
- ``.jsonl`` / ``.json``: one JSON object per line, e.g. ``{"text": "...", "label": "pos"}``.

The text column defaults to the first of :data:`TEXT_COLUMNS` the header has, the label column
to the first of :data:`LABEL_COLUMNS`. Labels are kept as strings (a JSON number 1 is "1").
A bad line raises :class:`DataFormatError` naming the file and line; with ``skip_malformed``
it is counted in ``skipped`` instead. A file with no example at all is always an error.

:func:`sentiment_corpus` generates the embedded data set: short English reviews whose label
(negative / positive) follows from their words, including a negation ("not good" is
negative), so that a model must look at more than single words to get every one right.
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
from dataclasses import dataclass, field

from .files import DataFormatError, _lines

__all__ = ["TEXT_COLUMNS", "LABEL_COLUMNS", "Examples", "read_labelled", "sentiment_corpus", "sort_labels"]

TEXT_COLUMNS = ("text", "sentence", "review", "content")
LABEL_COLUMNS = ("label", "labels", "class", "category")
FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclass
class Examples:
    """Texts and their labels, with the line each came from (for messages) and what was skipped."""
    path: str
    texts: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skipped: int = 0

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


def _rows(path: str, fmt: str):
    """(line number, dict of column -> value, or a DataFormatError) for every example line, and
    the header's columns (None for JSON lines, whose rows name their own fields)."""
    lines = _lines(path)
    if fmt == "jsonl":
        for number, text in lines:
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
        return
    delimiter = "\t" if fmt == "tsv" else ","
    quoting = csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL
    header = None
    for number, text in lines:
        if isinstance(text, DataFormatError):
            if header is None:
                raise text
            yield number, text
            continue
        if not text.strip():
            yield number, None
            continue
        fields = next(csv.reader(io.StringIO(text), delimiter=delimiter, quoting=quoting))
        if header is None:
            header = [f.strip() for f in fields]
            yield 0, header
            continue
        if len(fields) != len(header):
            yield number, DataFormatError(path, number, f"{len(fields)} fields, but the header names {len(header)}")
            continue
        yield number, dict(zip(header, fields))


def read_labelled(path: str | os.PathLike, text_column: str | None = None, label_column: str | None = None,
                  skip_malformed: bool = False) -> Examples:
    """The (text, label) examples of a TSV, CSV or JSON-lines file (module docstring)."""
    path = os.fspath(path)
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    if fmt is None:
        raise ValueError(f"{path}: unknown format; give a .tsv or .csv file with a header line, or a .jsonl file")
    out = Examples(path)
    columns: list[str] | None = None
    text_col = label_col = None
    for number, row in _rows(path, fmt):
        if number == 0:                                   # the header of a TSV or CSV
            columns = row
            text_col = _column(path, columns, text_column, TEXT_COLUMNS, "text", "--text-column")
            label_col = _column(path, columns, label_column, LABEL_COLUMNS, "label", "--label-column")
            continue
        if row is None:                                   # a blank line
            continue
        if isinstance(row, dict) and text_col is None:     # the first JSON object decides the columns
            keys = list(row)
            text_col = _column(path, keys, text_column, TEXT_COLUMNS, "text", "--text-column")
            label_col = _column(path, keys, label_column, LABEL_COLUMNS, "label", "--label-column")
        if isinstance(row, dict):
            row = _example(path, number, row, text_col, label_col)
        if isinstance(row, DataFormatError):
            if not skip_malformed:
                raise row
            out.skipped += 1
            continue
        out.texts.append(row[0])
        out.labels.append(row[1])
        out.lines.append(number)
    if columns is None and text_col is None and fmt != "jsonl":
        raise ValueError(f"{path}: empty file; expected a header line naming the columns, then one example a line")
    if not out.texts:
        raise ValueError(f"{path}: no examples found")
    return out


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
    text, label = text.strip(), str(label).strip()
    if not text:
        return DataFormatError(path, number, "empty text")
    if not label:
        return DataFormatError(path, number, "empty label")
    return text, label


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
