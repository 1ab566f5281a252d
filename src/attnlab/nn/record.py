"""What a token mixer computed, reported through one interface while a recorder listens.

A mixer is the part of a layer that moves information between positions: attention, windowed
attention, a selective scan, Mamba-2's SSD, RWKV's WKV, a delta rule. Each says what it computed
in the terms every one of them shares, a (B, H, T, S) map from the S inputs to the T outputs per
head where it has one, so that a viewer draws any mixer, a new one included, without knowing it:

    class MyMixer(ReportsMixing, nn.Module):
        def forward(self, x):
            y, inputs = ...
            self.report(lambda: MixerCall("my mixer", inputs, y, matrix=lambda: my_matrix(*inputs)))
            return y

``report`` costs one attribute test when nobody listens (``mixing_record`` is None outside a
recorder, attnlab.viz.record.record_mixers); the map itself is computed only when asked for
(``matrix``, ``magnitude``), so recording leaves the mixer's outputs bit for bit as they are.
:class:`attnlab.nn.MultiHeadAttention` reports through its own ``attention_record`` (older, and
richer: the query positions of a cached step); the recorder reads both the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

__all__ = ["MixerCall", "ReportsMixing", "KINDS"]

KINDS = ("attention", "matrix")


@dataclass(eq=False)
class MixerCall:
    """One call of one mixer.

    family: what kind of mixer ran, as it names itself ("mamba2", "window attention"): the viewer
    groups calls by it and shows it, never branches on it. inputs: the tensors it mixed, as it
    received them (its own order, documented by the mixer); output: what it gave (or None).
    matrix(): the signed (B, H, T, S) map with output[t] = Σ_s matrix[t, s] input[s] per head (per
    channel of a head), or None where the mixer has none; magnitude(): the (B, H, T, S) >= 0 drawn
    (default |matrix|); blocks(): a finer map where one number per (t, s) does not say it (a MIMO
    scan's R x R blocks), or None. kind: "attention" (rows of softmax weights, drawn as they are)
    or "matrix" (drawn scaled by the largest value); title: what the drawn values are;
    grid: the (rows, cols) map the T and S tokens tile row by row (an image's patches), or None.
    """
    family: str
    inputs: tuple
    output: Tensor | None
    matrix: Callable[[], Tensor] | None = None
    magnitude: Callable[[], Tensor] | None = None
    blocks: Callable[[], Tensor] | None = None
    kind: str = "matrix"
    title: str = ""
    grid: tuple[int, int] | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"MixerCall({self.family!r}): kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.magnitude is None and self.matrix is not None:
            matrix = self.matrix
            self.magnitude = lambda: matrix().abs()

    def __repr__(self) -> str:
        return f"MixerCall({self.family!r}, kind={self.kind!r}, grid={self.grid}, map={self.matrix is not None})"


class ReportsMixing:
    """Mixin of a mixer module that reports each call to a listening recorder (module docstring).

    ``map_per_head``: whether its calls carry a (B, H, T, S) map (False: it reports its inputs and
    output only, and ``no_map_reason`` says why it has no map, for the viewer's refusal);
    ``tiles_map``: whether its calls say which (rows, cols) map their tokens tile."""

    mixing_record: Callable[[MixerCall], None] | None = None
    map_per_head: bool = True
    no_map_reason: str = ""
    tiles_map: bool = False               # its calls' tokens tile a map (MixerCall.grid): an image's patches

    def report(self, make: Callable[[], MixerCall]) -> None:
        """Hand the call ``make()`` describes to the listening recorder, if one listens."""
        if self.mixing_record is not None:
            self.mixing_record(make())

    @property
    def recording(self) -> bool:
        return self.mixing_record is not None
