"""Encoder and decoder layers, Post-Norm (the 2017 paper) or Pre-Norm.

Post-Norm (Vaswani et al. 2017, section 3.1 and 5.4):  x = Norm(x + Dropout(Sublayer(x)))
Pre-Norm  (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture"):
                                                      x = x + Dropout(Sublayer(Norm(x)))
A Pre-Norm stack leaves its output un-normalised, so it needs a final norm after the last
layer (the models add it); a deep Post-Norm stack needs learning-rate warmup to train.

Dropout sits where the paper puts it: on each sublayer's output before the residual add,
on the attention weights, and (inside the feed-forward) after the activation.
"""
from __future__ import annotations

from torch import Tensor, nn

from .attention import MultiHeadAttention
from .cache import KVCache
from .mlp import FeedForward
from .norm import make_norm

__all__ = ["EncoderLayer", "DecoderLayer"]


class _Residual(nn.Module):
    """One sublayer with its residual connection, norm and dropout (Pre- or Post-Norm)."""

    def __init__(self, norm: nn.Module, dropout: float, norm_first: bool):
        super().__init__()
        self.norm, self.dropout, self.norm_first = norm, nn.Dropout(dropout), norm_first

    def pre(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm_first else x

    def post(self, x: Tensor, y: Tensor) -> Tensor:
        x = x + self.dropout(y)
        return x if self.norm_first else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in residual + norm.

    Args:
        d_model, num_heads, d_ff, dropout: as in the paper (512, 8, 2048, 0.1).
        norm_first: Pre-Norm if True, Post-Norm (the paper) if False.
        activation: feed-forward activation ("relu", "gelu", ...).
        norm: "layernorm" | "rmsnorm" | "dyt"; eps its epsilon.
        self_attn, ff: ready-made modules to plug in instead of the defaults (for example an
            attention with a position module, or a gated MLP).

    forward(x (B, T, E), key_padding_mask (B, T) True = real token, mask broadcastable to
    (B, H, T, T)) -> (x (B, T, E), self-attention weights (B, H, T, T) or None).
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layernorm",
                 eps: float = 1e-5, bias: bool = True,
                 self_attn: nn.Module | None = None, ff: nn.Module | None = None):
        super().__init__()
        self.self_attn = self_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias)
        self.ff = ff or FeedForward(d_model, d_ff, dropout, activation=activation, bias=bias)
        self.sub1 = _Residual(make_norm(norm, d_model, eps), dropout, norm_first)
        self.sub2 = _Residual(make_norm(norm, d_model, eps), dropout, norm_first)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, mask: Tensor | None = None,
                return_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        h = self.sub1.pre(x)
        a, w = self.self_attn(h, h, h, mask, key_padding_mask=key_padding_mask, return_weights=return_weights)
        x = self.sub1.post(x, a)
        x = self.sub2.post(x, self.ff(self.sub2.pre(x)))
        return x, w


class DecoderLayer(nn.Module):
    """Masked (causal) self-attention, cross-attention over the encoder memory, feed-forward.

    Cross-attention projects the queries from the decoder stream and the keys/values from
    the memory, each with its own weights.

    forward(x (B, T, E), memory (B, S, E), memory_key_padding_mask (B, S), ...,
    cache=(self KVCache, cross KVCache) for step-by-step decoding)
    -> (x (B, T, E), self weights (B, H, T, T') or None, cross weights (B, H, T, S) or None).
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layernorm",
                 eps: float = 1e-5, bias: bool = True,
                 self_attn: nn.Module | None = None, cross_attn: nn.Module | None = None,
                 ff: nn.Module | None = None):
        super().__init__()
        self.self_attn = self_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias, causal=True)
        self.cross_attn = cross_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias)
        self.ff = ff or FeedForward(d_model, d_ff, dropout, activation=activation, bias=bias)
        self.sub1 = _Residual(make_norm(norm, d_model, eps), dropout, norm_first)
        self.sub2 = _Residual(make_norm(norm, d_model, eps), dropout, norm_first)
        self.sub3 = _Residual(make_norm(norm, d_model, eps), dropout, norm_first)

    def forward(self, x: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None, *,
                tgt_key_padding_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                cache: tuple[KVCache, KVCache] | None = None, return_weights: bool = False,
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        h = self.sub1.pre(x)
        a, w_self = self.self_attn(h, h, h, tgt_mask, key_padding_mask=tgt_key_padding_mask,
                                   cache=self_cache, return_weights=return_weights)
        x = self.sub1.post(x, a)
        h = self.sub2.pre(x)
        a, w_cross = self.cross_attn(h, memory, memory, key_padding_mask=memory_key_padding_mask,
                                     cache=cross_cache, return_weights=return_weights)
        x = self.sub2.post(x, a)
        x = self.sub3.post(x, self.ff(self.sub3.pre(x)))
        return x, w_self, w_cross
