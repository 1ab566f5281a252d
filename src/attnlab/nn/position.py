"""Position information for attention: absolute tables added to embeddings, and the
relative kinds that act inside attention (rotations of q/k, biases on the scores)."""
from __future__ import annotations

from torch import Tensor, nn

__all__ = ["AttentionPosition"]


class AttentionPosition(nn.Module):
    """Base of the position modules that plug into :class:`MultiHeadAttention`.

    ``transform(q, k, positions)`` rotates queries/keys (RoPE); ``bias(q_pos, k_pos)``
    returns a float score bias broadcastable to (B, H, T, S) (ALiBi, T5). The defaults do
    nothing, so a subclass overrides the one it needs.

    positions / q_pos: (T,) or (B, T) absolute positions of the new queries (a KV cache
    offsets them by its length); k_pos: (S,) positions of all keys.
    """

    def transform(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        return None
