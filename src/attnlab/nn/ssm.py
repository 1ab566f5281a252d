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
the sequence is cut into chunks of q positions, taken a group of chunks at a time (as many as
fit in a fixed buffer, so the work memory does not grow with l). For a group, the decays
exp(Δ A) of all its positions are one tensor; a pass over the q positions of *every chunk of the
group at once* gives each chunk's own end state, a short recurrence over the chunks gives the
state entering each one, and a second pass from those states gives the states at every
position, read out by C in one batched product. That is 2q + l/q steps of work on tensors of
several chunks instead of l steps on (b, d, n) ones, in place. Its backward is written by hand:
it keeps only the inputs and the states entering the chunks (l·d·n / q numbers per row rather
than the l·d·n that autograd through the loop would keep), recomputes the states of a group,
runs the adjoint recurrence backwards through it, and forms the input gradients of all the
group's positions at once. The state and all arithmetic are fp32 whatever the input dtype (float64
stays float64): the decay exp(Δ A) multiplies the state thousands of times, and bf16's 8 bits of
mantissa would lose it. :func:`selective_step` is one position, for generation.

When one position's state is itself large (b·d·n of 16,384 numbers or more: a training batch,
32 rows of d = 256 and n = 4, already twice that), the same function runs the recurrence one position at a
time instead, on a state held as (b, n, d) and updated in place: its handful of tensors then
stays in the L2 cache, where the chunked path's buffers of many positions at once would stream
through memory at a fraction of the speed. Its backward keeps the same chunk starts and walks
each chunk backwards from its recomputed states.

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
    gradients included -> (y (b, l, d) in x's dtype, h_l (b, d, n) fp32, or float64 for float64
    inputs). ``h0`` (b, d, n): the
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
    h0 = x.new_zeros(b, d, A.shape[1], dtype=_work_dtype(x)) if h0 is None else h0.to(_work_dtype(x))
    with torch.autocast(x.device.type, enabled=False):          # bf16 matmuls would round the state
        y, h = _ChunkedScan.apply(x, delta, A, B, C, h0, chunk)
    y = y.to(x.dtype)
    return (y if D is None else y + x * D), h


# ----------------------------------------------------------------------------- the chunked scan
# how many fp32 numbers the per-position buffers of one group of chunks may hold (32 MB): a
# constant, so the memory of the scan beyond its inputs and chunk starts does not grow with the
# length, while groups of several chunks keep the Python steps few
_GROUP_BUDGET = 1 << 23


def _work_dtype(x: Tensor) -> torch.dtype:
    """fp32, or float64 for float64 inputs (which lets gradcheck test the hand-written backward)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunked(t: Tensor, q: int, dtype: torch.dtype) -> Tensor:
    """(b, l, k) -> (b, l/q, q, k) in ``dtype``, the length padded with zeros to a multiple of q."""
    b, l, k = t.shape
    pad = -l % q
    t = t.to(dtype)
    if pad:
        t = torch.cat([t, t.new_zeros(b, pad, k)], dim=1)
    return t.view(b, -1, q, k)


def _groups(c: int, q: int, per_chunk: int, buffers: int) -> tuple[list[slice], int]:
    """Slices of the c chunks, as many chunks each as ``buffers`` (q, ..., d, n) buffers allow,
    and that many chunks."""
    size = max(1, min(c, _GROUP_BUDGET // (buffers * q * per_chunk)))
    return [slice(lo, min(c, lo + size)) for lo in range(0, c, size)], size


def _by_position(sl: slice, *ts: Tensor) -> list[Tensor]:
    """Chunks ``sl`` of (b, c, q, k) tensors as (q, b, c', k) views: position i of every chunk is [i]."""
    return [t[:, sl].permute(2, 0, 1, 3) for t in ts]


def _buffer(size: int, like: Tensor):
    """A view-maker over one block of ``size`` fp32 numbers that every group of chunks reuses:
    allocating such a block anew for each group costs more than the arithmetic it holds."""
    def view(*shape: int) -> Tensor:
        return flat[:math.prod(shape)].view(shape)
    flat = like.new_empty(size)
    return view


def _decays(ds: Tensor, A: Tensor, out: Tensor) -> Tensor:
    """exp(Δ A) at every position of the chunks: ds (q, b, c', d) -> ``out`` (q, b, c', d, n),
    contiguous, so that each position's slice is one block of memory."""
    return torch.mul(ds[..., None], A, out=out).exp_()


class _ChunkedScan(torch.autograd.Function):
    """y = C h (without the D skip) and the last state; see the module docstring. Both passes
    work a group of chunks at a time, every position of the group at once where no recurrence
    links them (the decays, the readouts, the input gradients), and in place where one does."""

    @staticmethod
    def forward(ctx, x, delta, A, B, C, h0, q):
        (b, l, d), n = x.shape, A.shape[1]
        ctx.q = q
        if b * d * n >= _IN_ORDER_FROM:
            y, h, starts = _in_order_forward(x, delta, A, B, C, h0, q)
            ctx.save_for_backward(x, delta, A, B, C, starts)
            return y, h
        A32 = A.to(_work_dtype(x))
        xs, ds, Bs, Cs = (_chunked(t, q, A32.dtype) for t in (x, delta, B, C))
        dx = ds * xs
        c = xs.shape[1]
        total = torch.exp(ds.sum(2)[..., None] * A32)                    # each chunk's total decay
        starts, y, h = xs.new_empty(b, c, d, n), xs.new_empty(b, c, q, d), h0
        groups, size = _groups(c, q, b * d * n, 1)
        buffer = _buffer(q * b * size * d * n, A32)
        for sl in groups:
            dq, dxq, Bq, Cq = _by_position(sl, ds, dx, Bs, Cs)
            a = _decays(dq, A32, buffer(*dq.shape, n))
            end = a.new_zeros(a.shape[1:])                                 # each chunk's end from a zero state
            for i in range(q):
                end.mul_(a[i]).addcmul_(dxq[i, ..., None], Bq[i, :, :, None, :])
            for k in range(end.shape[1]):
                starts[:, sl.start + k] = h
                h = total[:, sl.start + k] * h + end[:, k]
            s = starts[:, sl]
            for i in range(q):                                             # a[i] becomes the state after position i
                s = a[i].mul_(s).addcmul_(dxq[i, ..., None], Bq[i, :, :, None, :])
            y[:, sl] = (a @ Cq[..., None]).squeeze(-1).permute(1, 2, 0, 3)
        ctx.save_for_backward(x, delta, A, B, C, starts)
        return y.flatten(1, 2)[:, :l], h

    @staticmethod
    def backward(ctx, dy, dh):
        x, delta, A, B, C, starts = ctx.saved_tensors
        q, (b, l, d), n = ctx.q, x.shape, A.shape[1]
        if b * d * n >= _IN_ORDER_FROM:
            return (*_in_order_backward(x, delta, A, B, C, starts, q, dy, dh), None)
        A32 = A.to(_work_dtype(x))
        xs, ds, Bs, Cs, gys = (_chunked(t, q, A32.dtype) for t in (x, delta, B, C, dy))
        total = torch.exp(ds.sum(2)[..., None] * A32)
        grads = [torch.empty_like(t) for t in (xs, ds, Bs, Cs)]
        dA = torch.zeros_like(A32)
        gamma = xs.new_zeros(b, d, n) if dh is None else dh.to(A32.dtype)       # adjoint of the state after the last chunk
        groups, size = _groups(xs.shape[1], q, b * d * n, 3)
        buffers = [_buffer((q + 1) * b * size * d * n, A32) for _ in range(3)]
        for sl in reversed(groups):
            gamma = _backward_group(sl, gamma, starts, total, (xs, ds, Bs, Cs, gys), A32, grads, dA, buffers)
        gx, gd, gB, gC = (t.flatten(1, 2)[:, :l] for t in grads)
        return (gx.to(x.dtype), gd.to(delta.dtype), dA.to(A.dtype), gB.to(B.dtype), gC.to(C.dtype), gamma, None)


def _backward_group(sl: slice, gamma, starts, total, ins, A, grads, dA, buffers) -> Tensor:
    """The adjoint over chunks ``sl`` given ``gamma``, the adjoint of the state leaving the group:
    fills their slices of ``grads`` (x, Δ, B, C), adds their share of A's gradient to ``dA`` and
    returns the adjoint of the state entering the group.

    With G_i = dL/dh_i inside a chunk: G_i = gy_i C_i + a_{i+1} G_{i+1}, and G at the chunk's end
    also receives what flows back from the later chunks. The chunks of the group run side by
    side, so that inflow is added afterwards (it decays back through the chunk as a_{i+1} ... a_q),
    once the short recurrence over the group's chunks has given it from each chunk's own part."""
    xq, dq, Bq, Cq, gq = _by_position(sl, *ins)
    q, shape = xq.shape[0], (*xq.shape[1:], A.shape[1])                  # shape: one position's (b, c', d, n)
    dxq = dq * xq
    a = _decays(dq, A, buffers[0](q, *shape))
    S = buffers[1](q + 1, *shape)                                          # S[i]: the state before position i
    S[0] = starts[:, sl]
    for i in range(q):
        torch.mul(a[i], S[i], out=S[i + 1]).addcmul_(dxq[i, ..., None], Bq[i, :, :, None, :])
    G = buffers[2](q, *shape)
    torch.mul(gq[-1, ..., None], Cq[-1, :, :, None, :], out=G[-1])
    for i in reversed(range(q - 1)):
        torch.mul(a[i + 1], G[i + 1], out=G[i]).addcmul_(gq[i, ..., None], Cq[i, :, :, None, :])
    own = a[0] * G[0]                                                      # each chunk's start adjoint from its own readouts
    inflow = torch.empty_like(own)
    for k in reversed(range(own.shape[1])):
        inflow[:, k] = gamma
        gamma = own[:, k] + total[:, sl.start + k] * gamma
    for i in reversed(range(q)):
        G[i].add_(inflow)
        inflow.mul_(a[i])
    gB_in = (G @ Bq[..., None]).squeeze(-1)                                # sum_n G B: (q, b, c', d)
    gx, gd, gB, gC = _by_position(sl, *grads)
    gx.copy_(gB_in * dq)
    gB.copy_((dxq[..., None, :] @ G).squeeze(-2))
    gC.copy_((gq[..., None, :] @ S[1:]).squeeze(-2))
    M = G.mul_(a).mul_(S[:-1])                                             # dL/d(Δ A) at every position
    d = M.shape[-2]
    dA += torch.mul(M.view(-1, *A.shape), dq.reshape(-1, d, 1), out=a.view(-1, *A.shape)).sum(0)
    gd.copy_(gB_in * xq + M.mul_(A).sum(-1))
    return gamma


# ----------------------------------------------------------------------------- the scan in order
# from how many numbers per state (b·d·n) the scan runs position by position: one position's
# state then fills a good part of the L2 cache, so the few operations on it run at cache speed,
# where the chunked path's buffers of many positions at once stream through memory. Measured
# (benchmarks/README.md, "Mamba's training step"): in order is 1.4x faster at 16,384 numbers,
# 1.6-2.1x from 32,768, level at 8,192, where the chunked path's fewer Python steps catch up
_IN_ORDER_FROM = 1 << 14


def _by_time(dtype: torch.dtype, *ts: Tensor) -> list[Tensor]:
    """(b, l, k) tensors as contiguous (l, b, 1, k) ones in ``dtype``: each position one block of
    memory. A tensor whose k is not contiguous (Mamba's convolution output, a (b, k, l) tensor
    seen transposed) is made contiguous first: one transposing copy from it reads k with a stride
    of l and costs several times the two copies (benchmarks/results/code.md)."""
    return [(t.to(dtype) if t.stride(-1) == 1 else t.to(dtype).contiguous()).transpose(0, 1).unsqueeze(2).contiguous()
            for t in ts]


def _by_batch(*ts: Tensor) -> list[Tensor]:
    """The inverse of :func:`_by_time`: (l, b, 1, k) -> contiguous (b, l, k). Gradients and outputs
    handed back as transposed views made every later operation on them a strided one (an add
    of two such gradients cost many times a contiguous one)."""
    return [t.squeeze(2).transpose(0, 1).contiguous() for t in ts]


def _in_order_forward(x, delta, A, B, C, h0, q) -> tuple[Tensor, Tensor, Tensor]:
    """The recurrence one position at a time on a state kept in place, its decay made in one
    reused buffer -> (y (b, l, d), the last state, the states
    entering each chunk of q, which are all that the backward keeps). The state is held as
    (b, n, d), d innermost: the products that broadcast Δ over n or B over d then run along rows
    of d numbers rather than n."""
    At = A.to(_work_dtype(x)).t()                                         # (n, d)
    xt, dt, Bt, Ct = _by_time(At.dtype, x, delta, B, C)                  # (l, b, 1, d) and (l, b, 1, n)
    dxt, l = dt * xt, xt.shape[0]
    Bt = Bt.transpose(2, 3)                                               # (l, b, n, 1)
    h = h0.transpose(1, 2).contiguous()                                   # (b, n, d)
    starts, y = At.new_empty(-(-l // q), *h.shape), torch.empty_like(xt)
    a = torch.empty_like(h)
    for t in range(l):
        if t % q == 0:
            starts[t // q] = h
        torch.mul(dt[t], At, out=a).exp_()
        h.mul_(a).addcmul_(dxt[t], Bt[t])
        torch.bmm(Ct[t], h, out=y[t])                                     # C_t h_t: (b, 1, d)
    return _by_batch(y)[0], h.transpose(1, 2), starts


def _in_order_backward(x, delta, A, B, C, starts, q, dy, dh) -> tuple[Tensor, ...]:
    """The adjoint of :func:`_in_order_forward` -> (dx, dΔ, dA, dB, dC, dh0); states and adjoints
    are (b, n, d) as there, the loop is :func:`_in_order_adjoint`."""
    At = A.to(_work_dtype(x)).t()
    ins = _by_time(At.dtype, x, delta, B, C, dy)
    xt, dt = ins[:2]
    G = torch.zeros_like(starts[0]) if dh is None else dh.to(At.dtype).transpose(1, 2).contiguous()
    dA = torch.zeros_like(G)
    gBx, gMA, gB, gC = torch.empty_like(xt), torch.empty_like(xt), torch.empty_like(ins[2]), torch.empty_like(ins[3])
    _in_order_adjoint(ins, At, starts, q, G, dA, (gBx, gMA, gB, gC))
    gx, gd, gB, gC = _by_batch(gBx * dt, gBx * xt + gMA, gB, gC)
    return (gx.to(x.dtype), gd.to(delta.dtype), dA.sum(0).t().to(A.dtype), gB.to(B.dtype), gC.to(C.dtype),
            G.transpose(1, 2))


def _in_order_adjoint(ins, At, starts, q, G, dA, grads) -> None:
    """The adjoint, chunk by chunk from the last: the chunk's states and decays (kept for the walk
    back) recomputed from its start, then G = dL/dh_t backwards through it (G_t = gy_t C_t + a_{t+1}
    G_{t+1}), each position's input gradients formed as soon as its G is known. ``G`` enters as
    the adjoint of the last state and leaves as that of the first; ``dA`` gathers Δ dL/d(Δ A)
    per row; ``grads`` (l, b, 1, k) receive sum_n B G (= dL/d(Δ x)), sum_n A dL/d(Δ A), dB, dC."""
    (xt, dt, Bt, Ct, gyt), (gBx, gMA, gB, gC) = ins, grads
    dxt, l = dt * xt, xt.shape[0]
    Bc, Cc = Bt.transpose(2, 3), Ct.transpose(2, 3)                      # (l, b, n, 1)
    S = At.new_empty(q + 1, *G.shape)                                     # S[j]: the state before position j
    E = At.new_empty(q, *G.shape)                                         # E[j]: position j's decay exp(Δ A)
    M = torch.empty_like(G)
    for k in reversed(range(starts.shape[0])):
        ts = range(k * q, min(l, (k + 1) * q))
        S[0] = starts[k]
        for j, t in enumerate(ts):
            torch.mul(dt[t], At, out=E[j]).exp_()
            torch.mul(E[j], S[j], out=S[j + 1]).addcmul_(dxt[t], Bc[t])
        for j, t in reversed(list(enumerate(ts))):
            G.addcmul_(gyt[t], Cc[t])                                         # dL/dh_t
            # sums over d take the state transposed, (b, d, n): bmm does a row times that
            # matrix several times faster than the (b, n, d) matrix times a column
            torch.bmm(gyt[t], S[j + 1].transpose(1, 2), out=gC[t])            # sum_d gy h_t: (b, 1, n)
            torch.bmm(dxt[t], G.transpose(1, 2), out=gB[t])                   # sum_d Δ x G
            torch.bmm(Bt[t], G, out=gBx[t])                                   # sum_n B G: (b, 1, d)
            G.mul_(E[j])                                                       # what reaches h_{t-1}
            torch.mul(G, S[j], out=M)                                          # dL/d(Δ_t A)
            dA.addcmul_(M, dt[t])
            torch.sum(M.mul_(At), 1, keepdim=True, out=gMA[t])
