"""Decoding state: the KV cache, and the protocol a recurrent state also meets.

A decoder that generates token by token recomputes nothing for earlier tokens: each
attention layer keeps the keys and values it has already projected. ``KVCache`` holds them
for one layer as (B, G, S, D) tensors in a buffer that grows by doubling, so appending one
token is an in-place copy, not a re-allocation of the whole history every step.

A *static* cache holds the projected encoder memory for cross-attention: it is filled once
on the first decoding step and reused unchanged afterwards.

The decoding state protocol
---------------------------
Generation (:mod:`attnlab.generate`) never looks inside a model's state. It needs three
things, which :class:`LayerCaches` provides and a recurrent model (Mamba, RWKV, an RNN)
provides with its own constant-size state:

- ``length`` (int): how many positions of each row the state has consumed;
- ``reorder(index)``: keep batch rows ``index`` (N',) in that order, repeats allowed (beam
  search follows its surviving hypotheses, finished rows leave the batch);
- ``truncate(length)``: forget every position from ``length`` on (speculative decoding drops
  rejected draft tokens). A state that cannot go back raises :class:`CannotTruncateError`;
  truncating to the current length is always allowed and changes nothing.

:class:`RecurrentState` is that protocol for a list of per-row tensors that a recurrent model
overwrites each step; it cannot truncate, because a constant-size state has forgotten the past.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["DecodingState", "CannotTruncateError", "KVCache", "LayerCaches", "RecurrentState"]


@runtime_checkable
class DecodingState(Protocol):
    """What generation needs from a model's state (see the module docstring)."""

    @property
    def length(self) -> int: ...

    def reorder(self, index: Tensor) -> None: ...

    def truncate(self, length: int) -> None: ...


class CannotTruncateError(RuntimeError):
    """Raised by a state asked to forget positions it cannot roll back (a recurrent state)."""


def _check_length(who: str, length, current: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= current:
        raise ValueError(f"{who}.truncate: length must be an int in [0, {current}], got {length!r}")


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
    decoding state protocol, its ``length`` being the decoder positions seen."""

    def __init__(self, num_layers: int, cross: bool = False, capacity: int = 64):
        self.self_attn = [KVCache(capacity=capacity) for _ in range(num_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(num_layers)] if cross else None

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


class RecurrentState:
    """A constant-size state: ``tensors``, each (B, ...) with rows first, that a recurrent model
    reads and replaces each step (``state.tensors[i] = new``), plus the count of positions
    consumed, which the model advances with :meth:`advance`.

    Reordering rows is exact. Truncating is not possible: after a step the previous state is
    gone, so :meth:`truncate` to fewer positions raises :class:`CannotTruncateError`.
    """

    def __init__(self, tensors: list[Tensor] | None = None):
        self.tensors: list[Tensor | None] = list(tensors or [])
        self.length = 0

    def advance(self, steps: int) -> None:
        """Count ``steps`` more positions consumed."""
        self.length += steps

    def reorder(self, index: Tensor) -> None:
        self.tensors = [None if t is None else t.index_select(0, index) for t in self.tensors]

    def truncate(self, length: int) -> None:
        _check_length(type(self).__name__, length, self.length)
        if length != self.length:
            raise CannotTruncateError(
                f"{type(self).__name__} cannot go back from {self.length} to {length} positions: a recurrent "
                f"state keeps no history. Speculative decoding needs a model whose state can truncate "
                f"(a KV cache): generate with this model without a draft model, and do not use it as one.")
