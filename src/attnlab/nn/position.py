"""Position information for attention: absolute tables added to embeddings, and the
relative kinds that act inside attention (rotations of q/k, biases on the scores).

Absolute, added to the (B, T, E) embeddings: :func:`sinusoidal_table`, :class:`PositionalEncoding`,
:class:`LearnedPositionalEmbedding`. Relative, an :class:`AttentionPosition` plugged into
``MultiHeadAttention(position=...)``: :class:`RotaryEmbedding` rotates q/k;
:class:`T5RelativePositionBias` and :class:`ALiBi` add a (·, H, T, S) bias to the scores.

Positions are absolute token indices. With a KV cache the new queries start at the cache
length, not at 0 (counting from 0 again would give every new token the first position); the
absolute modules take ``offset=`` or ``positions=``, the
relative ones query and key positions. Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .rope import normalize_rope_scaling, rope_frequencies

__all__ = ["AttentionPosition", "sinusoidal_table", "PositionalEncoding", "LearnedPositionalEmbedding",
           "RotaryEmbedding", "relative_position_bucket", "T5RelativePositionBias", "alibi_slopes", "ALiBi"]


class AttentionPosition(nn.Module):
    """Base of the position modules that plug into :class:`MultiHeadAttention`. Both hooks see
    the projected heads and the positions: a scheme may use positions only (RoPE, ALiBi, T5) or
    content too (DeBERTa's content-to-position and position-to-content terms, He et al. 2021).

    ``transform(q, k, q_pos, k_pos=None) -> (q, k)`` changes the new queries (B, H, T, D) and new
    keys (B, G, T', D) before the keys are cached (RoPE); k_pos defaults to q_pos.
    ``bias(q, k, q_pos, k_pos)`` returns None or a float bias broadcastable to (B, H, T, S), added
    to the scaled scores, given the queries and every key, cached and new (B, G, S, D).
    Positions: integer (T,) / (B, T) and (S,) / (B, S), true token positions (offset by a cache,
    counted over real tokens under padding). The defaults do nothing.
    """

    def transform(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return q, k

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        return None


# --------------------------------------------------------------------------- absolute tables

def sinusoidal_table(max_len: int, d_model: int) -> Tensor:
    """The (max_len, d_model) float32 table PE(pos, 2i) = sin(pos / 10000^(2i/d)),
    PE(pos, 2i+1) = cos(pos / 10000^(2i/d)). An odd d_model ends with a sine column.

    Vaswani et al. 2017, section 3.5. Computed in float64 and rounded once, so row 4999 is
    as accurate as row 0.
    """
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]                # (L, 1)
    freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * freq                                                       # (L, ceil(d/2))
    pe = torch.empty(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = angles.sin()
    pe[:, 1::2] = angles[:, : d_model // 2].cos()
    return pe.float()


def _rows(table: Tensor, T: int, offset: int, positions: Tensor | None, who: str) -> Tensor:
    """Rows of a (max_len, E) table for T tokens: (T, E) from offset, or table[positions]."""
    max_len = table.size(0)
    if positions is None:
        if offset < 0 or offset + T > max_len:
            raise ValueError(f"{who}: a sequence of {T} tokens at offset {offset} needs {offset + T} "
                             f"positions, but max_len is {max_len}")
        return table[offset:offset + T]
    if positions.shape[-1] != T or positions.dim() not in (1, 2):
        raise ValueError(f"{who}: positions must be (T,) or (B, T) with T = {T}, got {tuple(positions.shape)}")
    lo, hi = (int(v) for v in positions.aminmax())
    if lo < 0 or hi >= max_len:
        raise ValueError(f"{who}: position {hi if hi >= max_len else lo} is outside [0, max_len) "
                         f"with max_len {max_len}")
    return table[positions]


class PositionalEncoding(nn.Module):
    """x + PE[positions], then dropout, with PE the fixed :func:`sinusoidal_table`.

    Args: d_model: width E; max_len: longest sequence (plus offset) allowed; dropout: applied
    after the addition (section 5.4 of the paper).

    ``forward(x (B, T, E), offset=0, positions=None) -> (B, T, E)``. The (T, E) rows are
    added along the *sequence* axis and broadcast over the batch (broadcast over the
    first axis of a batch-first tensor, a table would add row b to every token of sample b). ``offset``
    shifts the rows (cached decoding); ``positions`` (T,) or (B, T) picks them explicitly
    (left-padded batches). Positions beyond ``max_len`` raise ValueError.
    """

    def __init__(self, d_model: int, max_len: int = 5000, dropout: float = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pe", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        rows = _rows(self.pe, x.size(1), offset, positions, "PositionalEncoding")
        return self.dropout(x + rows.to(x.dtype))


class LearnedPositionalEmbedding(nn.Module):
    """x + P[positions] with P a trained (max_len, d_model) table (GPT-2, BERT; Gehring et al.
    2017; Vaswani et al. 2017 section 3.5 found it on par with the sinusoids). Same
    ``forward(x, offset=0, positions=None)`` and ValueError as :class:`PositionalEncoding`.
    Initialised N(0, 0.02) as GPT-2.
    """

    def __init__(self, max_len: int, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, d_model) * 0.02)
        self.dropout = nn.Dropout(dropout)

    def no_weight_decay(self) -> tuple[str, ...]:
        """The table is an embedding: rows of positions seldom seen (the long ones) would only shrink."""
        return ("weight",)

    def forward(self, x: Tensor, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        rows = _rows(self.weight, x.size(1), offset, positions, "LearnedPositionalEmbedding")
        return self.dropout(x + rows.to(x.dtype))


# --------------------------------------------------------------------------- rotary

class RotaryEmbedding(AttentionPosition):
    r"""Rotary position embedding (RoPE): each channel pair (x1, x2) of q and k at position m
    is rotated by the angle m * theta_i, theta_i = base^(-2i/d), i < d/2:

        x1' = x1 cos(m theta_i) - x2 sin(m theta_i),   x2' = x2 cos(m theta_i) + x1 sin(m theta_i)

    so q_m . k_n depends only on m - n. Su et al. 2021, "RoFormer", section 3.4.

    Args:
        head_dim: D. rotary_dim: d <= D channels rotated (default D, must be even); the
            remaining D - d channels pass through (GPT-NeoX / Phi "partial rotary").
        base: theta base (LLaMA 1/2: 10000).
        interleaved: channel layout of the pairs. False: half-split, pair i = (x_i, x_{i+d/2})
            (Hugging Face LLaMA's ``rotate_half``). True: interleaved, pair i = (x_{2i}, x_{2i+1})
            (RoFormer, Meta's complex-number code). The two differ by a permutation of the q/k
            projection rows, per head: a checkpoint in the other layout loads without error and gives
            wrong logits, so conversion permutes the rows (attnlab.models.convert).
        scaling: None, or ``{"rope_type": KIND, ...}`` with KIND one of :data:`attnlab.nn.rope.ROPE_TYPES`
            and Hugging Face's ``rope_parameters`` keys (``"type"`` is read too): linear
            (position interpolation), ntk, dynamic, llama3, yarn, longrope; :mod:`attnlab.nn.rope`
            gives each one's frequencies and the factor on cos/sin (``attention_factor``).
        max_position_embeddings: the trained context, which ``dynamic`` scales from and
            ``longrope`` takes its factor from when the scaling gives none.

    ``transform(q (B, H, T, D), k (B, G, T', D), q_pos (T,) or (B, T), k_pos=None)`` returns
    rotated q, k in their dtype. Frequencies, angles, cos/sin and the rotation are computed in
    fp32 (bf16 angles lose whole radians at positions in the thousands); cos/sin are cached for
    the largest position seen so far.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, interleaved: bool = False,
                 scaling: dict | None = None, rotary_dim: int | None = None,
                 max_position_embeddings: int | None = None):
        super().__init__()
        dim = head_dim if rotary_dim is None else rotary_dim
        if dim % 2 or not 0 < dim <= head_dim:
            raise ValueError(f"RotaryEmbedding: rotary_dim ({dim}) must be even and in (0, head_dim={head_dim}]")
        self.scaling = normalize_rope_scaling(scaling, dim)
        self.kind = "default" if self.scaling is None else self.scaling["rope_type"]
        if self.kind in ("dynamic", "longrope") and max_position_embeddings is None and \
                (self.kind == "dynamic" or self.scaling.get("factor") is None):
            raise ValueError(f"RotaryEmbedding: {self.kind} RoPE needs max_position_embeddings")
        self.head_dim, self.rotary_dim, self.base = head_dim, dim, base
        self.interleaved, self.max_position_embeddings = interleaved, max_position_embeddings
        # plain attributes, not buffers: module.to(torch.bfloat16) must not round them
        self.inv_freq, self.attention_factor = rope_frequencies(dim, base, self.scaling, max_position_embeddings)
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        # the cos/sin of the last positions looked up, kept with the positions tensor itself (so
        # that its memory is not reused while the entry lives): every layer of a decoding step
        # rotates by the same positions, looked up once (_looked_up)
        self._last: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}

    def frequencies(self, seq_len: int) -> Tensor:
        """The (d/2,) fp32 inverse frequencies for a call whose longest sequence is ``seq_len``
        (max position + 1): those of construction, except for the length-dependent kinds past
        their trained context (``dynamic``: a larger base; ``longrope``: the long factors)."""
        if self.kind == "dynamic" and seq_len > self.max_position_embeddings or \
                self.kind == "longrope" and seq_len > self.scaling["original_max_position_embeddings"]:
            return rope_frequencies(self.rotary_dim, self.base, self.scaling, self.max_position_embeddings,
                                    seq_len)[0]
        return self.inv_freq

    @staticmethod
    def _key(positions: Tensor, seq_len: int | None) -> tuple | None:
        """What identifies a positions tensor's values without reading them: its memory, layout and
        version counter (an in-place write moves the counter; views of one tensor share it). None
        for a tensor made under ``torch.inference_mode``, which keeps no version counter."""
        if positions.is_inference():
            return None
        return (positions.data_ptr(), positions.device, positions.dtype, positions.shape, positions.stride(),
                positions._version, seq_len)

    def _looked_up(self, positions: Tensor, T: int, seq_len: int | None) -> tuple[Tensor, Tensor]:
        """:meth:`_cos_sin`, reusing an earlier call's result for the same positions (the next
        layer's: the queries' and the new keys' positions, two entries at most)."""
        key = self._key(positions, seq_len)
        if key is None:
            return self._cos_sin(positions, T, seq_len)
        memo = self.__dict__.setdefault("_last", {})
        hit = memo.get(key)
        if hit is None:
            if len(memo) >= 2:
                memo.clear()
            hit = memo[key] = (positions, *self._cos_sin(positions, T, seq_len))
        return hit[1], hit[2]

    def _cos_sin(self, positions: Tensor, T: int, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """fp32 cos/sin (T, d/2) or (B, 1, T, d/2) for the positions, times the attention factor:
        from the grown cache, or computed for this call where the length changes the frequencies."""
        if positions.dim() not in (1, 2) or positions.shape[-1] != T or positions.is_floating_point():
            raise ValueError(f"RotaryEmbedding: positions must be integer (T,) or (B, T) with T = {T}, "
                             f"got {tuple(positions.shape)} {positions.dtype}")
        lo, hi = (int(v) for v in positions.aminmax())
        if lo < 0:
            raise ValueError(f"RotaryEmbedding: negative position {lo}")
        device = positions.device
        inv_freq = self.frequencies(hi + 1 if seq_len is None else seq_len)
        if inv_freq is not self.inv_freq:
            angles = positions.float()[..., None] * inv_freq.to(device)       # (..., T, d/2), fp32
            cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        else:
            if self._cos is None or self._cos.size(0) <= hi or self._cos.device != device:
                cached = 0 if self._cos is None else self._cos.size(0)
                t = torch.arange(max(hi + 1, 2 * cached), device=device, dtype=torch.float32)
                angles = torch.outer(t, self.inv_freq.to(device))            # (L, d/2), fp32
                self._cos, self._sin = angles.cos(), angles.sin()
                if self.attention_factor != 1.0:
                    self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor
            cos, sin = self._cos[positions], self._sin[positions]
        if positions.dim() == 2:                                              # (B, T, d/2) -> (B, 1, T, d/2)
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.size(-1) != self.head_dim:
            raise ValueError(f"RotaryEmbedding: head dim {x.size(-1)} != head_dim {self.head_dim}")
        d = self.rotary_dim
        xr = x[..., :d].float()
        if self.interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        else:
            x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = torch.stack((r1, r2), dim=-1).flatten(-2) if self.interleaved else torch.cat((r1, r2), dim=-1)
        rot = rot.to(x.dtype)
        return rot if d == x.size(-1) else torch.cat((rot, x[..., d:]), dim=-1)

    def transform(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # the length-dependent kinds read the call's length from the queries (transformers: its position ids)
        seq_len = int(q_pos.max()) + 1 if self.kind in ("dynamic", "longrope") else None
        cos, sin = self._looked_up(q_pos, q.size(-2), seq_len)
        if k_pos is not None and k_pos is not q_pos:
            key = self._key(k_pos, seq_len)
            if key is None or key != self._key(q_pos, seq_len):
                return self._rotate(q, cos, sin), self._rotate(k, *self._looked_up(k_pos, k.size(-2), seq_len))
        if q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] \
                and q.dtype == k.dtype and q.device == k.device:
            qk = self._rotate(torch.cat((q, k), dim=1), cos, sin)     # side by side: half the small ops
            return qk[:, :q.size(1)], qk[:, q.size(1):]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


# --------------------------------------------------------------------------- T5 relative bias

def relative_position_bucket(relative_position: Tensor, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """T5's bucket of each relative position (key position - query position), same shape, long.

    Bidirectional: half the buckets for keys after the query, half for keys before.
    Causal: only keys at or before the query count (later ones share bucket 0). Within a half,
    distances below n/2 get one bucket each; larger ones share log-spaced buckets up to
    ``max_distance``, beyond it the last bucket. Raffel et al. 2020, section 2.1.
    """
    offset = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        offset = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # log-spaced buckets; clamp so log() never sees 0 (those distances take the exact branch)
    far = distance.clamp(min=max_exact).float()
    log_bucket = max_exact + (torch.log(far / max_exact) / math.log(max_distance / max_exact)
                              * (num_buckets - max_exact)).long()
    log_bucket = log_bucket.clamp(max=num_buckets - 1)
    return offset + torch.where(distance < max_exact, distance, log_bucket)


class T5RelativePositionBias(AttentionPosition):
    """Learned scalar bias per head and relative-position bucket, added to the scores:
    bias[h, i, j] = E[bucket(k_pos[j] - q_pos[i]), h]. Raffel et al. 2020, section 2.1.

    Args: num_heads H; num_buckets, max_distance (see :func:`relative_position_bucket`);
    bidirectional: True for the encoder, False for causal decoder self-attention.
    ``position_bias(q_pos (T,) or (B, T), k_pos (S,) or (B, S))`` -> (1, H, T, S) or (B, H, T, S)
    (the attention hook ``bias`` returns it, ignoring q and k).
    For **self-attention only**: T5's cross-attention has no position bias, so never pass
    this module to a cross-attention layer (transformers PR#8518 fixed that mistake there). T5 computes it
    in the first layer and shares it with the others; share the module to do the same.
    """

    def __init__(self, num_heads: int, num_buckets: int = 32, max_distance: int = 128,
                 bidirectional: bool = True):
        super().__init__()
        self.num_heads, self.num_buckets, self.max_distance = num_heads, num_buckets, max_distance
        self.bidirectional = bidirectional
        self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.position_bias(q_pos, k_pos)

    def position_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        relative = k_pos[..., None, :] - q_pos[..., :, None]                 # (T, S) or (B, T, S)
        buckets = relative_position_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias(buckets).movedim(-1, -3)       # (..., H, T, S)
        return values if values.dim() == 4 else values[None]


# --------------------------------------------------------------------------- ALiBi

def alibi_slopes(num_heads: int) -> Tensor:
    """(H,) float32 ALiBi slopes. For H a power of two: 2^(-8/H), 2^(-16/H), ..., 2^(-8).
    Otherwise, with n the largest power of two below H: the n slopes for n heads, then every
    other slope of the 2n sequence (1st, 3rd, ...) for the remaining H - n heads.
    Press et al. 2022, section 3 (the rule for H not a power of two is theirs; the naive
    2^(-8k/H) differs from it).
    """
    if num_heads <= 0:
        raise ValueError(f"alibi_slopes: num_heads must be positive, got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(n) + geometric(2 * n)[0::2][: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


class ALiBi(AttentionPosition):
    """Attention with Linear Biases: bias[h, i, j] = -m_h * |q_pos[i] - k_pos[j]|, m_h from
    :func:`alibi_slopes`; no position embedding anywhere else. Press et al. 2022, section 3.

    For causal attention: a key d tokens behind the query gets -m_h * d (keys ahead are masked
    anyway). ``position_bias(q_pos, k_pos)`` as T5's: (1, H, T, S) or (B, H, T, S), float32.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.slopes: Tensor = alibi_slopes(num_heads)    # plain attribute: stays float32

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.position_bias(q_pos, k_pos)

    def position_bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        distance = (q_pos[..., :, None] - k_pos[..., None, :]).abs().float()  # (T, S) or (B, T, S)
        out = -self.slopes.to(distance.device)[:, None, None] * distance.unsqueeze(-3)
        return out if out.dim() == 4 else out[None]
