"""Packing: run the position-wise work of a padded batch on its real tokens only.

A padded batch (B, T, E) holding N real tokens spends (B T - N) / (B T) of every position-wise
computation (the Q/K/V and output projections, the feed-forward, the norms, the residual adds)
on padding, whose results nobody reads. In an encoder those are nearly all of the work: at BERT-base
shapes and T = 128 the attention scores are ~3 % of the FLOPs. A :class:`Packing` gathers the real
tokens into one (N, E) tensor that the layers carry from one to the next; only attention, where a
token meets the others of its sequence, sees the (B, T) layout again: the projections are scattered
back (zeros at padding, which the key mask hides), attention runs as before, and its output is
gathered back before the output projection.

    packing = Packing(mask)                 # mask (B, T) bool, True = real token
    x = packing.pack(x)                     # (B, T, E) -> (N, E)
    x = layer(x, packing=packing)           # EncoderLayer / MultiHeadAttention take packed rows
    x = packing.unpack(x)                   # (N, E) -> (B, T, E), zeros at padding

Every real token's result is the padded computation's (the same rows through the same matrices;
a GEMM over fewer rows may sum in another order, so fp32 agrees to rounding); padded positions come
back as zeros. torch.nn.TransformerEncoder's inference fast path does the same with nested tensors
(and also returns zeros there), transformers only with flash-attention 2 on a GPU.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Packing"]


class Packing:
    """The real tokens' places in a padded (B, T) batch.

    ``mask`` (B, T) bool, True for real tokens. ``shape`` is (B, T), ``count`` N, ``index`` the N
    flat positions b * T + t in row-major order (a row's tokens stay consecutive and in order).
    """

    def __init__(self, mask: Tensor):
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.dtype != torch.bool:
            raise ValueError(f"Packing: mask must be a (batch, seq) bool tensor, True for real tokens, got "
                             f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
        self.mask = mask
        self.shape = tuple(mask.shape)
        self.index = mask.reshape(-1).nonzero().squeeze(1)
        self.count = self.index.numel()

    @classmethod
    def of(cls, mask: Tensor | None) -> Packing | None:
        """The packing of a (B, T) padding mask, or None when there is nothing to pack (no mask,
        or every position real): the layers then run on the padded layout as it is."""
        return None if mask is None or bool(mask.all()) else cls(mask)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...): the real tokens' rows."""
        if tuple(x.shape[:2]) != self.shape:
            raise ValueError(f"Packing.pack: expected a (batch, seq) = {self.shape} leading shape, got {tuple(x.shape)}")
        return x.flatten(0, 1).index_select(0, self.index)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, ...) -> (B, T, ...): the rows back in place, zeros at padding."""
        if x.size(0) != self.count:
            raise ValueError(f"Packing.unpack: expected {self.count} packed rows, got {tuple(x.shape)}")
        B, T = self.shape
        out = x.new_zeros((B * T, *x.shape[1:]))
        return out.index_copy(0, self.index, x).view(B, T, *x.shape[1:])

    @property
    def fraction(self) -> float:
        """The share of the (B, T) positions that are real tokens."""
        return self.count / max(1, self.shape[0] * self.shape[1])
