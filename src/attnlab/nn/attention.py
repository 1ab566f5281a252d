"""Scaled dot-product attention, multi-head attention and the mask helpers.

Glossary of tensor letters used in shapes throughout attnlab:
B batch, T query length, S key/value length, H query heads, G key/value heads
(grouped-query attention, H % G == 0), D head dimension, E model width (d_model).

One mask convention everywhere (the one of ``torch.nn.functional.scaled_dot_product_attention``):
a boolean mask is True where attention is *allowed*; a float mask is *added* to the scores
(0 = allowed, -inf = blocked). A padding mask is a (B, S) boolean tensor, True for real tokens.
A query row with no allowed key returns zeros (and zero gradients), never NaN.

Paper: Vaswani et al. 2017, "Attention Is All You Need", section 3.2.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache
from .checkpoint import recomputing
from .linear import StackedLinear
from .packing import Packing

__all__ = [
    "scaled_dot_product_attention",
    "causal_mask",
    "padding_mask",
    "combine_masks",
    "generate_square_subsequent_mask",
    "MultiHeadAttention",
]


# --------------------------------------------------------------------------- masks

def causal_mask(q_len: int, k_len: int | None = None, device=None) -> Tensor:
    """Boolean (T, S) mask, True where query i may attend key j.

    The triangle is aligned bottom-right: query i sits at absolute position ``S - T + i``
    (the last query is the newest token), so a query attends every key at or before its
    own position. With T == S this is the usual lower triangle; with a KV cache of
    ``S - T`` earlier tokens it is what incremental decoding and chunked prefill need.
    """
    k_len = q_len if k_len is None else k_len
    if k_len < q_len:
        raise ValueError(f"causal_mask: key length {k_len} is shorter than query length {q_len}")
    q_pos = torch.arange(k_len - q_len, k_len, device=device)
    k_pos = torch.arange(k_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]


def padding_mask(x: Tensor, pad_id: int | None = None, *, max_len: int | None = None) -> Tensor:
    """Boolean (B, S) padding mask, True for real tokens.

    ``padding_mask(ids, pad_id=0)`` marks every id != pad_id; ``padding_mask(lengths)`` with
    a 1-D tensor of lengths marks the first ``lengths[b]`` positions of row b (``max_len``
    sets S, default ``lengths.max()``).
    """
    if pad_id is not None:
        if x.dim() != 2:
            raise ValueError(f"padding_mask: token ids must be (batch, seq), got shape {tuple(x.shape)}")
        return x != pad_id
    if x.dim() != 1 or x.dtype.is_floating_point:
        raise ValueError("padding_mask: give (batch, seq) token ids with pad_id=..., or a 1-D integer tensor of lengths")
    if (x < 0).any():
        raise ValueError("padding_mask: lengths must be non-negative")
    S = int(x.max()) if max_len is None else max_len
    return torch.arange(S, device=x.device)[None, :] < x[:, None]


def combine_masks(*masks: Tensor | None, dtype: torch.dtype | None = None) -> Tensor | None:
    """Combine attention masks (each broadcastable to (B, H, T, S)) into one.

    All boolean: the result is their logical AND (allowed only where every mask allows).
    Any float mask present: booleans become 0 / -inf and everything is summed, in ``dtype``
    (default: the float mask's dtype). ``None`` entries are skipped; all ``None`` gives ``None``.
    A (B, S) padding mask must first be reshaped to (B, 1, 1, S).
    """
    present = [m for m in masks if m is not None]
    if not present:
        return None
    floats = [m for m in present if m.dtype != torch.bool]
    if not floats:
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = dtype or floats[0].dtype
    out = None
    for m in present:
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
        else:
            m = m.to(dtype)
        out = m if out is None else out + m
    return out


def generate_square_subsequent_mask(sz: int, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Float (sz, sz) causal mask: 0.0 on and below the diagonal, -inf above.

    The same values as ``torch.nn.Transformer.generate_square_subsequent_mask``, kept for the
    chapter's readers. It is an *additive* mask: passing it where a boolean "True = attend"
    mask is expected, or testing it with ``mask == 0`` as the chapter does, inverts it.
    Prefer :func:`causal_mask` (boolean) or ``is_causal=True``.
    """
    return torch.triu(torch.full((sz, sz), float("-inf"), dtype=dtype, device=device), diagonal=1)


# --------------------------------------------------------------------------- the function

def _check_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"attention: q, k, v must have the same number of dims (..., L, D), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"attention: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.size(-1) != k.size(-1):
        raise ValueError(f"attention: query head dim {q.size(-1)} != key head dim {k.size(-1)}")
    if k.size(-2) != v.size(-2):
        raise ValueError(f"attention: key length {k.size(-2)} != value length {v.size(-2)}")
    if q.dim() >= 3 and q.size(-3) != k.size(-3) and (k.size(-3) == 0 or q.size(-3) % k.size(-3)):
        raise ValueError(f"attention: {q.size(-3)} query heads are not a multiple of {k.size(-3)} key/value heads")
    if mask is not None:
        target = (*q.shape[:-1], k.size(-2))
        try:
            shape = torch.broadcast_shapes(mask.shape, target)
        except RuntimeError:
            shape = None
        if shape != torch.Size(target):
            raise ValueError(f"attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"(..., T, S) = {target}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise ValueError(f"attention: mask must be bool (True = attend) or float (added), got {mask.dtype}")


def _explicit(q, k, v, mask, dropout_p, scale, training_dropout, softcap=None):
    """softmax(q k^T * scale + mask) v with the softmax in fp32, the scaled scores soft-capped to
    (-softcap, softcap) first when given. Returns (out, weights)."""
    scores = torch.matmul(q, k.transpose(-2, -1)).float()               # (..., T, S)
    if softcap is None:
        scores.mul_(scale)       # in place on a fresh temporary: the matmul's output is not saved for backward
    else:
        scores = torch.tanh(scores * (scale / softcap)) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    weights = torch.softmax(scores, dim=-1).to(q.dtype)
    dropped = F.dropout(weights, dropout_p) if training_dropout else weights
    return torch.matmul(dropped, v), weights


def _fp32_for_backward(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether a bf16 CPU call runs torch's fused kernel on fp32 copies of its inputs: where autograd
    will differentiate it (and no learned mask takes the explicit path: :func:`_learned_mask_on_cpu`).
    The kernel's bf16 backward is slow on the CPU (slower than on fp32 copies, five times at Swin-T's
    49-token windows; benchmarks/results/code.md), while its bf16 forward is as fast as fp32's. The fp32 kernel is also
    the more exact (softmax and both products in fp32, rounded once)."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and torch.is_grad_enabled()
            and (q.requires_grad or k.requires_grad or v.requires_grad))


def _learned_mask_on_cpu(q: Tensor, mask: Tensor | None) -> bool:
    """Whether autograd will differentiate a float mask (a learned bias: Swin's relative positions,
    T5's) on the CPU. torch's fused kernels give no gradient for a mask, so torch's SDPA then runs
    its math fallback, which the explicit path outruns in fp32 and bf16 (where the explicit path's
    softmax is fp32 and its products bf16; benchmarks/results/code.md)."""
    return (mask is not None and q.device.type == "cpu" and mask.dtype != torch.bool and mask.requires_grad
            and torch.is_grad_enabled())


def _fused(q, k, v, mask, dropout_p, is_causal, scale, gqa: bool = False) -> Tensor:
    """torch's SDPA kernel, the float mask in the computing dtype; bf16 inputs that autograd will
    differentiate on the CPU compute in fp32 (:func:`_fp32_for_backward`), returned in bf16."""
    if _fp32_for_backward(q, k, v):
        with torch.autocast("cpu", enabled=False):          # autocast would cast the copies back to bf16
            mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                 dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        return out.to(q.dtype)
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    return_weights: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    r"""Attention(Q, K, V) = softmax(Q K^T / sqrt(D) + M) V.

    Args:
        q: (B, H, T, D) queries (any leading dims; ``(..., T, D)``).
        k: (B, G, S, D) keys; G may divide H (grouped-query attention: each key/value head
            serves H/G query heads).
        v: (B, G, S, Dv) values.
        mask: broadcastable to (B, H, T, S); boolean True = may attend, or float added to the
            scores. ``None`` = attend everywhere.
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        is_causal: add a causal mask aligned bottom-right (query i is at position S - T + i),
            so it stays correct with a KV cache where T < S.
        return_weights: also return the (B, H, T, S) attention weights. This forces the
            explicit path; the default fused path never materialises them.
        scale: defaults to 1 / sqrt(D).
        softcap: None, or c > 0: the scaled scores s become c * tanh(s / c) before the mask
            (logit soft-capping), which keeps every score inside (-c, c). It takes the
            explicit path (torch's fused kernels have no such step).

    Returns:
        ``(out, weights)``: out is (B, H, T, Dv); weights is None unless requested.
        A query row with no allowed key gives a zero output row and zero weights.

    The explicit path (matmul, scale, mask, softmax in fp32, matmul) is the formula as
    written; the fused path calls torch's SDPA kernels. Both give the same numbers, NaN
    included: a NaN (or infinite) query or a NaN scale gives NaN rows on both paths.
    """
    _check_inputs(q, k, v, mask)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"attention: softcap must be None or > 0, got {softcap}")
    T, S = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale

    only_causal = is_causal and mask is None       # a bottom-right triangle never empties a row
    if is_causal and (mask is not None or T != S or return_weights or softcap is not None):
        mask = combine_masks(mask, causal_mask(T, S, device=q.device))
        is_causal = False

    # Rows with no allowed key: let them attend everywhere, then zero them. This keeps
    # both the forward value and every gradient finite (exactly zero for those rows).
    empty_rows = None
    if mask is not None and not only_causal:
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        empty_rows = ~allowed.any(dim=-1, keepdim=True)                 # (..., T, 1)
        # most masks empty no row (a padding mask with no all-padding sequence, Swin's windows):
        # on the CPU, where reading the flag costs no device sync, skip the two copies then
        if q.device.type == "cpu" and not bool(empty_rows.any()):
            empty_rows = None
        elif mask.dtype == torch.bool:
            mask = mask | empty_rows
        else:
            mask = mask.masked_fill(empty_rows, 0.0)

    explicit = return_weights or _learned_mask_on_cpu(q, mask) or softcap is not None
    grouped = q.dim() >= 3 and q.size(-3) != k.size(-3)                  # grouped-query heads
    # without autograd torch's kernel reads each key/value head for its H/G query heads itself
    # (enable_gqa: the same numbers, without copying the keys and values H/G times per call)
    gqa = grouped and not explicit and q.dim() == 4 and not _fp32_for_backward(q, k, v) and not (
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
    if grouped and not gqa:
        rep = q.size(-3) // k.size(-3)
        k = k.repeat_interleave(rep, dim=-3)
        v = v.repeat_interleave(rep, dim=-3)

    weights = None
    if return_weights:
        out, weights = _explicit(q, k, v, mask, dropout_p, scale, dropout_p > 0.0, softcap)
    elif explicit:
        out, _ = _explicit(q, k, v, mask, dropout_p, scale, dropout_p > 0.0, softcap)
    else:
        out = _fused(q, k, v, mask, dropout_p, is_causal, scale, gqa)
        # torch's fused CPU kernel returns zeros for a query row holding NaN (or inf) and for a
        # NaN scale, where the formula (and the explicit path) gives NaN: put NaN back in those
        # rows, so that a divergence shows instead of hiding. The check is one sum per row (a
        # row's sum is finite exactly when its entries are, short of an fp32 overflow that would
        # overflow the scores too): ~15x cheaper than isfinite(q).all(-1), which cost as much as
        # the attention kernel at BERT-base shapes. On the CPU, where reading the flag costs no
        # device sync, the output is only copied when a row needs NaN.
        # (On the CPU one sum over all of q says first whether any row can hold one.)
        if math.isnan(scale):
            out = out + float("nan")
        elif q.device.type != "cpu" or not math.isfinite(float(q.detach().sum())):
            bad = ~torch.isfinite(q.sum(dim=-1, keepdim=True))
            out = out.masked_fill(bad, float("nan"))
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
        if weights is not None:
            weights = weights.masked_fill(empty_rows, 0.0)
    return out, weights


# --------------------------------------------------------------------------- the module

class MultiHeadAttention(nn.Module):
    r"""MultiHead(Q, K, V) = Concat(head_1, ..., head_H) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Args:
        d_model: model width E.
        num_heads: query heads H; head_dim = E / H unless ``head_dim`` is given.
        dropout: dropout on the attention weights (training only).
        num_kv_heads: key/value heads G (H % G == 0); G = H is classic multi-head,
            G = 1 multi-query, anything between grouped-query attention.
        bias: biases on the Q/K/V projections; ``out_bias`` on the output projection
            (defaults to ``bias``).
        fused_qkv: one (E -> (H + 2G) D) projection for Q, K and V. For cross-attention the
            query uses the Q rows and the memory the K/V rows, never the other way round.
        kdim, vdim: widths of key and value inputs when they differ from E (cross-attention).
        position: an :class:`~attnlab.nn.position.AttentionPosition` (RoPE rotates q/k;
            ALiBi and the T5 bias add a score bias), or None.
        causal: this is a causal self-attention (decoder); the mask is built from positions.
        scale: the factor on q k^T (default 1 / sqrt(head_dim)); DeBERTa uses 1 / sqrt(3 D), as its
            two position terms join the content term; T5 uses 1.0, its initialisation having folded
            the 1 / sqrt(D) into the query projection; a model may tie it to another width.
        q_norm, k_norm: modules applied to the queries (B, H, T, D) and the new keys (B, G, T, D)
            after the projection, before the position module and the cache (QK-norm: RMSNorm over
            each head's D channels, or :class:`~attnlab.nn.norm.JointHeadsRMSNorm` over all heads).
        softcap: scores soft-capped to (-softcap, softcap) (see :func:`scaled_dot_product_attention`).
        window: local attention: a query at position p attends keys at positions p - window + 1
            to p only (a sliding window, Beltagy et al. 2020, counted in true positions, so left
            padding does not shift it). chunk: a query attends keys of its own chunk of ``chunk``
            positions only (p // chunk equal). Both on top of the causal triangle.

    ``forward(query, key, value, mask=None, ...)`` takes (B, T, E) / (B, S, kdim) / (B, S, vdim)
    and returns ``(output (B, T, E), weights (B, H, T, S) or None)``. While
    ``attention_record`` is set (by ``attnlab.viz.record_attention``), each call also hands it
    its weights, where its queries start and which keys they were allowed (the output is
    computed as without it).
    """

    returns_new_tensor = True           # forward's output (attnlab.nn.inplace)

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, *,
                 num_kv_heads: int | None = None, head_dim: int | None = None,
                 bias: bool = True, out_bias: bool | None = None, fused_qkv: bool = False,
                 kdim: int | None = None, vdim: int | None = None,
                 position: nn.Module | None = None, causal: bool = False, scale: float | None = None,
                 q_norm: nn.Module | None = None, k_norm: nn.Module | None = None, softcap: float | None = None,
                 window: int | None = None, chunk: int | None = None):
        super().__init__()
        if num_heads <= 0 or d_model <= 0:
            raise ValueError(f"MultiHeadAttention: d_model ({d_model}) and num_heads ({num_heads}) must be positive")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"MultiHeadAttention: d_model ({d_model}) is not divisible by num_heads ({num_heads})")
            head_dim = d_model // num_heads
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"MultiHeadAttention: num_heads ({num_heads}) is not a multiple of num_kv_heads ({num_kv_heads})")
        kdim, vdim = kdim or d_model, vdim or d_model
        if fused_qkv and not (kdim == vdim == d_model):
            raise ValueError("MultiHeadAttention: fused_qkv needs kdim == vdim == d_model")
        self.d_model, self.num_heads, self.num_kv_heads, self.head_dim = d_model, num_heads, num_kv_heads, head_dim
        self.dropout, self.causal, self.position, self.scale = dropout, causal, position, scale
        for name, value in (("softcap", softcap), ("window", window), ("chunk", chunk)):
            if value is not None and not value > 0:
                raise ValueError(f"MultiHeadAttention: {name} must be None or positive, got {value}")
        self.q_norm, self.k_norm = q_norm, k_norm
        self.softcap, self.window, self.chunk = softcap, window, chunk
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.qkv_proj = nn.Linear(d_model, q_out + 2 * kv_out, bias=bias)
        else:
            self.q_proj = nn.Linear(d_model, q_out, bias=bias)
            self.k_proj = nn.Linear(kdim, kv_out, bias=bias)
            self.v_proj = nn.Linear(vdim, kv_out, bias=bias)
        self.out_proj = nn.Linear(q_out, d_model, bias=bias if out_bias is None else out_bias)
        # None, or what attnlab.viz.record_attention sets: a callable that every forward hands
        # (weights (B, H, T, S) detached, the first query's index in its sequence or None for
        # "right after this module's previous call", the boolean mask of allowed keys); the
        # only cost when not recording is one check
        self.attention_record = None

    @property
    def fused_qkv(self) -> bool:
        return hasattr(self, "qkv_proj")

    def stack_projections(self) -> None:
        """Let self-attention compute q, k and v in one product from then on (the parameters become
        views of one stacked weight, :class:`~attnlab.nn.linear.StackedLinear`; the state dict does
        not change). :func:`~attnlab.nn.optimize_for_inference` calls it; idempotent."""
        if self.fused_qkv:
            return
        layers, stacked = (self.q_proj, self.k_proj, self.v_proj), self.__dict__.get("_stacked_qkv")
        if stacked is not None and stacked.layers == layers and stacked.intact():
            return
        try:
            self.__dict__["_stacked_qkv"] = StackedLinear(layers)
        except (TypeError, ValueError):         # not plain Linear layers of one input width: keep three products
            self.__dict__.pop("_stacked_qkv", None)

    def _stacked(self, x: Tensor) -> list[Tensor] | None:
        """q, k, v of self-attention from the stacked product, or None where it cannot stand in."""
        stacked = self.__dict__.get("_stacked_qkv")
        if stacked is None or self.fused_qkv or not stacked.usable(x, self.q_proj, self.k_proj, self.v_proj):
            return None
        return stacked.stack(x)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        B, L, _ = x.shape                                   # (B, L, heads*D) -> (B, heads, L, D)
        return x.view(B, L, heads, self.head_dim).transpose(1, 2)

    def project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Key/value projections split into heads: two (B, G, S, D) tensors."""
        if self.fused_qkv:
            q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            if key is value:
                kv = F.linear(key, w[q_out:], None if b is None else b[q_out:])
                k, v = kv.split(kv_out, dim=-1)
            else:
                k = F.linear(key, w[q_out:q_out + kv_out], None if b is None else b[q_out:q_out + kv_out])
                v = F.linear(value, w[q_out + kv_out:], None if b is None else b[q_out + kv_out:])
        else:
            k, v = self.k_proj(key), self.v_proj(value)
        return self._split(k, self.num_kv_heads), self._split(v, self.num_kv_heads)

    def _project(self, query, key, value, cache):
        """Q, K, V in heads; K/V come from the cache when it holds precomputed memory."""
        if cache is not None and cache.static and cache.length > 0:
            q = self._split(self._q(query), self.num_heads)
            return q, None, None
        if key is query and value is query:                                  # self-attention
            if self.fused_qkv:
                q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                q, k, v = self.qkv_proj(query).split([q_out, kv_out, kv_out], dim=-1)
            else:
                q, k, v = self._stacked(query) or (None, None, None)
            if q is not None:
                return (self._split(q, self.num_heads), self._split(k, self.num_kv_heads),
                        self._split(v, self.num_kv_heads))
        k, v = self.project_kv(key, value)
        return self._split(self._q(query), self.num_heads), k, v

    def _q(self, query: Tensor) -> Tensor:
        if self.fused_qkv:
            q_out = self.num_heads * self.head_dim
            b = self.qkv_proj.bias
            return F.linear(query, self.qkv_proj.weight[:q_out], None if b is None else b[:q_out])
        return self.q_proj(query)

    def _project_packed(self, x: Tensor, packing: Packing) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's Q, K, V in heads from packed rows x (N, E): projected on the N real
        tokens, then scattered to the (B, T) layout (zeros at padding, which the key mask hides)."""
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        stacked = None if self.fused_qkv else self._stacked(x)
        if self.fused_qkv:
            q, k, v = packing.unpack(self.qkv_proj(x)).split([q_out, kv_out, kv_out], dim=-1)
        elif stacked is not None:
            q, k, v = (packing.unpack(t) for t in stacked)
        else:
            q, k, v = (packing.unpack(proj(x)) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self._split(q, self.num_heads), self._split(k, self.num_kv_heads), self._split(v, self.num_kv_heads)

    def _check_packed(self, query, key, value, cache, packing, key_padding_mask) -> None:
        if not isinstance(packing, Packing):
            raise ValueError(f"MultiHeadAttention: packing must be an attnlab.nn.Packing, got {type(packing).__name__}")
        if key is not None or value is not None or cache is not None:
            raise ValueError("MultiHeadAttention: packing is for self-attention without a cache "
                             "(key, value and cache must be None)")
        if query.dim() != 2 or query.shape != (packing.count, self.d_model):
            raise ValueError(f"MultiHeadAttention: packed query must be (real tokens, d_model) = "
                             f"{(packing.count, self.d_model)}, got {tuple(query.shape)}")
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise ValueError("MultiHeadAttention: key_padding_mask must be a (B, S) bool tensor, True for real tokens")

    def _check(self, query, key, value, key_padding_mask):
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError("MultiHeadAttention: query, key and value must be batch-first (B, L, E), got "
                             f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
        if query.size(-1) != self.d_model:
            raise ValueError(f"MultiHeadAttention: query has width {query.size(-1)}, expected d_model={self.d_model}")
        if key.size(0) != query.size(0) or value.size(0) != query.size(0) or key.size(1) != value.size(1):
            raise ValueError("MultiHeadAttention: batch or length mismatch between query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)}")
        if key.dtype != query.dtype or value.dtype != query.dtype:
            raise ValueError(f"MultiHeadAttention: dtypes differ: query {query.dtype}, key {key.dtype}, value {value.dtype}")
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            raise ValueError("MultiHeadAttention: key_padding_mask must be a (B, S) bool tensor, True for real tokens")

    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None,
                mask: Tensor | None = None, *, key_padding_mask: Tensor | None = None,
                is_causal: bool | None = None, return_weights: bool = False,
                cache: KVCache | None = None, positions: Tensor | None = None,
                key_positions: Tensor | None = None, packing: Packing | None = None) -> tuple[Tensor, Tensor | None]:
        """Attend ``query`` (B, T, E) to ``key``/``value`` (B, S, ·); self-attention if they are None.

        mask: broadcastable to (B, H, T, S), boolean True = attend or float additive.
        key_padding_mask: (B, S) boolean, True for real keys (with a cache: S covers the
            cached keys too).
        is_causal: causal self-attention (defaults to the module's ``causal``); with a cache the
            triangle is aligned to absolute positions.
        cache: a :class:`KVCache`. A dynamic cache appends this step's keys/values; a static
            cache (cross-attention) projects the memory once and reuses it.
        positions: (T,) or (B, T) positions of the queries for the position module
            (default: cache length + arange(T)).
        key_positions: (S,) or (B, S) positions of all keys, cached and new (default:
            arange(S)). A left-padded batch passes both counted over real tokens, so that
            relative schemes (ALiBi, T5) see true distances.
        packing: a :class:`~attnlab.nn.packing.Packing` of a padded (B, T) batch: ``query`` holds
            its N real tokens, (N, E), and so does the output, (N, E). Self-attention only (no
            key, value or cache); the key mask defaults to the packing's. The projections run on
            the N rows alone; attention itself on the (B, T) layout.
        """
        if packing is not None:
            self._check_packed(query, key, value, cache, packing, key_padding_mask)
            (B, T), offset = packing.shape, 0
            key_padding_mask = packing.mask if key_padding_mask is None else key_padding_mask
            q, k, v = self._project_packed(query, packing)
        else:
            key = query if key is None else key
            value = key if value is None else value
            self._check(query, key, value, key_padding_mask)
            B, T, _ = query.shape
            offset = 0 if cache is None or cache.static else cache.length
            q, k, v = self._project(query, key, value, cache)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None and k is not None:
            k = self.k_norm(k)
        is_causal = self.causal if is_causal is None else is_causal
        S = cache.length if k is None else offset + k.size(-2)
        local = (self.window is not None and S > self.window) or (self.chunk is not None and S > self.chunk)
        selects = k is not None and getattr(cache, "selects", False)     # a cache kind of attnlab.nn.kv_cache
        if self.position is not None or local or selects:
            positions, key_positions = self._positions(positions, key_positions, B, T, S, offset, query.device)
        if local:
            mask = combine_masks(mask, self._local_mask(positions, key_positions))
        reused = k is None                      # a static cache's memory (cross-attention after its first step)
        if selects:                             # the cache kind decides which keys stay, at which positions
            q, k, v, positions, key_positions, key_padding_mask, mask = cache.attend(
                self, q, k, v, positions, key_positions, key_padding_mask, mask)
            S = k.size(-2)
        else:
            if self.position is not None and k is not None:    # the new keys' positions are the last ones
                q, k = self.position.transform(q, k, positions, key_positions[..., S - k.size(-2):])
            if cache is not None:
                k, v = cache.update(k, v)

        bias = None if self.position is None else self.position.bias(q, k, positions, key_positions)
        kpm = None
        if key_padding_mask is not None:
            if key_padding_mask.shape != (B, S):
                raise ValueError(f"MultiHeadAttention: key_padding_mask has shape {tuple(key_padding_mask.shape)}, "
                                 f"expected (batch, keys) = {(B, S)}")
            kpm = key_padding_mask[:, None, None, :]
        full = combine_masks(mask, kpm, bias, dtype=None if bias is None else q.dtype)
        dropout_p = self.dropout if self.training else 0.0
        # one query attending a cache needs no causal mask: every cached key is in its past
        causal = is_causal and T > 1
        out, weights = scaled_dot_product_attention(q, k, v, full, dropout_p, causal, return_weights, self.scale,
                                                    self.softcap)
        if self.attention_record is not None and not recomputing():
            # a static cache counts no queries, so its later steps cannot say where theirs sit
            self.attention_record(self._recorded(q, k, v, full, causal, weights, self.scale, self.softcap),
                                  None if reused else offset, self._allowed(mask, kpm, causal, T, S, q.device))
        out = out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        if packing is not None:
            out = packing.pack(out)
        return self.out_proj(out), weights

    @staticmethod
    def _recorded(q, k, v, mask, causal, weights, scale=None, softcap=None) -> Tensor:
        """Weights for ``attention_record``: detached, and computed apart from the output without
        autograd, so that recording changes neither the output nor what backward (or a
        checkpoint's recomputation) saves."""
        if weights is not None:
            return weights.detach()
        with torch.no_grad():
            return scaled_dot_product_attention(q, k, v, mask, 0.0, causal, return_weights=True, scale=scale,
                                                softcap=softcap)[1]

    def _local_mask(self, positions: Tensor, key_positions: Tensor) -> Tensor:
        """Boolean (T, S) or (B, 1, T, S), True where a key is inside the query's window and chunk
        (keys ahead of the query are the causal mask's business)."""
        q_pos, k_pos = positions[..., :, None], key_positions[..., None, :]
        allowed = None
        if self.window is not None:
            allowed = q_pos - k_pos < self.window
        if self.chunk is not None:
            same = torch.div(q_pos, self.chunk, rounding_mode="floor") == torch.div(k_pos, self.chunk,
                                                                                     rounding_mode="floor")
            allowed = same if allowed is None else allowed & same
        return allowed[:, None] if allowed.dim() == 3 else allowed

    @staticmethod
    def _allowed(mask, kpm, causal, T, S, device) -> Tensor:
        """Boolean (B or 1, H or 1, T, S), True where a query may attend a key: the given mask (a
        float one allows above -inf, as the attention function reads it), the key padding and
        the causal triangle. Position biases shift scores without masking, so they are not in it."""
        allowed = torch.ones(1, 1, T, S, dtype=torch.bool, device=device)
        if mask is not None:
            allowed = allowed & (mask if mask.dtype == torch.bool else mask > float("-inf"))
        if kpm is not None:
            allowed = allowed & kpm
        if causal:
            allowed = allowed & causal_mask(T, S, device=device)
        return allowed

    @staticmethod
    def _positions(positions, key_positions, B, T, S, offset, device) -> tuple[Tensor, Tensor]:
        """Query positions (T,) / (B, T) and key positions (S,) / (B, S), defaults filled in."""
        if positions is None and key_positions is None and S - T == offset:
            key_positions = torch.arange(S, device=device)
            positions = key_positions[offset:]          # one tensor: RoPE sees the new keys at the queries' places
        if positions is None:
            positions = torch.arange(offset, offset + T, device=device)
        if key_positions is None:
            key_positions = torch.arange(S, device=device)
        for name, pos, L in (("positions", positions, T), ("key_positions", key_positions, S)):
            if pos.shape not in ((L,), (B, L)) or pos.is_floating_point():
                raise ValueError(f"MultiHeadAttention: {name} must be integer ({L},) or {(B, L)}, "
                                 f"got {pos.dtype} {tuple(pos.shape)}")
        return positions, key_positions
