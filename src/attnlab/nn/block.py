"""Encoder, decoder and causal (decoder-only) layers, Post-Norm (the 2017 paper) or Pre-Norm.

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
from .inplace import may_overwrite
from .mlp import FeedForward, SparseMoE
from .packing import Packing
from .norm import make_norm

__all__ = ["EncoderLayer", "DecoderLayer", "CausalLayer"]


class _Layer(nn.Module):
    """The residual wiring the three layers share: every sublayer is wrapped as
    Pre-Norm ``x + Dropout(F(Norm(x)))`` or Post-Norm ``Norm(x + Dropout(F(x)))``."""

    def __init__(self, dropout: float, norm_first: bool):
        super().__init__()
        self.norm_first = norm_first
        self.dropout = nn.Dropout(dropout)

    def _set_norms(self, make, self_attn_norm, ff_norm, self_attn_out_norm, ff_out_norm) -> None:
        """The two sublayers' norms: the given modules, else ``make()``; the output norms (Pre-Norm
        only) registered only when given, so that layers without them keep their state-dict keys."""
        if (self_attn_out_norm is not None or ff_out_norm is not None) and not self.norm_first:
            raise ValueError(f"{type(self).__name__}: output norms (self_attn_out_norm, ff_out_norm) need "
                             f"norm_first=True")
        self.self_attn_norm = self_attn_norm if self_attn_norm is not None else make()
        self.ff_norm = ff_norm if ff_norm is not None else make()
        if self_attn_out_norm is not None:
            self.self_attn_out_norm = self_attn_out_norm
        if ff_out_norm is not None:
            self.ff_out_norm = ff_out_norm

    def _out(self, name: str, y: Tensor, sublayer: nn.Module) -> tuple[Tensor, nn.Module]:
        """A sublayer's output through its output norm, if any, and the module that produced it."""
        norm = getattr(self, name, None)
        return (y, sublayer) if norm is None else (norm(y), norm)

    def _norm_in(self, norm: nn.Module, x: Tensor) -> Tensor:
        """The sublayer's input: normalised first in Pre-Norm, as is in Post-Norm."""
        return norm(x) if self.norm_first else x

    def _add_norm(self, norm: nn.Module, x: Tensor, y: Tensor, sublayer: nn.Module) -> Tensor:
        """The paper's "Add & Norm": the residual sum, normalised after it in Post-Norm. ``y`` is
        ``sublayer``'s output; in inference the sum is written into it (attnlab.nn.inplace)."""
        y = self.dropout(y)
        if y.shape == x.shape and y.dtype == x.dtype and may_overwrite(self, y, sublayer):
            x = y.add_(x)                # y + x: the same bits as x + y
        else:
            x = x + y
        return x if self.norm_first else norm(x)


class EncoderLayer(_Layer):
    """Self-attention then feed-forward, each wrapped in residual + norm.

    Args:
        d_model, num_heads, d_ff, dropout: as in the paper (512, 8, 2048, 0.1).
        norm_first: Pre-Norm if True, Post-Norm (the paper) if False.
        activation: feed-forward activation ("relu", "gelu", ...).
        norm: "layernorm" | "rmsnorm" | "dyt"; eps its epsilon; dyt_alpha DyT's initial alpha.
        self_attn, ff: ready-made modules to plug in instead of the defaults (for example an
            attention with a position module, or a gated MLP).
        self_attn_norm, ff_norm: norm modules instead of ``norm``'s (``nn.Identity()`` for none).
        self_attn_out_norm, ff_out_norm: Pre-Norm only: norms of each sublayer's output before the
            residual sum, x = x + OutNorm(F(Norm(x))) ("sandwich" norms with both, Ding et al. 2021).

    Submodules: ``self_attn``, ``self_attn_norm``, ``ff``, ``ff_norm`` (each norm belongs to the
    sublayer it wraps: before it in Pre-Norm, after the residual sum in Post-Norm).

    forward(x (B, T, E), mask=None, key_padding_mask=None) -> x (B, T, E): the chapter's
    ``forward(x, mask)`` and torch.nn.TransformerEncoderLayer's order. ``mask`` broadcastable to
    (B, H, T, T): bool True = may attend, or float added to the scores (torch's boolean masks
    mean the opposite: pass ``~mask``); ``key_padding_mask`` (B, T) bool, True = real token
    (torch's ``src_key_padding_mask`` is True = ignore: pass ``~mask``). Attention weights:
    ``attnlab.viz.record_attention``. ``packing`` (an :class:`~attnlab.nn.packing.Packing`): x is
    the (N, E) real tokens of a padded batch, and so is the output; every position-wise step runs
    on those rows alone (the key mask defaults to the packing's). ``first_only``: the output of
    the first position alone, (B, 1, E), its keys and values still from every token (what the
    last layer owes a head that reads [CLS] only).
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layernorm",
                 eps: float = 1e-5, bias: bool = True, dyt_alpha: float = 0.5,
                 self_attn: nn.Module | None = None, ff: nn.Module | None = None,
                 self_attn_norm: nn.Module | None = None, ff_norm: nn.Module | None = None,
                 self_attn_out_norm: nn.Module | None = None, ff_out_norm: nn.Module | None = None):
        super().__init__(dropout, norm_first)
        self.self_attn = self_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias)
        self.ff = ff or FeedForward(d_model, d_ff, dropout, activation=activation, bias=bias)
        # registered after the sublayers, so parameter order (optimizer state) is as before the renaming
        self._set_norms(lambda: make_norm(norm, d_model, eps, dyt_alpha), self_attn_norm, ff_norm,
                        self_attn_out_norm, ff_out_norm)

    def forward(self, x: Tensor, mask: Tensor | None = None, key_padding_mask: Tensor | None = None, *,
                packing: Packing | None = None, first_only: bool = False) -> Tensor:
        h = self._norm_in(self.self_attn_norm, x)
        if packing is not None:                      # x: the (N, E) real tokens of a padded batch
            if first_only:
                raise ValueError("EncoderLayer: first_only takes the padded (B, T, E) layout, not packing")
            a, _ = self.self_attn(h, None, None, mask, key_padding_mask=key_padding_mask, packing=packing)
        elif first_only:                             # queries: the first position; keys and values: all
            if mask is not None:
                raise ValueError("EncoderLayer: first_only takes a key_padding_mask, not an attention mask")
            a, _ = self.self_attn(h[:, :1], h, h, key_padding_mask=key_padding_mask)
            x = x[:, :1]
        else:
            a, _ = self.self_attn(h, h, h, mask, key_padding_mask=key_padding_mask)
        x = self._add_norm(self.self_attn_norm, x, *self._out("self_attn_out_norm", a, self.self_attn))
        y = self.ff(self._norm_in(self.ff_norm, x))
        return self._add_norm(self.ff_norm, x, *self._out("ff_out_norm", y, self.ff))


class DecoderLayer(_Layer):
    """Masked (causal) self-attention, cross-attention over the encoder memory, feed-forward.

    Cross-attention projects the queries from the decoder stream and the keys/values from
    the memory, each with its own weights. Arguments as :class:`EncoderLayer`, plus
    ``cross_attn``; submodules ``self_attn``, ``self_attn_norm``, ``cross_attn``,
    ``cross_attn_norm``, ``ff``, ``ff_norm``.

    forward(x (B, T, E), memory (B, S, E), *, tgt_mask (T, T), memory_mask (T, S),
    tgt_key_padding_mask (B, T), memory_key_padding_mask (B, S),
    cache=(self KVCache, cross KVCache) for step-by-step decoding) -> x (B, T, E).
    torch.nn.TransformerDecoderLayer's names, keyword-only: the chapter's positional order
    ``(x, memory, src_mask, tgt_mask)`` and torch's ``(tgt, memory, tgt_mask, memory_mask)``
    disagree, so a positional mask would land on the wrong attention. Attention masks: bool
    True = may attend, or float added; ``tgt_mask`` applies on top of the causal self-attention.
    Padding masks: True = real token.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layernorm",
                 eps: float = 1e-5, bias: bool = True,
                 self_attn: nn.Module | None = None, cross_attn: nn.Module | None = None,
                 ff: nn.Module | None = None):
        super().__init__(dropout, norm_first)
        self.self_attn = self_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias, causal=True)
        self.cross_attn = cross_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias)
        self.ff = ff or FeedForward(d_model, d_ff, dropout, activation=activation, bias=bias)
        self.self_attn_norm = make_norm(norm, d_model, eps)
        self.cross_attn_norm = make_norm(norm, d_model, eps)
        self.ff_norm = make_norm(norm, d_model, eps)

    def forward(self, x: Tensor, memory: Tensor, *, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None,
                cache: tuple[KVCache, KVCache] | None = None) -> Tensor:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        h = self._norm_in(self.self_attn_norm, x)
        a, _ = self.self_attn(h, h, h, tgt_mask, key_padding_mask=tgt_key_padding_mask, cache=self_cache)
        x = self._add_norm(self.self_attn_norm, x, a, self.self_attn)
        h = self._norm_in(self.cross_attn_norm, x)
        a, _ = self.cross_attn(h, memory, memory, memory_mask, key_padding_mask=memory_key_padding_mask,
                               cache=cross_cache)
        x = self._add_norm(self.cross_attn_norm, x, a, self.cross_attn)
        return self._add_norm(self.ff_norm, x, self.ff(self._norm_in(self.ff_norm, x)), self.ff)


class CausalLayer(_Layer):
    """One decoder-only block (GPT, LLaMA, Mixtral): causal self-attention then feed-forward,

        Pre-Norm:  x = x + Attn(Norm(x));  x = x + FF(Norm(x))

    with the arguments and submodules of :class:`EncoderLayer` (the default attention is causal).
    The output norms give x = x + OutNorm(Attn(Norm(x))): both norms are "sandwich" norms; an
    identity input norm leaves only the norm of each residual branch.

    forward(x (B, T, E), key_padding_mask (B, S) True = real token (S = cached + new tokens),
    positions (T,) or (B, T) of the queries, key_positions (S,) or (B, S) of all keys, cache)
    -> x (B, T, E). A :class:`SparseMoE` feed-forward also gets the new tokens' padding mask,
    so that padding is routed to no expert.
    """

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1, *,
                 norm_first: bool = False, activation: str = "relu", norm: str = "layernorm",
                 eps: float = 1e-5, bias: bool = True, dyt_alpha: float = 0.5,
                 self_attn: nn.Module | None = None, ff: nn.Module | None = None,
                 self_attn_norm: nn.Module | None = None, ff_norm: nn.Module | None = None,
                 self_attn_out_norm: nn.Module | None = None, ff_out_norm: nn.Module | None = None):
        super().__init__(dropout, norm_first)
        self.self_attn = self_attn or MultiHeadAttention(d_model, num_heads, dropout, bias=bias, causal=True)
        self.ff = ff or FeedForward(d_model, d_ff, dropout, activation=activation, bias=bias)
        self._set_norms(lambda: make_norm(norm, d_model, eps, dyt_alpha), self_attn_norm, ff_norm,
                        self_attn_out_norm, ff_out_norm)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, *, positions: Tensor | None = None,
                key_positions: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        h = self._norm_in(self.self_attn_norm, x)
        a, _ = self.self_attn(h, key_padding_mask=key_padding_mask, is_causal=True, cache=cache,
                              positions=positions, key_positions=key_positions)
        x = self._add_norm(self.self_attn_norm, x, *self._out("self_attn_out_norm", a, self.self_attn))
        h = self._norm_in(self.ff_norm, x)
        if isinstance(self.ff, SparseMoE):
            y = self.ff(h, None if key_padding_mask is None else key_padding_mask[:, -x.size(1):])
        else:
            y = self.ff(h)
        return self._add_norm(self.ff_norm, x, *self._out("ff_out_norm", y, self.ff))
