r"""Multi-head latent attention (MLA): keys and values decompressed from one small latent per token.

Liu et al. 2024, arXiv:2405.04434, section 2.1. Shape letters as in :mod:`attnlab.nn.attention`,
plus C = kv_lora_rank (the latent), Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim::

    q      = W_UQ RMSNorm(W_DQ x)    (or W_Q x)           -> per head [q_nope (Dn) | q_rope (Dr)]
    [c | k_rope] = W_DKV x            c: (C,), k_rope: (Dr,), one rotary key shared by all heads
    c      = RMSNorm(c)
    [k_nope | v] = W_UKV c                                 -> per head k_nope (Dn), v (Dv)
    head h = softmax(scale * (q_nope . k_nope + RoPE(q_rope) . RoPE(k_rope))) v

Only c and the rotated k_rope depend on the token, so the decoding cache holds C + Dr numbers per
token and layer, against 2 H D for multi-head attention. Two ways to use it give the same output:

- expanded: decompress every cached latent into k_nope and v (H (Dn + Dv) per token), then attend
  as usual. Cheapest when queries are many (a prompt's prefill).
- absorbed: q_nope . (W_UK c) = (W_UK^T q_nope) . c, so fold W_UK into the query (per head, Dn -> C)
  and attend over the latents themselves; sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j), so apply
  W_UV after attention. All heads then share one key/value "head", [c | k_rope] and c, and a
  decoding step reads C + Dr numbers per cached token instead of H (Dn + Dr + Dv).

The cache kinds of :mod:`attnlab.nn.kv_cache` hold the same two tensors: a sliding or sink cache
keeps the latents and the (for the sink cache, unrotated) rope keys of its slots and rotates them
itself, as it does keys and values for :class:`~attnlab.nn.MultiHeadAttention`; int8 / int4
quantise the latent as KIVI does keys (per channel) and the rope key as it does values (per token).

The scale is (Dn + Dr)^-1/2 by default (the query's full width, whichever way it is computed).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention, causal_mask, combine_masks, scaled_dot_product_attention
from .cache import KVCache
from .norm import RMSNorm

__all__ = ["MultiHeadLatentAttention"]


class MultiHeadLatentAttention(nn.Module):
    r"""Causal self-attention through a compressed key/value latent (see the module docstring).

    Args:
        d_model: E. num_heads: H.
        kv_lora_rank: C, the latent width the cache holds. q_lora_rank: the query's own low-rank
            width (``q_a_proj`` E -> q_lora_rank, ``q_a_layernorm``, ``q_b_proj`` -> H (Dn + Dr)),
            or None for one ``q_proj`` E -> H (Dn + Dr).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: Dn, Dr, Dv.
        position: a rotary module (:class:`~attnlab.nn.RotaryEmbedding` of width Dr) applied to the
            rope parts of q and k, or None.
        scale: the factor on the scores (default (Dn + Dr)^-1/2).
        latent_eps: epsilon of the two latent RMSNorms. bias: biases on ``q_a_proj``,
            ``kv_a_proj_with_mqa`` and ``out_proj`` (``q_b_proj``, ``q_proj`` and ``kv_b_proj``
            never have one: absorbing ``kv_b_proj`` needs it linear).
        absorb: True / False forces the absorbed / expanded path; None (default) absorbs when the
            cache already held tokens before this call (decoding steps) and expands otherwise.

    Submodules: ``q_proj`` or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; ``kv_a_proj_with_mqa``
    (E -> C + Dr), ``kv_a_layernorm``, ``kv_b_proj`` (C -> H (Dn + Dv)), ``out_proj`` (H Dv -> E).

    ``forward(x (B, T, E), key_padding_mask=None (B, S), *, is_causal=True, return_weights=False,
    cache=None, positions=None, key_positions=None) -> (output (B, T, E), weights (B, H, T, S) or None)``,
    the call :class:`~attnlab.nn.CausalLayer` makes (self-attention only). The cache is a
    :class:`~attnlab.nn.KVCache` whose "keys" are the normalised latents (B, 1, S, C) and whose
    "values" the rotated rope keys (B, 1, S, Dr), so it meets the decoding-state protocol as it is.
    """

    returns_new_tensor = True

    def __init__(self, d_model: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 position: nn.Module | None = None, scale: float | None = None, latent_eps: float = 1e-6,
                 bias: bool = False, dropout: float = 0.0, absorb: bool | None = None):
        super().__init__()
        sizes = dict(d_model=d_model, num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                     v_head_dim=v_head_dim)
        bad = [f"{k}={v}" for k, v in sizes.items() if v <= 0]
        bad += [f"qk_nope_head_dim={qk_nope_head_dim}"] * (qk_nope_head_dim < 0)
        bad += [f"q_lora_rank={q_lora_rank}"] * (q_lora_rank is not None and q_lora_rank <= 0)
        if bad:
            raise ValueError(f"MultiHeadLatentAttention: sizes must be positive, got {', '.join(bad)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadLatentAttention: dropout must be in [0, 1), got {dropout}")
        self.d_model, self.num_heads, self.kv_lora_rank, self.q_lora_rank = d_model, num_heads, kv_lora_rank, q_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.position, self.dropout, self.absorb = position, dropout, absorb
        self.scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 if scale is None else scale
        H, q_out = num_heads, num_heads * (qk_nope_head_dim + qk_rope_head_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, H * (qk_nope_head_dim + v_head_dim), bias=False)
        self.out_proj = nn.Linear(H * v_head_dim, d_model, bias=bias)

    def cache_bytes_per_token(self, dtype: torch.dtype = torch.float32) -> int:
        """What one token costs this layer's cache: (C + Dr) numbers of ``dtype``."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * torch.empty((), dtype=dtype).element_size()

    # ------------------------------------------------------------------ projections
    def _queries(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, E) -> q_nope (B, H, T, Dn), q_rope (B, H, T, Dr)."""
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        B, T, _ = x.shape
        q = q.view(B, T, self.num_heads, -1).transpose(1, 2)
        return q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

    def _latents(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, T, E) -> normalised latent c (B, 1, T, C), rope key (B, 1, T, Dr) (not yet rotated)."""
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return self.kv_a_layernorm(c)[:, None], k_rope[:, None]

    def _up_weights(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's weight per head: W_UK (H, Dn, C) and W_UV (H, Dv, C)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, :self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    # ------------------------------------------------------------------ the two paths
    def _expanded(self, q_nope, q_rope, c, k_rope, mask, causal, return_weights) -> tuple[Tensor, Tensor | None]:
        """Decompress every latent into per-head keys and values, then attend: (B, H, T, Dv)."""
        B, _, S, _ = c.shape
        kv = self.kv_b_proj(c[:, 0]).view(B, S, self.num_heads, -1).transpose(1, 2)     # (B, H, S, Dn + Dv)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        p = self.dropout if self.training else 0.0
        return scaled_dot_product_attention(q, k, v, mask, p, causal, return_weights, self.scale)

    def _absorbed(self, q_nope, q_rope, c, k_rope, mask, causal, return_weights) -> tuple[Tensor, Tensor | None]:
        """Attend over the latents with W_UK folded into the query and W_UV applied after: (B, H, T, Dv).

        The H heads share the one latent key/value, so they are laid out as H * T queries of a
        single head: one product over the cache, never H copies of it."""
        B, H, T, _ = q_nope.shape
        S = c.size(2)
        w_uk, w_uv = self._up_weights()
        q = torch.cat([torch.matmul(q_nope, w_uk), q_rope], dim=-1)                    # (B, H, T, C + Dr)
        k = torch.cat([c, k_rope], dim=-1)                                             # (B, 1, S, C + Dr)
        if causal and T > 1:
            mask = combine_masks(mask, causal_mask(T, S, device=q.device))
        if mask is not None:                                                           # (b, h, T, S) -> (b, 1, H T, S)
            mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
            mask = mask.expand(mask.size(0), H, T, S).reshape(mask.size(0), 1, H * T, S)
        p = self.dropout if self.training else 0.0
        out, weights = scaled_dot_product_attention(q.reshape(B, 1, H * T, -1), k, c, mask, p, False,
                                                    return_weights, self.scale)
        out = torch.matmul(out.view(B, H, T, -1), w_uv.transpose(1, 2))                # (B, H, T, Dv)
        return out, None if weights is None else weights.view(B, H, T, S)

    # ------------------------------------------------------------------ forward
    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                mask: Tensor | None = None, *, key_padding_mask: Tensor | None = None, is_causal: bool | None = None,
                return_weights: bool = False, cache: KVCache | None = None, positions: Tensor | None = None,
                key_positions: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("MultiHeadLatentAttention: self-attention only (key and value must be None)")
        if query.dim() != 3 or query.size(-1) != self.d_model:
            raise ValueError(f"MultiHeadLatentAttention: input must be (batch, seq, d_model={self.d_model}), "
                             f"got {tuple(query.shape)}")
        if cache is not None and cache.static:
            raise ValueError("MultiHeadLatentAttention: a static (cross-attention) cache cannot hold latents")
        B, T, _ = query.shape
        past = 0 if cache is None else cache.length
        S = past + T
        q_nope, q_rope = self._queries(query)
        c, k_rope = self._latents(query)
        selects = getattr(cache, "selects", False)     # a cache kind that keeps some slots (sliding, sink)
        if self.position is not None or selects:
            positions, key_positions = MultiHeadAttention._positions(positions, key_positions, B, T, S, past,
                                                                     query.device)
        if selects:       # it keeps the latents and rope keys of its slots and rotates the rope part itself
            q_rope, k_rope, c, positions, key_positions, key_padding_mask, mask = cache.attend(
                self, q_rope, k_rope, c, positions, key_positions, key_padding_mask, mask)
            S = c.size(2)
        else:
            if self.position is not None:
                q_rope, k_rope = self.position.transform(q_rope, k_rope, positions, key_positions[..., past:])
            if cache is not None:
                c, k_rope = cache.update(c, k_rope)      # the cache holds (C + Dr) per token, nothing expanded
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S) or key_padding_mask.dtype != torch.bool:
                raise ValueError(f"MultiHeadLatentAttention: key_padding_mask must be a bool (batch, keys) = "
                                 f"{(B, S)} tensor, got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
            key_padding_mask = key_padding_mask[:, None, None, :]
        full = combine_masks(mask, key_padding_mask)
        causal = (True if is_causal is None else is_causal) and T > 1
        absorb = past > 0 if self.absorb is None else self.absorb
        attend = self._absorbed if absorb else self._expanded
        out, weights = attend(q_nope, q_rope, c, k_rope, full, causal, return_weights)
        return self.out_proj(out.transpose(1, 2).reshape(B, T, -1)), weights
