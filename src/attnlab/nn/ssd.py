"""Mamba-2's state-space duality (Dao & Gu 2024, "Transformers are SSMs: Generalized Models and
Efficient Algorithms Through Structured State Space Duality", sections 3-6), written twice on purpose.

Glossary of shapes (batch first, as everywhere in attnlab)::

    b  batch            l  sequence length      h  heads         p  channels per head (head_dim)
    g  groups of heads sharing B and C (h / g heads each, in blocks: head i reads group i // (h / g))
    n  state size per channel (d_state)         q  chunk length of the fast path

    x     (b, l, h, p)   the input sequence, per head
    dt    (b, l, h)      the input-dependent step Δ (already through softplus: >= 0), one per head
    A     (h,)           the continuous transition, one negative scalar per head (A = -exp(A_log))
    B, C  (b, l, g, n)   the input-dependent input and readout vectors
    D     (h,)           the skip connection
    h     (b, h, p, n)   the state

The recurrence, for each position t: Mamba-1's, with the decay a scalar per head rather than a
(d, n) matrix, which is what makes the second form below possible::

    a_t = exp(Δ_t A)                      (b, h)        how much of the state survives the step
    h_t = a_t h_{t-1} + Δ_t x_t B_tᵀ                    (b, h, p, n)
    y_t = h_t C_t + D x_t                               (b, h, p)

Unrolled, y_t = Σ_{s<=t} (C_t · B_s) exp(Σ_{s<r<=t} Δ_r A) Δ_s x_s + D x_t: the same map is a
masked matrix product, y = (L ∘ C Bᵀ) (Δ x), with L[t, s] = exp(A Σ_{s<r<=t} Δ_r) below the
diagonal and 0 above it: attention with the softmax replaced by a causal decay mask (the duality).

:func:`ssd_reference` is the recurrence, l steps. :func:`ssd_scan` is the chunked algorithm
(section 6): cut the sequence into chunks of q positions; *within* a chunk use the matrix form
(a (q, q) masked C Bᵀ per chunk and group, all chunks at once); each chunk's own end state is one
more matrix product (Σ_s decay-to-end_s Δ_s x_s B_sᵀ); a short recurrence over the l / q chunk
states gives the state entering each chunk, and its contribution to the chunk's outputs is
C_t h_in exp(decay since the chunk start). Cost per position and head: about q (n + p) for the
masked product and 2 p n for the states, instead of p n sequential steps; l / q Python steps.
Gradients come from autograd through that chunked form: what it keeps for the backward is the
(q, q) masks (b·l·q·h numbers) and one state per chunk (b·(l/q)·h·p·n), not the b·l·h·p·n that
autograd through the recurrence keeps. The state and all arithmetic are fp32 whatever the input
dtype: the decay multiplies the state thousands of times and bf16 would lose it.
:func:`ssd_step` is one position, for generation.

A slot with Δ = 0 changes nothing: a = exp(0) = 1 keeps the state and Δ x Bᵀ = 0 adds nothing,
which is how a model carries its state unchanged over padding, and how the fast path pads a
length the chunk does not divide.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ssd_reference", "ssd_scan", "ssd_step", "ssd_matrix"]


def _heads(t: Tensor, h: int) -> Tensor:
    """(..., g, n) -> (..., h, n): each group's vector for its h / g heads, in blocks (head i reads
    group i // (h / g), repeat_interleave; repeating the groups cyclically would pair heads wrongly)."""
    return t.repeat_interleave(h // t.shape[-2], dim=-2)


def ssd_reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                  h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The recurrence of the module docstring, one position at a time -> (y (b, l, h, p), h_l (b, h, p, n))."""
    b, l, nh, p = x.shape
    B, C = _heads(B, nh), _heads(C, nh)                                   # (b, l, h, n)
    state = x.new_zeros(b, nh, p, B.shape[-1]) if h0 is None else h0
    ys = []
    for t in range(l):
        a = torch.exp(dt[:, t] * A)[:, :, None, None]                     # (b, h, 1, 1)
        state = a * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append((state * C[:, t, :, None, :]).sum(-1))                  # (b, h, p)
    y = torch.stack(ys, dim=1)
    return (y if D is None else y + x * D[:, None]), state


def ssd_step(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             D: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One position: state (b, h, p, n) fp32, x (b, h, p), dt (b, h), B and C (b, g, n) -> (y (b, h, p), new state)."""
    nh = x.shape[1]
    with torch.autocast(x.device.type, enabled=False):          # the state stays fp32 under autocast too
        a = torch.exp(dt.float() * A.float())[:, :, None, None]
        state = a * state + (dt.float()[..., None] * x.float())[..., None] * _heads(B.float(), nh)[:, :, None, :]
        y = (state @ _heads(C.float(), nh)[..., None]).squeeze(-1).to(x.dtype)
    return (y if D is None else y + x * D[:, None]), state


def _check(x, dt, A, B, C, h0) -> None:
    b, l, nh, p = x.shape if x.dim() == 4 else (None,) * 4
    ok = x.dim() == 4 and dt.shape == (b, l, nh) and A.shape == (nh,) and B.dim() == 4 and C.shape == B.shape \
        and B.shape[:2] == (b, l) and nh % B.shape[2] == 0
    if ok and h0 is not None:
        ok = h0.shape == (b, nh, p, B.shape[3])
    if not ok:
        raise ValueError(f"ssd_scan: shapes x {tuple(x.shape)}, dt {tuple(dt.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)}"
                         + ("" if h0 is None else f", h0 {tuple(h0.shape)}")
                         + " do not match (b, l, h, p), (b, l, h), (h,), (b, l, g, n) with g dividing h, (b, h, p, n)")


def _segment_sums(a: Tensor) -> Tensor:
    """(..., q) log-decays -> (..., q, q): [t, s] = Σ_{s<r<=t} a_r for s <= t, -inf above the
    diagonal. Summed over the masked entries rather than as cumsum[t] - cumsum[s], which would
    cancel two large numbers and lose the small decays between them."""
    q = a.shape[-1]
    below = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., :, None].expand(*a.shape, q).masked_fill(~below, 0.0).cumsum(-2)
    return sums.masked_fill(~torch.ones_like(below).tril(), -math.inf)


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
             h0: Tensor | None = None, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The chunked algorithm (module docstring): equal to :func:`ssd_reference`, gradients
    included -> (y (b, l, h, p) in x's dtype, h_l (b, h, p, n) fp32). ``h0``: the state before the
    first position (zeros by default). ``chunk``: q, by default 64 (or l when shorter): the
    q (n + p) of the masked products against the 2 p n of the states would balance at q near
    sqrt(p n), but the (q, q) masks are memory-bound elementwise work, and on a CPU 32 to 64 ran
    fastest for p = 64, n = 64 or 128, forward and backward (benchmarks/ssm.py). Any length: the
    last chunk is padded with Δ = 0, which changes nothing."""
    _check(x, dt, A, B, C, h0)
    if chunk is None:
        chunk = max(1, min(64, x.size(1)))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"ssd_scan: chunk must be a positive int, got {chunk!r}")
    with torch.autocast(x.device.type, enabled=False):          # bf16 matmuls would round the state
        return _ssd_chunked(x, dt, A, B, C, D, h0, chunk)


def _ssd_chunked(x, dt, A, B, C, D, h0, chunk):
    b, l, nh, p = x.shape
    g, n = B.shape[2:]
    q, pad = chunk, -l % chunk
    c, hg = (l + pad) // q, nh // g
    dt32 = dt.float()
    xd = x.float() * dt32[..., None]                                      # Δ x (b, l, h, p)
    a = dt32 * A.float()                                                  # log-decay Δ A (b, l, h)
    xd, a, Bf, Cf = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (xd, a, B.float(), C.float()))
    xd = xd.view(b, c, q, g, hg, p).permute(0, 1, 3, 4, 2, 5)            # (b, c, g, hg, q, p)
    a = a.view(b, c, q, g, hg).permute(0, 1, 3, 4, 2)                    # (b, c, g, hg, q)
    Bf, Cf = (t.view(b, c, q, g, n).transpose(2, 3) for t in (Bf, Cf))  # (b, c, g, q, n)
    cum = a.cumsum(-1)                                                    # decay from the chunk start
    # within each chunk: the masked matrix (L ∘ C Bᵀ) times Δ x, C Bᵀ once per group
    scores = (Cf @ Bf.transpose(-1, -2))[:, :, :, None]                   # (b, c, g, 1, q, q)
    y = (scores * torch.exp(_segment_sums(a))) @ xd                       # (b, c, g, hg, q, p)
    # each chunk's own end state from a zero state: Σ_s exp(decay s -> end) Δ_s x_s B_sᵀ
    to_end = torch.exp(F.pad(a.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1)))   # Σ_{r>s} a_r, (b, c, g, hg, q)
    own = ((xd * to_end[..., None]).transpose(-1, -2).reshape(b, c, g, hg * p, q) @ Bf).view(b, c, g, hg, p, n)
    # across chunks: the state entering each, a recurrence of l / q steps
    total = torch.exp(cum[..., -1])[..., None, None]                      # (b, c, g, hg, 1, 1)
    state = x.new_zeros(b, g, hg, p, n, dtype=torch.float32) if h0 is None else h0.float().view(b, g, hg, p, n)
    starts = []
    for total_k, own_k in zip(total.unbind(1), own.unbind(1)):        # unbind: indexing [:, k] in the loop
        starts.append(state)                                              # would make the backward O(c²)
        state = total_k * state + own_k
    starts = torch.stack(starts, dim=1)                                   # (b, c, g, hg, p, n)
    # the entering state read out at each position, decayed from the chunk start
    read = Cf @ starts.permute(0, 1, 2, 5, 3, 4).reshape(b, c, g, n, hg * p)   # (b, c, g, q, hg p)
    y = y + read.view(b, c, g, q, hg, p).transpose(3, 4) * torch.exp(cum)[..., None]
    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, c * q, nh, p)[:, :l].to(x.dtype)
    return (y if D is None else y + x * D[:, None]), state.view(b, nh, p, n)


def ssd_matrix(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> Tensor:
    """The (b, h, T, T) fp32 matrix of the scan ssd_scan(x, dt, A, B, C, D) from a zero state, per head
    (Mamba-2's duality, Dao & Gu 2024, section 3): y = M x + D x, with

        M[t, s] = (C_t · B_s) exp(Σ_{s<r<=t} Δ_r A) Δ_s     for s <= t, 0 above the diagonal."""
    nh = x.size(2)
    dt = dt.float()
    Bh, Ch = _heads(B.float(), nh), _heads(C.float(), nh)                  # (b, T, h, n)
    scores = torch.einsum("bthn,bshn->bhts", Ch, Bh)
    decay = torch.exp(_segment_sums((dt * A.float()).transpose(1, 2)))     # (b, h, T, T), 0 above the diagonal
    return scores * decay * dt.transpose(1, 2)[:, :, None, :]
