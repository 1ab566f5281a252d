"""Key/value caches for incremental decoding.

A decoder that generates token by token recomputes nothing for earlier tokens: each
attention layer keeps the keys and values it has already projected. ``KVCache`` holds them
for one layer as (B, G, S, D) tensors in a buffer that grows by doubling, so appending one
token is an in-place copy, not a re-allocation of the whole history every step.

A *static* cache holds the projected encoder memory for cross-attention: it is filled once
on the first decoding step and reused unchanged afterwards.
"""
from __future__ import annotations

from torch import Tensor

__all__ = ["KVCache", "LayerCaches"]


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


class LayerCaches:
    """One self-attention cache (and optionally one cross-attention cache) per layer."""

    def __init__(self, num_layers: int, cross: bool = False, capacity: int = 64):
        self.self_attn = [KVCache(capacity=capacity) for _ in range(num_layers)]
        self.cross_attn = [KVCache(static=True) for _ in range(num_layers)] if cross else None

    @property
    def length(self) -> int:
        return self.self_attn[0].length if self.self_attn else 0

    def reorder(self, index: Tensor) -> None:
        for c in self.self_attn + (self.cross_attn or []):
            c.reorder(index)
