"""Labels for the positions of an :class:`~attnlab.viz.record.AttentionCall`: what each query
and key was, for a plot's axes.

A labeller is a callable ``labeller(positions=None) -> list[str]`` (positions: indices into one
sequence, e.g. ``call.query_positions``; None = every position), one kind per input:

- :class:`TokenLabels`: one text sequence's token pieces, made readable (spaces as "▁",
  newlines and other control characters escaped, byte-level pieces decoded);
- :class:`PatchGrid`: an image cut into patches, row by row, after an optional prefix of
  class or distillation tokens; also gives each patch's (row, col) and pixel box.
"""
from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence

import torch

__all__ = ["TokenLabels", "PatchGrid", "readable_piece"]

_ESCAPES = {" ": "▁", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def readable_piece(piece: str | None, token_id: int | None = None) -> str:
    """A token piece as a label: a space shows as "▁", a newline as "\\n", other control
    characters as "\\xNN", a SentencePiece byte piece "<0x0A>" as the character it stands for,
    an empty piece as "<empty>" and a missing one (an id the vocabulary lacks) as "<id N>"."""
    if piece is None:
        return f"<id {token_id}>"
    byte = _BYTE_PIECE.fullmatch(piece)
    if byte and int(byte.group(1), 16) < 0x80:
        piece = chr(int(byte.group(1), 16))
    if piece == "":
        return "<empty>"
    return "".join(_ESCAPES.get(ch) or (f"\\x{ord(ch):02x}" if unicodedata.category(ch) == "Cc" else ch)
                   for ch in piece)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters -> bytes (GPT-2's scheme): printable Latin-1 bytes stand for
    themselves, every other byte for the next character from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "hf", None), "decoder", None)
    if decoder is None:
        return False
    from tokenizers import decoders
    return isinstance(decoder, decoders.ByteLevel)


def _positions(positions, length: int, what: str) -> list[int]:
    if positions is None:
        return list(range(length))
    out = positions.tolist() if isinstance(positions, torch.Tensor) else list(positions)
    bad = [p for p in out if not 0 <= p < length]
    if bad:
        raise ValueError(f"{what}: position {bad[0]} is outside its {length} tokens")
    return out


class TokenLabels:
    """Labels of one text sequence: ``TokenLabels(tokenizer, ids)(positions)`` -> the readable
    piece of ``ids[p]`` for each position (see :func:`readable_piece`). ``tokenizer`` is any
    attnlab tokenizer (its ``tokens``); a byte-level BPE's pieces (GPT-2's "Ġthe", "Ċ") are
    decoded to the text they stand for first. Special tokens keep their names ("[CLS]", "<eos>")."""

    def __init__(self, tokenizer, ids: Sequence[int] | torch.Tensor):
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise ValueError("TokenLabels: ids must be one sequence of integer token ids (a 1-D tensor or list)")
        self.ids = ids
        # a model's vocabulary may be larger than its tokenizer's (rounded up for speed): those
        # ids get a label of their own instead of an error halfway through a plot
        known = [0 <= i < tokenizer.vocab_size for i in ids]
        found = iter(tokenizer.tokens([i for i, k in zip(ids, known) if k]))
        pieces = [next(found) if k else None for k in known]
        if _is_byte_level(tokenizer):
            table = _byte_level_alphabet()
            pieces = [p if p is None or any(ch not in table for ch in p)
                      else bytes(table[ch] for ch in p).decode("utf-8", errors="backslashreplace") for p in pieces]
        self.labels = [readable_piece(p, i) for p, i in zip(pieces, ids)]

    def __len__(self) -> int:
        return len(self.labels)

    def __call__(self, positions: Iterable[int] | torch.Tensor | None = None) -> list[str]:
        return [self.labels[p] for p in _positions(positions, len(self.labels), "TokenLabels")]


def _pair(value, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or any(not isinstance(v, int) or v <= 0 for v in pair):
        raise ValueError(f"PatchGrid: {name} must be a positive int or (height, width), got {value!r}")
    return pair


class PatchGrid:
    """The tokens of an image cut into ``patch_size`` patches, row by row (as ViT flattens them),
    after the ``prefix`` tokens (ViT: ("[CLS]",); DeiT: ("[CLS]", "[DIST]"); () for none).

    ``image_size`` and ``patch_size``: an int (square) or (height, width) in pixels; the patch
    must divide the image. Position p < len(prefix) is a prefix token, otherwise patch
    p - len(prefix) at (row, col) = divmod(p - len(prefix), cols).
    """

    def __init__(self, image_size, patch_size, prefix: Sequence[str] = ("[CLS]",)):
        (H, W), (ph, pw) = _pair(image_size, "image_size"), _pair(patch_size, "patch_size")
        if H % ph or W % pw:
            raise ValueError(f"PatchGrid: patches of {ph}x{pw} pixels do not tile a {H}x{W} image")
        self.image_size, self.patch_size, self.prefix = (H, W), (ph, pw), tuple(prefix)
        self.rows, self.cols = H // ph, W // pw

    def __len__(self) -> int:
        return len(self.prefix) + self.rows * self.cols

    def coordinates(self, positions: Iterable[int] | torch.Tensor | None = None) -> list[tuple[int, int] | None]:
        """(row, col) of each position's patch; None for a prefix token."""
        n = len(self.prefix)
        return [None if p < n else divmod(p - n, self.cols) for p in _positions(positions, len(self), "PatchGrid")]

    def boxes(self, positions: Iterable[int] | torch.Tensor | None = None) -> list[tuple[int, int, int, int] | None]:
        """(top, left, bottom, right) pixel box of each position's patch (bottom, right
        exclusive); None for a prefix token. What an overlay paints."""
        (ph, pw) = self.patch_size
        return [None if rc is None else (rc[0] * ph, rc[1] * pw, (rc[0] + 1) * ph, (rc[1] + 1) * pw)
                for rc in self.coordinates(positions)]

    def __call__(self, positions: Iterable[int] | torch.Tensor | None = None) -> list[str]:
        """"[CLS]" for a prefix token, "(row, col)" for a patch."""
        ps = _positions(positions, len(self), "PatchGrid")
        return [self.prefix[p] if rc is None else f"({rc[0]}, {rc[1]})" for p, rc in zip(ps, self.coordinates(ps))]
