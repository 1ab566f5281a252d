"""Decoding state: the KV cache, the recurrent state, and the protocol both meet.

A decoder that generates token by token recomputes nothing for earlier tokens: each
attention layer keeps the keys and values it has already projected. ``KVCache`` holds them
for one layer as (B, G, S, D) tensors in a buffer that grows by doubling, so appending one
token is an in-place copy, not a re-allocation of the whole history every step.

A *static* cache holds the projected encoder memory for cross-attention: it is filled once
on the first decoding step and reused unchanged afterwards.

The decoding state protocol
---------------------------
``model.new_cache()`` returns the model's decoding state, which the model reads and updates
in ``forward(ids, attention_mask=, cache=state)``. Generation (:mod:`attnlab.generate`) never
looks inside it; it needs only these members (:class:`DecodingState`):

- ``length`` (int): how many *slots* of each row the state has consumed. Every row has the
  same number of slots; a slot whose ``attention_mask`` is False (left padding, or a hole left
  by a rejected draft token) must change nothing the model computes later: attention masks
  it, a recurrent model carries its state over it unchanged.
- ``reorder(index)``: keep batch rows ``index`` (N',) in that order, repeats allowed (beam
  search follows its surviving hypotheses, finished rows leave the batch).
- ``can_rewind`` (bool): whether :meth:`rewind` can go back. Speculative decoding refuses,
  before any forward pass, a state that says False (:class:`CannotRewindError`); greedy,
  sampling and beam search never rewind and take any state.
- ``mark(length)``: announces that, until the next ``rewind``, no row will be rewound to
  fewer than ``length`` slots (``length`` may lie ahead of the state: it is reached by the
  next forward calls). Speculative decoding marks the start of each round's drafts. A KV cache
  has nothing to do; a recurrent state starts keeping a snapshot at every length from
  ``length`` on, so its memory stays the size of k + 2 states, whatever the sequence length.
- ``rewind(keep, length)``: ``keep`` (N,) ints with ``keep[i] <= length <= self.length``.
  Afterwards row i's state is what it was after its first ``keep[i]`` slots, the slots from
  ``keep[i]`` to ``length`` are holes to it (the caller masks them from then on), slots from
  ``length`` on are forgotten, and ``self.length == length``. Rows of one batch accept
  different numbers of draft tokens, hence one ``keep`` per row. A KV cache truncates to
  ``length``: the keys of the holes stay and the mask hides them. A recurrent state cannot
  hide a token it has folded in, so it restores row i from its snapshot at ``keep[i]``.
  Rewinding to where every row already is (``keep`` all ``self.length``) always works.

:class:`LayerCaches` meets the protocol with one KV cache per layer. :class:`RecurrentState`
meets it for a constant-size state (Mamba, RWKV, an RNN) and is all a recurrent model needs:

- the model reads ``state.tensors`` (a list of (B, ...) tensors, rows first, None before the
  first forward) and, after consuming positions, *assigns* new tensors to the list and calls
  ``state.advance(steps)``; snapshots are copies, so updating in place is safe as well;
- while ``state.stepwise`` is True (between ``mark`` and ``rewind``) the model must consume
  positions one at a time, assigning the state and calling ``advance(1)`` after each, so
  that every length has its snapshot; otherwise (prefill, plain decoding) it may consume T
  positions at once and call ``advance(T)``. ``advance`` refuses to skip a length that needs
  a snapshot;
- at a slot whose mask is False it carries its state over unchanged;
- ``RecurrentState(tensors, can_rewind=False)`` declares a state that keeps no snapshots: it
  decodes greedily, samples and searches beams, and speculative decoding refuses it.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["DecodingState", "CannotRewindError", "KVCache", "LayerCaches", "RecurrentState"]


@runtime_checkable
class DecodingState(Protocol):
    """What generation needs from a model's state (see the module docstring)."""

    can_rewind: bool

    @property
    def length(self) -> int: ...

    def reorder(self, index: Tensor) -> None: ...

    def mark(self, length: int) -> None: ...

    def rewind(self, keep: Tensor, length: int) -> None: ...


class CannotRewindError(ValueError):
    """A state was asked to go back to a length it kept no record of, or a decoding that
    rewinds (speculative decoding) was given a state that cannot."""


def _check_length(who: str, length, current: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
        raise ValueError(f"{who}.truncate: length must be an int in [0, {current}], got {length!r}")


def _check_rewind(who: str, keep, length, current: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
        raise ValueError(f"{who}.rewind: length must be an int in [0, {current}], got {length!r}")
    if not isinstance(keep, Tensor) or keep.dim() != 1 or keep.is_floating_point() or keep.dtype == torch.bool \
            or keep.numel() and not 0 <= int(keep.min()) <= int(keep.max()) <= length:
        raise ValueError(f"{who}.rewind: keep must be an integer (rows,) tensor of lengths in [0, {length}], "
                         f"got {keep!r}")


class KVCache:
    """Keys/values of one attention layer.

    Args:
        static: True for cross-attention memory (filled once, never appended to).
        capacity: initial number of positions to allocate (grows by doubling).
    """

    def __init__(self, static: bool = False, capacity: int = 64):
        self.static = static
        self.capacity = capacity
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length = 0

    def _grow(self, need: int) -> None:
        cap = max(self.capacity, 1)
        while cap < need:
            cap *= 2
        B, G, _, D = self.k.shape
        k = self.k.new_empty(B, G, cap, D)
        v = self.v.new_empty(B, G, cap, self.v.size(-1))
        k[:, :, :self.length] = self.k[:, :, :self.length]
        v[:, :, :self.length] = self.v[:, :, :self.length]
        self.k, self.v, self.capacity = k, v, cap

    def update(self, k: Tensor | None, v: Tensor | None) -> tuple[Tensor, Tensor]:
        """Add this step's (B, G, T, D) keys/values; return all keys/values so far (B, G, S, D)."""
        if self.static:
            if k is not None:
                self.k, self.v, self.length = k, v, k.size(-2)
            if self.k is None:
                raise ValueError("KVCache: a static cache was read before it was filled")
            return self.k, self.v
        if k is None:
            raise ValueError("KVCache: a dynamic cache needs this step's keys and values")
        T = k.size(-2)
        if self.k is None:
            self.capacity = max(self.capacity, T)
            self.k = k.new_empty(k.size(0), k.size(1), self.capacity, k.size(-1))
            self.v = v.new_empty(v.size(0), v.size(1), self.capacity, v.size(-1))
        elif k.shape[:2] != self.k.shape[:2] or k.dtype != self.k.dtype:
            raise ValueError(f"KVCache: new keys {tuple(k.shape)} {k.dtype} do not match the cache "
                             f"{tuple(self.k.shape)} {self.k.dtype}")
        if self.length + T > self.capacity:
            self._grow(self.length + T)
        self.k[:, :, self.length:self.length + T] = k
        self.v[:, :, self.length:self.length + T] = v
        self.length += T
        return self.k[:, :, :self.length], self.v[:, :, :self.length]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search: follow the surviving hypotheses)."""
        if self.k is not None:
            self.k = self.k.index_select(0, index)
            self.v = self.v.index_select(0, index)

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on. The buffers are read up to ``length`` and the
        next keys/values are written at ``length``, so nothing is copied or freed. A static
        (cross-attention) cache holds the encoder memory, which decoding never rolls back: it
        is left as it is."""
        if self.static:
            return
        _check_length("KVCache", length, self.length)
        self.length = length


class LayerCaches:
    """One self-attention cache (and optionally one cross-attention cache) per layer; meets the
    decoding state protocol, its ``length`` being the decoder positions seen. It rewinds by
    truncating: the keys of the slots that become holes stay, and the attention mask hides them.

    The self-attention caches are full :class:`KVCache` s unless :meth:`use` swaps them for
    another kind (:mod:`attnlab.nn.kv_cache`: sliding, sink, int8, int4) before the first step."""

    def __init__(self, num_layers: int, cross: bool = False, capacity: int = 64):
        self.self_attn = [KVCache(capacity=capacity) for _ in range(num_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(num_layers)] if cross else None

    def use(self, kind) -> "LayerCaches":
        """Give every self-attention layer an empty cache of ``kind`` (a
        :class:`~attnlab.nn.kv_cache.KVCacheKind`: anything whose ``new(shared)`` makes one layer's
        cache, ``shared`` a dict common to this state's layers); returns self."""
        if not callable(getattr(kind, "new", None)):
            raise ValueError(f"LayerCaches.use: expected a KVCacheKind, got {type(kind).__name__}")
        if self.length:
            raise ValueError("LayerCaches.use: choose the cache kind before the first step")
        shared: dict = {}
        self.self_attn = [kind.new(shared) for _ in self.self_attn]
        return self

    @property
    def can_rewind(self) -> bool:
        return all(getattr(c, "can_rewind", True) for c in self.self_attn)

    @property
    def rebases_positions(self) -> bool:
        """True when the caches place keys at positions of their own (a sink cache): the
        model's positions may then run past its trained context."""
        return bool(self.self_attn) and all(getattr(c, "rebases_positions", False) for c in self.self_attn)

    @property
    def length(self) -> int:
        return self.self_attn[0].length if self.self_attn else 0

    def reorder(self, index: Tensor) -> None:
        for c in self.self_attn + (self.cross_attn or []):
            c.reorder(index)

    def truncate(self, length: int) -> None:
        """Forget the decoder positions from ``length`` on, in every layer."""
        _check_length("LayerCaches", length, self.length)
        for c in self.self_attn:
            c.truncate(length)

    def mark(self, length: int) -> None:
        """A full cache has nothing to keep (every position's keys stay until a rewind); a kind
        that drops or quantises keys keeps those a rewind to ``length`` needs."""
        for c in self.self_attn:
            if hasattr(c, "mark"):
                c.mark(length)

    def rewind(self, keep: Tensor, length: int) -> None:
        _check_rewind("LayerCaches", keep, length, self.length)
        self.truncate(length)


class RecurrentState:
    """A constant-size state: ``tensors``, each (B, ...) with rows first, that a recurrent model
    reads and replaces as it consumes positions, and ``length``, the count of positions consumed,
    which the model advances with :meth:`advance` (the contract is in the module docstring).

    Reordering rows is exact. Rewinding restores snapshots: after :meth:`mark` the state keeps a
    copy of its tensors at every length from the mark on, until the next :meth:`rewind`, which
    restores each row from the snapshot at its own length. With ``can_rewind=False`` it keeps
    none, and rewinding anywhere but to the current length raises :class:`CannotRewindError`.
    """

    def __init__(self, tensors: list[Tensor] | None = None, can_rewind: bool = True):
        self.tensors: list[Tensor | None] = list(tensors or [])
        self.length = 0
        self.can_rewind = can_rewind
        self._from: int | None = None                  # the marked length while snapshots are kept
        self._snapshots: dict[int, list[Tensor | None]] = {}

    @property
    def stepwise(self) -> bool:
        """True while the model must consume one position per :meth:`advance` (a mark is set)."""
        return self._from is not None

    def _snapshot(self) -> None:
        if self._from is not None and self.length >= self._from:
            self._snapshots[self.length] = [None if t is None else t.clone() for t in self.tensors]

    def advance(self, steps: int) -> None:
        """Count ``steps`` more positions consumed, the tensors being the state after the last."""
        if self._from is not None and steps > 1 and self.length + steps - 1 >= self._from:
            raise CannotRewindError(
                f"{type(self).__name__}.advance({steps}): while a rewind point is marked (stepwise is True) the "
                f"model must consume one position per advance(1), so that every length has a snapshot")
        self.length += steps
        self._snapshot()

    def reorder(self, index: Tensor) -> None:
        self.tensors = [None if t is None else t.index_select(0, index) for t in self.tensors]
        self._snapshots = {n: [None if t is None else t.index_select(0, index) for t in snap]
                           for n, snap in self._snapshots.items()}

    def mark(self, length: int) -> None:
        """Keep a snapshot at every length from ``length`` on (the current one included, when
        reached), dropping any older ones; a state that cannot rewind keeps none."""
        if not self.can_rewind:
            return
        self._from = length
        self._snapshots = {}
        self._snapshot()

    def rewind(self, keep: Tensor, length: int) -> None:
        """Row i takes its snapshot at ``keep[i]``; the length becomes ``length``. Ends the mark."""
        who = type(self).__name__
        _check_rewind(who, keep, length, self.length)
        rows = keep.tolist()
        if length != self.length or any(n != self.length for n in rows):
            missing = sorted(set(n for n in rows if n != self.length and n not in self._snapshots))
            if missing:
                raise CannotRewindError(
                    f"{who} cannot go back from {self.length} to {missing[0]} positions: " + (
                        f"it keeps snapshots only after mark(length), from that length on"
                        if self.can_rewind else "it was made with can_rewind=False and keeps no snapshots"))
            self._restore(keep)
        self.length = length
        self._from, self._snapshots = None, {}

    def _restore(self, keep: Tensor) -> None:
        lengths = keep.unique().tolist()
        if len(lengths) == 1:
            if lengths[0] != self.length:
                self.tensors = list(self._snapshots[lengths[0]])
            return
        restored = []
        for i, now in enumerate(self.tensors):
            for n in lengths:
                if n == self.length:
                    continue
                old = self._snapshots[n][i]
                if old is None or now is None:
                    raise CannotRewindError(f"{type(self).__name__}: tensor {i} did not exist at every length "
                                            f"the rows go back to")
                take = (keep == n).to(now.device).view(-1, *[1] * (now.dim() - 1))
                now = torch.where(take, old, now)
            restored.append(now)
        self.tensors = restored
