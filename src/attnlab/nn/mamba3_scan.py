"""The scan of Mamba-3 (Lahoti, Li, Chen, Wang, Bick, Kolter, Dao, Gu 2026, "Mamba-3: Improved
Sequence Modeling using State Space Principles", section 3), written twice on purpose: one
position at a time as the paper states it, and chunked for training.

Glossary of shapes (batch first, as everywhere in attnlab)::

    b  batch     l  sequence length     h  heads     p  channels per head (headdim)
    n  state size per head (d_state)    r  rank (1 for SISO, mimo_rank for MIMO)
    q  chunk length of the fast path

    C, B   (b, l, r, h, n)   readout and input vectors, already normalised, biased and rotated
    X      (b, l, r, h, p)   the inputs (SISO: the head's channels; MIMO: one copy per rank)
    a      (b, l, h)         the log of the step's decay, A_t Δ_t <= 0 (A is data-dependent)
    gamma  (b, l, h)         λ_t Δ_t, the weight of this position's input
    beta   (b, l, h)         (1 - λ_t) Δ_t, the weight of the previous position's input
    state  (s (b, h, p, n) fp32, B_prev (b, r, h, n), X_prev (b, r, h, p))

The exponential-trapezoidal rule (the paper's equation 4) integrates the input over a step with
the trapezoid between the previous and the current position, mixed by λ_t in [0, 1] (λ = 1 is
Mamba-2's Euler-style step)::

    s_t = exp(a_t) s_{t-1} + beta_t exp(a_t) X_{t-1} B_{t-1}^T + gamma_t X_t B_t^T
    Y_t = s_t C_t                                          (per rank: Y_{t,r} = s_t C_{t,r})

where with rank r the products sum over it: X B^T = sum_r X_{.,r} B_{.,r}^T (MIMO, section 3.3:
r inputs and r outputs share one state, r times the work per byte of state moved).

:func:`rotate_pairs` turns B and C by the accumulated angles before they come here: the
complex-valued state of the paper (section 3.2), each pair of entries a complex number rotated
by exp(i θ), realised in real numbers. :func:`mamba3_step` is one position (generation);
:func:`mamba3_scan_reference` loops it.
:func:`mamba3_scan` is the fast path. An input written at s enters every later state once with
gamma_s and once, through the next position, with beta_{s+1}; so the sum of the two, w_s =
gamma_s + beta_{s+1}, is its weight in every state after s, and gamma_s alone at s itself. The
scan then is Mamba-2's state-space duality over the "full" state S_t = s_t + beta_{t+1} X_t B_t^T,
which obeys S_t = exp(a_t) S_{t-1} + w_t X_t B_t^T: within a chunk of q positions the outputs
are the masked products (C B^T ∘ decay ∘ weights) X, matrices of q·r by q·r; across chunks a
short recurrence carries the state. The last position of a sequence has beta_{l+1} = 0, which
makes S_l = s_l, the state to carry on from. The state and all arithmetic are fp32: the decay
multiplies it over thousands of positions. Autograd differentiates the chunked form: what it
keeps grows with l·q·r² per head (the masked scores) and l/q states, not with l states.

A slot with Δ = 0 and X = 0 changes nothing (exp(0) = 1, both weights 0), which is how a model
carries its state unchanged over padding.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mamba3_step", "mamba3_scan_reference", "mamba3_scan", "empty_state", "rotate_pairs", "mamba3_blocks"]


def rotate_pairs(t: Tensor, theta: Tensor) -> Tensor:
    """Rotate the pairs (0, 1), (2, 3), ... of ``t``'s last dimension by ``theta`` (..., k), one
    angle per pair; the entries past the first 2k stay as they are. Multiplying t_{2i} + i t_{2i+1}
    by exp(i θ_i), in real numbers."""
    k = theta.size(-1)
    if k == 0:
        return t
    pairs = t[..., :2 * k].unflatten(-1, (k, 2))
    cos, sin = torch.cos(theta), torch.sin(theta)
    t0, t1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], dim=-1).flatten(-2)
    return torch.cat([rotated, t[..., 2 * k:]], dim=-1)


def empty_state(b: int, r: int, h: int, p: int, n: int, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The state before the first position: zeros, fp32."""
    z = dict(dtype=torch.float32, device=like.device)
    return torch.zeros(b, h, p, n, **z), torch.zeros(b, r, h, n, **z), torch.zeros(b, r, h, p, **z)


def _outer(X: Tensor, B: Tensor) -> Tensor:
    """sum over the rank of X B^T: (b, r, h, p), (b, r, h, n) -> (b, h, p, n)."""
    return torch.einsum("brhp,brhn->bhpn", X, B)


def mamba3_step(state, C: Tensor, B: Tensor, X: Tensor, a: Tensor, gamma: Tensor, beta: Tensor):
    """One position: C, B (b, r, h, n), X (b, r, h, p), a, gamma, beta (b, h) ->
    (Y (b, r, h, p) fp32, the new state)."""
    s, B_prev, X_prev = state
    C, B, X, a, gamma, beta = (t.float() for t in (C, B, X, a, gamma, beta))
    with torch.autocast(X.device.type, enabled=False):        # the state stays fp32 under autocast too
        alpha = torch.exp(a)[..., None, None]
        s = alpha * s + (beta[..., None, None] * alpha) * _outer(X_prev, B_prev) \
            + gamma[..., None, None] * _outer(X, B)
        Y = torch.einsum("bhpn,brhn->brhp", s, C)
    return Y, (s, B, X)


def _check(C, B, X, a, gamma, beta) -> None:
    b, l, r, h, n = B.shape
    if C.shape != B.shape or X.shape[:4] != (b, l, r, h) or not a.shape == gamma.shape == beta.shape == (b, l, h):
        raise ValueError(f"mamba3_scan: shapes C {tuple(C.shape)}, B {tuple(B.shape)}, X {tuple(X.shape)}, "
                         f"a {tuple(a.shape)}, gamma {tuple(gamma.shape)}, beta {tuple(beta.shape)} do not match "
                         f"(b, l, r, h, n), (b, l, r, h, p), (b, l, h)")


def mamba3_scan_reference(C: Tensor, B: Tensor, X: Tensor, a: Tensor, gamma: Tensor, beta: Tensor, state=None):
    """The recurrence of the module docstring, one position at a time -> (Y (b, l, r, h, p) fp32,
    the state after the last position)."""
    _check(C, B, X, a, gamma, beta)
    b, l, r, h, n = B.shape
    state = empty_state(b, r, h, X.size(-1), n, X) if state is None else state
    ys = []
    for t in range(l):
        y, state = mamba3_step(state, C[:, t], B[:, t], X[:, t], a[:, t], gamma[:, t], beta[:, t])
        ys.append(y)
    return torch.stack(ys, dim=1), state


def _chunks(t: Tensor, q: int) -> Tensor:
    """(b, l, ...) fp32 -> (b, l/q, q, ...), the length padded with zeros to a multiple of q."""
    pad = -t.size(1) % q
    t = t.float()
    if pad:
        t = torch.cat([t, t.new_zeros(t.size(0), pad, *t.shape[2:])], dim=1)
    return t.view(t.size(0), -1, q, *t.shape[2:])


def mamba3_scan(C: Tensor, B: Tensor, X: Tensor, a: Tensor, gamma: Tensor, beta: Tensor, state=None,
                chunk: int = 64):
    """The chunked fast path (module docstring): equal to :func:`mamba3_scan_reference`,
    gradients included, for any length (the last chunk is padded with positions that change
    nothing) -> (Y (b, l, r, h, p) fp32, the state after the last position)."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"mamba3_scan: chunk must be a positive int, got {chunk!r}")
    _check(C, B, X, a, gamma, beta)
    with torch.autocast(X.device.type, enabled=False):        # bf16 matmuls would round the state
        return _chunked_scan(C, B, X, a, gamma, beta, state, chunk)


def _chunked_scan(C, B, X, a, gamma, beta, state, q):
    b, l, r, h, n = B.shape
    p = X.size(-1)
    s0, B_prev, X_prev = empty_state(b, r, h, p, n, X) if state is None else state
    # the full state entering: the previous position's input still owes its beta share to this step
    S = s0 + beta[:, 0, :, None, None].float() * _outer(X_prev.float(), B_prev.float())
    w = gamma.float() + torch.cat([beta[:, 1:].float(), beta.new_zeros(b, 1, h, dtype=torch.float32)], dim=1)
    # (b, c, q, ...) -> heads first: (b, h, c, q, ...)
    Cc, Bc, Xc = (_chunks(t, q).permute(0, 4, 1, 2, 3, 5) for t in (C, B, X))
    ac, gc, wc = (_chunks(t, q).permute(0, 3, 1, 2) for t in (a, gamma, w))
    cs = ac.cumsum(-1)                                                           # (b, h, c, q)
    i = torch.arange(q, device=X.device)
    below, diag = i[:, None] > i[None, :], i[:, None] == i[None, :]
    # decay from position j to i within a chunk (j <= i), times j's weight in i's output
    gap = (cs[..., :, None] - cs[..., None, :]).masked_fill(~(below | diag), float("-inf"))
    weight = torch.where(below, wc[..., None, :], torch.where(diag, gc[..., None, :], torch.zeros_like(gap)))
    mix = torch.exp(gap) * weight                                                # (b, h, c, q, q)
    scores = torch.einsum("bhcirn,bhcjsn->bhcirjs", Cc, Bc) * mix[..., :, None, :, None]
    Y = (scores.reshape(b, h, -1, q * r, q * r) @ Xc.reshape(b, h, -1, q * r, p)).view(b, h, -1, q, r, p)
    # each chunk's own end state (from zero) and its total decay; then the states entering the chunks
    own = torch.einsum("bhcjsp,bhcj,bhcjsn->bhcpn", Xc, torch.exp(cs[..., -1:] - cs) * wc, Bc)
    total = torch.exp(cs[..., -1])
    starts = []
    # unbind (not [:, :, k]): indexing in the loop gives a backward quadratic in the chunks
    for total_k, own_k in zip(total.unbind(2), own.unbind(2)):
        starts.append(S)
        S = total_k[..., None, None] * S + own_k
    starts = torch.stack(starts, dim=2)                                          # (b, h, c, p, n)
    Y = Y + torch.einsum("bhcirn,bhcpn->bhcirp", Cc, starts) * torch.exp(cs)[..., None, None]
    Y = Y.permute(0, 2, 3, 4, 1, 5).reshape(b, -1, r, h, p)[:, :l]
    return Y, (S, B[:, -1].float(), X[:, -1].float())


def mamba3_blocks(C: Tensor, B: Tensor, X: Tensor, a: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    """(b, h, T, R, T, R) fp32: the map of mamba3_scan(C, B, X, a, gamma, beta) from a zero state,
    Y[:, t, i] = Σ_{s, j} M[:, :, t, i, s, j] X[:, s, j] per channel of a head. The trapezoid's two
    weights fold into one per entry: an input written at s reaches t > s with w_s = γ_s + β_{s+1}
    and itself with γ_t alone, so

        M[t, i, s, j] = (C_{t,i} · B_{s,j}) exp(Σ_{s<r<=t} a_r) (w_s if s < t else γ_t)."""
    from .ssd import _segment_sums
    gamma, beta = gamma.float().transpose(1, 2), beta.float().transpose(1, 2)   # (b, h, T)
    w = gamma + torch.cat([beta[..., 1:], torch.zeros_like(beta[..., :1])], dim=-1)
    T = w.size(-1)
    below = torch.ones(T, T, dtype=torch.bool, device=w.device).tril(-1)
    weight = torch.where(below, w[..., None, :], torch.diag_embed(gamma))
    mix = torch.exp(_segment_sums(a.float().transpose(1, 2))) * weight                # (b, h, T, T)
    scores = torch.einsum("btihn,bsjhn->bhtisj", C.float(), B.float())
    return scores * mix[:, :, :, None, :, None]
