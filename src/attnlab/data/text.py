"""Text corpora for language modelling: the embedded one and the user's text files.

The embedded corpus exists on every machine without a download: the ``*.py`` files of the
Python standard library this interpreter runs (the directory of the ``os`` module, minus
site-packages, dist-packages and test directories), sorted by relative path, read until
``max_bytes``; files that are not UTF-8 or are empty are skipped. Every 20th file is held out
for validation, so training and validation share no file. It is deterministic for one Python
version (another version has another standard library). Each file is one document: an EOS
token follows it. A text file (``--data``) is one document, split as nanoGPT splits
Shakespeare: the first 90% of its characters train, the last 10% validate (or a separate
``valid`` file). A directory (``--data DIR``) is its ``*.txt`` files, sorted by name, each one
document: ``valid.txt`` (or ``dev.txt``, ``validation.txt``) validates, ``test.txt`` is left out,
the rest train; without a validation file every 10th training file validates, and a lone file
is split as above.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor

from .files import DataFormatError
from .sniff import SPLIT_NAMES

__all__ = ["TextCorpus", "stdlib_corpus", "read_text_file", "text_file_corpus", "encode_documents"]

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass
class TextCorpus:
    """Training and validation documents, and where they came from."""
    train: list[str]
    valid: list[str]
    train_names: list[str]
    valid_names: list[str]
    source: str                      # a description for progress messages
    eos_between: bool                # an EOS token ends each document (separate files)


def stdlib_corpus(max_bytes: int = 2_000_000, valid_every: int = 20) -> TextCorpus:
    """The standard library's own source (see the module docstring): the first ``max_bytes`` of
    UTF-8 ``*.py`` files in relative-path order; file i goes to validation when
    ``i % valid_every == valid_every // 2`` (at least one file does)."""
    if max_bytes <= 0 or valid_every < 2:
        raise ValueError(f"stdlib_corpus: need max_bytes > 0 and valid_every >= 2, got {max_bytes}, {valid_every}")
    root = Path(os.__file__).resolve().parent
    names, texts, total = [], [], 0
    for name, path in _python_files(root):
        if total >= max_bytes:
            break
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            names.append(name)
            texts.append(text)
            total += len(raw)
    if len(texts) < 2:
        raise ValueError(f"stdlib_corpus: found fewer than 2 source files under {root}")
    held = {i for i in range(len(texts)) if i % valid_every == valid_every // 2} or {len(texts) - 1}
    train, valid = [i for i in range(len(texts)) if i not in held], sorted(held)
    version = ".".join(map(str, sys.version_info[:3]))
    return TextCorpus([texts[i] for i in train], [texts[i] for i in valid], [names[i] for i in train],
                      [names[i] for i in valid], f"Python {version} standard library, {len(texts)} files, "
                      f"{total / 1e6:.1f} MB", eos_between=True)


def _python_files(root: Path) -> list[tuple[str, Path]]:
    """(relative posix path, path) of the ``*.py`` files under ``root``, sorted, skipping
    _SKIPPED_DIRS and the build-configuration directory (config-3.x-...)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("config-")]
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    return sorted((p.relative_to(root).as_posix(), p) for p in found)


def read_text_file(path: str | os.PathLike) -> str:
    """The whole of a UTF-8 text file (a leading BOM dropped); a non-UTF-8 byte raises
    :class:`DataFormatError` naming the file and the line."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    raw = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataFormatError(path, line, f"not valid UTF-8 (byte 0x{raw[e.start]:02x})") from None


def text_file_corpus(path: str, valid: str | None = None, valid_fraction: float = 0.1) -> TextCorpus:
    """One text file: its last ``valid_fraction`` of characters validate, unless ``valid`` names a
    file; a directory: its text files (module docstring)."""
    if os.path.isdir(path):
        return _directory_corpus(path, valid, valid_fraction)
    text = read_text_file(path)
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    if valid is not None:
        return TextCorpus([text], [read_text_file(valid)], [path], [valid], path, eos_between=False)
    cut = int(len(text) * (1.0 - valid_fraction))
    return TextCorpus([text[:cut]], [text[cut:]], [path], [f"{path} (last {valid_fraction:.0%})"],
                      path, eos_between=False)


def _directory_corpus(directory: str, valid: str | None, valid_fraction: float) -> TextCorpus:
    names = sorted(n for n in os.listdir(directory)
                   if n.endswith(".txt") and os.path.isfile(os.path.join(directory, n)))
    if not names:
        raise ValueError(f"--data {directory}: a directory without a .txt file")
    split = {n: next((k for k, stems in SPLIT_NAMES.items() if n.split(".")[0].lower() in stems), "train")
             for n in names}
    train = [n for n in names if split[n] == "train"]
    held = [n for n in names if split[n] == "valid"]
    if not train:
        raise ValueError(f"--data {directory}: no training text (its .txt files are {', '.join(names)})")
    if valid is None and not held:
        if len(train) == 1:
            corpus = text_file_corpus(os.path.join(directory, train[0]), None, valid_fraction)
            return TextCorpus(corpus.train, corpus.valid, corpus.train_names, corpus.valid_names,
                              f"{directory}: {corpus.source}", eos_between=False)
        held = train[5::10] or train[-1:]
        train = [n for n in train if n not in held]
    texts = {n: read_text_file(os.path.join(directory, n)) for n in train + held}
    if valid is not None:
        valid_texts, valid_names = [read_text_file(valid)], [valid]
    else:
        valid_texts, valid_names = [texts[n] for n in held], held
    left = [n for n in names if split[n] == "test"]
    source = (f"{directory}: {len(train)} training file(s) ({_listed(train)}), validation {_listed(valid_names)}"
              + (f", left out {_listed(left)}" if left else ""))
    return TextCorpus([texts[n] for n in train], valid_texts, train, valid_names, source, eos_between=True)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def encode_documents(tokenizer, documents: Sequence[str], eos_between: bool) -> Tensor:
    """All documents' ids in one 1-D LongTensor; with ``eos_between`` each document ends with EOS."""
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc))
        if eos_between:
            ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.long)
