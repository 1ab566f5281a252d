"""The selective scan of Mamba (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with
Selective State Spaces", sections 3.2-3.3), written twice on purpose.

Glossary of shapes (batch first, as everywhere in attnlab)::

    b  batch            l  sequence length      d  channels (Mamba's d_inner)
    n  state size per channel (d_state)         q  chunk length of the fast path

    x     (b, l, d)   the input sequence
    delta (b, l, d)   the input-dependent step Δ (already through softplus: > 0)
    A     (d, n)      the continuous transition, negative (A = -exp(A_log))
    B, C  (b, l, n)   the input-dependent input and readout vectors
    D     (d,)        the skip connection
    h     (b, d, n)   the state

The equations, for each position t (zero-order hold for A, Euler for B, as the paper does)::

    A_bar_t = exp(Δ_t A)                  (b, d, n)   how much of the state survives the step
    B_bar_t x_t = Δ_t B_t x_t             (b, d, n)   what the step writes into it
    h_t = A_bar_t * h_{t-1} + B_bar_t x_t
    y_t = C_t h_t + D x_t                 (b, d)

:func:`selective_scan_reference` is that loop. :func:`selective_scan` is the default fast path:
the sequence is cut into chunks of q positions; a pass over the q positions of *every chunk at
once* gives each chunk's own end state and its total decay, a short recurrence over the l / q
chunks gives the state entering each chunk, and a second pass over the q positions from those
states gives the outputs. That is 2q + l/q steps of work on (b, l/q, d, n) tensors instead of l
steps on (b, d, n) ones. Its backward is written by hand: it keeps only the inputs and the
states entering the chunks (l·d·n / q numbers per row rather than the l·d·n that autograd through
the loop would keep) and recomputes the states inside the chunks, a few chunks at a time, as it
runs the adjoint recurrence backwards. The state and all arithmetic are fp32 whatever the input
dtype: the decay exp(Δ A) multiplies the state thousands of times, and bf16's 8 bits of
mantissa would lose it. :func:`selective_step` is one position, for generation.

A slot with Δ = 0 changes nothing: exp(0 · A) = 1 keeps the state and Δ B x = 0 adds nothing,
which is how a model carries its state unchanged over padding.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["selective_scan_reference", "selective_scan", "selective_step"]


def selective_scan_reference(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                             h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The recurrence of the module docstring, one position at a time -> (y (b, l, d), h_l (b, d, n))."""
    b, l, d = x.shape
    h = x.new_zeros(b, d, A.size(1)) if h0 is None else h0
    ys = []
    for t in range(l):
        A_bar = torch.exp(delta[:, t, :, None] * A)                    # (b, d, n)
        B_bar_x = delta[:, t, :, None] * B[:, t, None, :] * x[:, t, :, None]
        h = A_bar * h + B_bar_x
        ys.append((h * C[:, t, None, :]).sum(-1))                       # (b, d)
    y = torch.stack(ys, dim=1)
    return (y if D is None else y + x * D), h


def selective_step(h: Tensor, x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
                   D: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One position: state h (b, d, n) fp32, x and delta (b, d), B and C (b, n) -> (y (b, d), new h)."""
    with torch.autocast(x.device.type, enabled=False):          # the state stays fp32 under autocast too
        h = torch.exp(delta.float()[..., None] * A.float()) * h + (delta * x).float()[..., None] * B.float()[:, None]
        y = (h @ C.float()[..., None]).squeeze(-1).to(x.dtype)
    return (y if D is None else y + x * D), h


def selective_scan(x: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None,
                   h0: Tensor | None = None, chunk: int | None = None) -> tuple[Tensor, Tensor]:
    """The chunked fast path (module docstring): equal to :func:`selective_scan_reference`,
    gradients included -> (y (b, l, d) in x's dtype, h_l (b, d, n) fp32). ``h0`` (b, d, n): the
    state before the first position (zeros by default). ``chunk``: q, by default about sqrt(2 l)
    (which makes the 2q + l/q steps fewest), at most 64. Any length: the last chunk is padded
    with Δ = 0, which changes nothing."""
    b, l, d = x.shape
    if chunk is None:
        chunk = min(64, max(1, round(math.sqrt(2 * l))))
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"selective_scan: chunk must be a positive int, got {chunk!r}")
    if delta.shape != x.shape or A.shape[0] != d or B.shape != (b, l, A.shape[1]) or C.shape != B.shape:
        raise ValueError(f"selective_scan: shapes x {tuple(x.shape)}, delta {tuple(delta.shape)}, A {tuple(A.shape)}, "
                         f"B {tuple(B.shape)}, C {tuple(C.shape)} do not match (b, l, d), (d, n), (b, l, n)")
    h0 = x.new_zeros(b, d, A.shape[1], dtype=torch.float32) if h0 is None else h0.float()
    with torch.autocast(x.device.type, enabled=False):          # bf16 matmuls would round the state
        y, h = _ChunkedScan.apply(x, delta, A, B, C, h0, chunk)
    y = y.to(x.dtype)
    return (y if D is None else y + x * D), h


# ----------------------------------------------------------------------------- the chunked scan
# how many numbers of recomputed states the backward may hold beyond the chunk starts (32 MB in
# fp32): a constant, so the backward's memory still grows only with l·d·n / q, and fewer, larger
# groups of chunks take fewer Python steps
_RECOMPUTE_BUDGET = 1 << 23


def _chunked(t: Tensor, q: int) -> Tensor:
    """(b, l, k) fp32 -> (b, l/q, q, k), the length padded with zeros to a multiple of q."""
    b, l, k = t.shape
    pad = -l % q
    t = t.float()
    if pad:
        t = torch.cat([t, t.new_zeros(b, pad, k)], dim=1)
    return t.view(b, -1, q, k)


def _decay(delta: Tensor, A: Tensor, i: int) -> Tensor:
    """exp(Δ A) at position i of every chunk: (b, c, q, d), (d, n) -> (b, c, d, n)."""
    return torch.exp(delta[:, :, i, :, None] * A)


def _write(delta_x: Tensor, B: Tensor, i: int) -> Tensor:
    """Δ B x at position i of every chunk -> (b, c, d, n)."""
    return delta_x[:, :, i, :, None] * B[:, :, i, None, :]


class _ChunkedScan(torch.autograd.Function):
    """y = C h (without the D skip) and the last state; see the module docstring."""

    @staticmethod
    def forward(ctx, x, delta, A, B, C, h0, q):
        l = x.shape[1]
        A32 = A.float()
        xs, ds, Bs, Cs = (_chunked(t, q) for t in (x, delta, B, C))
        dx = ds * xs
        c = xs.shape[1]
        # each chunk's own end state (from a zero state) and its total decay exp(A sum Δ)
        end = xs.new_zeros(*xs.shape[:2], *A.shape)
        for i in range(q):
            end = _decay(ds, A32, i) * end + _write(dx, Bs, i)
        total = torch.exp(ds.sum(2)[..., None] * A32)
        starts, h = [], h0
        for k in range(c):
            starts.append(h)
            h = total[:, k] * h + end[:, k]
        starts = torch.stack(starts, dim=1)                                # (b, c, d, n)
        ys, s = [], starts
        for i in range(q):
            s = _decay(ds, A32, i) * s + _write(dx, Bs, i)
            ys.append((s @ Cs[:, :, i, :, None]).squeeze(-1))
        y = torch.stack(ys, dim=2).flatten(1, 2)[:, :l]
        ctx.save_for_backward(x, delta, A, B, C, starts, total)
        ctx.q = q
        return y, h

    @staticmethod
    def backward(ctx, dy, dh):
        x, delta, A, B, C, starts, total = ctx.saved_tensors
        q, (b, l, d), n = ctx.q, x.shape, A.shape[1]
        A32 = A.float()
        xs, ds, Bs, Cs = (_chunked(t, q) for t in (x, delta, B, C))
        gys = _chunked(dy, q)
        dx_in = ds * xs
        c = xs.shape[1]
        # the adjoint of each chunk's start state from its own readouts, all chunks at once
        r = xs.new_zeros(b, c, d, n)
        for i in reversed(range(q)):
            r = _decay(ds, A32, i) * (r + gys[:, :, i, :, None] * Cs[:, :, i, None, :])
        # gamma[k]: the adjoint of the state entering chunk k, everything after it included
        g = xs.new_zeros(b, d, n) if dh is None else dh.float()
        gamma = [None] * (c + 1)
        gamma[c] = g
        for k in reversed(range(c)):
            g = r[:, k] + total[:, k] * g
            gamma[k] = g
        after = torch.stack(gamma[1:], dim=1)                              # adjoint flowing in at each chunk's end
        grads = [torch.zeros_like(t) for t in (xs, ds, Bs, Cs)]
        dA = torch.zeros_like(A32)
        # the states inside the chunks, recomputed a group of chunks at a time: as many positions
        # at once as there are chunk starts, or more while they fit in _RECOMPUTE_BUDGET numbers
        group = max(math.ceil(c / q), _RECOMPUTE_BUDGET // (q * b * d * n), 1)
        for lo in range(0, c, group):
            hi = min(c, lo + group)
            dA += _backward_chunks(slice(lo, hi), starts, after, xs, ds, dx_in, Bs, Cs, gys, A32, grads)
        gx, gd, gB, gC = (t.flatten(1, 2)[:, :l] for t in grads)
        return (gx.to(x.dtype), gd.to(delta.dtype), dA.to(A.dtype), gB.to(B.dtype), gC.to(C.dtype), gamma[0], None)


def _backward_chunks(sl: slice, starts, after, xs, ds, dx_in, Bs, Cs, gys, A, grads) -> Tensor:
    """The adjoint recurrence over the positions of chunks ``sl``: fills their slices of the input
    gradients ``grads`` (x, Δ, B, C) and returns their share of A's gradient."""
    q = xs.shape[2]
    xs, ds, dx_in, Bs, Cs, gys = (t[:, sl] for t in (xs, ds, dx_in, Bs, Cs, gys))
    gx, gd, gB, gC = (t[:, sl] for t in grads)
    states = [starts[:, sl]]                                              # h before position i, i = 0..q
    for i in range(q):
        states.append(_decay(ds, A, i) * states[-1] + _write(dx_in, Bs, i))
    g, dA = after[:, sl].clone(), torch.zeros_like(A)
    for i in reversed(range(q)):
        g = g + gys[:, :, i, :, None] * Cs[:, :, i, None, :]               # dL/dh_i
        gC[:, :, i] = (gys[:, :, i, None, :] @ states[i + 1]).squeeze(-2)
        gB_in = (g @ Bs[:, :, i, :, None]).squeeze(-1)                     # sum_n g B: (b, c', d)
        gx[:, :, i] = gB_in * ds[:, :, i]
        gB[:, :, i] = (dx_in[:, :, i, None, :] @ g).squeeze(-2)
        a = _decay(ds, A, i)
        d_log_decay = g * a * states[i]                                    # dL/d(Δ A) (b, c', d, n)
        gd[:, :, i] = gB_in * xs[:, :, i] + (d_log_decay * A).sum(-1)
        dA += (d_log_decay * ds[:, :, i, :, None]).sum((0, 1))
        g = a * g
    return dA
