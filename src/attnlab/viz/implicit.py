"""The implicit attention matrix of a state-space layer (Mamba-2's duality, Dao & Gu 2024, section 3;
Mamba-3's trapezoidal and rotated form): the (T, T) matrix per head that the scan multiplies its
input by, read off the layer's own scan inputs during a forward.

    with record_scans(model) as calls:            # every Mamba-2 / Mamba-3 scan, in call order
        model(ids)
    M = implicit_matrices(model, ids)             # (L, b, H, T, T), fp32

Mamba-2 (attnlab.nn.ssd): y = M x + D x, with x the scan's input u (b, T, h, p) and, per head,

    M[t, s] = (C_t · B_s) exp(Σ_{s<r<=t} Δ_r A) Δ_s        for s <= t, 0 above the diagonal

Mamba-3 (attnlab.nn.mamba3_scan, SISO): Y = M X (the mixer adds D X after the scan), with B and
C already normalised, biased and rotated, so C_t · B_s carries the rotation by θ_t - θ_s, and the
trapezoid's two weights folded into one per entry (the scan's docstring): an input written at s
reaches t > s with w_s = γ_s + β_{s+1} and itself with γ_t alone::

    M[t, s] = (C_t · B_s) exp(Σ_{s<r<=t} a_r) (w_s if s < t else γ_t)

MIMO Mamba-3 (rank R > 1): the R inputs X_{s,j} and R outputs Y_{t,i} of a head share one state,
so the map from inputs to outputs is an R x R block per (t, s), :func:`call_blocks`' (b, H, T, R, T, R)::

    M[t, i, s, j] = (C_{t,i} · B_{s,j}) exp(Σ_{s<r<=t} a_r) (w_s if s < t else γ_t)
    Y[t, i] = Σ_{s, j} M[t, i, s, j] X[s, j]

(SISO is R = 1.) There is no single honest signed number per (t, s) then, so the drawn scalar is
the block's Frobenius norm ||M[t, :, s, :]||_F (:func:`call_magnitude`): it bounds the block's
largest singular value, so no input of unit norm at s moves the scan's outputs at t by more;
it is |M[t, s]| when R = 1, the magnitude drawn for every other matrix too. The matrix is the
same for every channel of a head (the decay is a scalar per head), which is why Mamba-1, whose
decay is a (d, n) matrix, has none per head and is refused.

Entries can be negative (C · B is a dot product): attnlab.viz.views.implicit_views draws their
magnitude, :func:`implicit_magnitudes`.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..models import mamba2 as mamba2_module
from ..models import mamba3 as mamba3_module
from ..nn.ssd import _heads, _segment_sums

__all__ = ["ScanCall", "record_scans", "implicit_matrices", "implicit_magnitudes", "call_matrix", "call_blocks",
           "call_magnitude", "has_implicit_attention", "mimo_rank"]


@dataclass
class ScanCall:
    """One scan of one layer: ``family`` "mamba2" or "mamba3", its positional inputs as the scan
    received them, and its output (y for Mamba-2, with the D skip; Y for Mamba-3, without it)."""
    family: str
    inputs: tuple
    output: Tensor


def _recording(family: str, scan, calls: list[ScanCall]):
    def recorded(*args, **kwargs):
        extra = args[6] if len(args) > 6 else kwargs.get("h0", kwargs.get("state"))
        if extra is not None:
            raise ValueError(f"implicit attention: the {family} scan ran from a carried state; record a whole "
                             f"sequence from the start (no cache)")
        out = scan(*args, **kwargs)
        calls.append(ScanCall(family, tuple(args[:6]), out[0]))
        return out
    return recorded


@contextmanager
def record_scans(model: nn.Module):
    """Record every Mamba-2 and Mamba-3 scan that runs inside the block, in call order (the
    layers' order for a forward). The scans themselves run unchanged: the record wraps the
    function the mixers call and restores it on exit."""
    calls: list[ScanCall] = []
    saved = mamba2_module.ssd_scan, mamba3_module.mamba3_scan
    mamba2_module.ssd_scan = _recording("mamba2", saved[0], calls)
    mamba3_module.mamba3_scan = _recording("mamba3", saved[1], calls)
    try:
        yield calls
    finally:
        mamba2_module.ssd_scan, mamba3_module.mamba3_scan = saved


def _mamba2_matrix(x, dt, A, B, C, D) -> Tensor:
    nh = x.size(2)
    dt = dt.float()
    Bh, Ch = _heads(B.float(), nh), _heads(C.float(), nh)                  # (b, T, h, n)
    scores = torch.einsum("bthn,bshn->bhts", Ch, Bh)
    decay = torch.exp(_segment_sums((dt * A.float()).transpose(1, 2)))     # (b, h, T, T), 0 above the diagonal
    return scores * decay * dt.transpose(1, 2)[:, :, None, :]


def _mamba3_blocks(C, B, X, a, gamma, beta) -> Tensor:
    """(b, h, T, R, T, R): M[t, i, s, j] of the module docstring."""
    gamma, beta = gamma.float().transpose(1, 2), beta.float().transpose(1, 2)   # (b, h, T)
    w = gamma + torch.cat([beta[..., 1:], torch.zeros_like(beta[..., :1])], dim=-1)
    T = w.size(-1)
    below = torch.ones(T, T, dtype=torch.bool, device=w.device).tril(-1)
    weight = torch.where(below, w[..., None, :], torch.diag_embed(gamma))
    mix = torch.exp(_segment_sums(a.float().transpose(1, 2))) * weight                # (b, h, T, T)
    scores = torch.einsum("btihn,bsjhn->bhtisj", C.float(), B.float())
    return scores * mix[:, :, :, None, :, None]


def call_blocks(call: ScanCall) -> Tensor:
    """(b, H, T, R, T, R): a recorded Mamba-3 scan's map from its inputs X (b, T, R, H, p) to its
    outputs Y, ``Y[:, t, i] = Σ_{s, j} M[:, :, t, i, s, j] X[:, s, j]`` per channel (R = 1 for SISO)."""
    if call.family != "mamba3":
        raise ValueError(f"implicit attention: call_blocks reads a Mamba-3 scan, this is a {call.family} one "
                         f"(use call_matrix)")
    return _mamba3_blocks(*call.inputs)


def call_matrix(call: ScanCall) -> Tensor:
    """The signed (b, H, T, T) implicit attention of one recorded Mamba-2 or SISO Mamba-3 scan
    (the module docstring). A MIMO scan has an R x R block per entry instead: :func:`call_blocks`."""
    if call.family == "mamba2":
        return _mamba2_matrix(*call.inputs)
    R = call.inputs[1].size(2)
    if R != 1:
        raise ValueError(f"implicit attention: a MIMO Mamba-3 (rank {R}) maps its inputs to its outputs by an "
                         f"{R}x{R} block per (t, s), not one number; use call_blocks, or call_magnitude "
                         f"for the blocks' Frobenius norms")
    return call_blocks(call)[:, :, :, 0, :, 0]


def call_magnitude(call: ScanCall) -> Tensor:
    """(b, H, T, T) >= 0: |M[t, s]| of a Mamba-2 or SISO Mamba-3 scan, the Frobenius norm of the
    R x R block M[t, :, s, :] of a MIMO one (equal to |M[t, s]| when R = 1)."""
    if call.family == "mamba2":
        return _mamba2_matrix(*call.inputs).abs()
    return torch.linalg.matrix_norm(call_blocks(call).transpose(3, 4))     # over the (i, j) of each block


def mimo_rank(model: nn.Module) -> int:
    """The largest rank R of the model's Mamba-3 layers (1: SISO, or no Mamba-3 layer)."""
    return max((m.c.rank for m in model.modules() if isinstance(m, mamba3_module.Mamba3Mixer)), default=1)


def has_implicit_attention(model: nn.Module) -> bool:
    return any(isinstance(m, (mamba2_module.Mamba2Mixer, mamba3_module.Mamba3Mixer)) for m in model.modules())


def _scans(model: nn.Module, ids: Tensor) -> list[ScanCall]:
    """The scans of one forward of ``model`` over ``ids``, one per Mamba-2 / Mamba-3 layer."""
    if not has_implicit_attention(model):
        raise ValueError(f"implicit attention: {type(model).__name__} has no Mamba-2 or Mamba-3 layer "
                         f"(Mamba-1's decay differs per channel, so it has no (T, T) matrix per head)")
    with record_scans(model) as calls:
        model(ids)
    mixers = sum(isinstance(m, (mamba2_module.Mamba2Mixer, mamba3_module.Mamba3Mixer)) for m in model.modules())
    if len(calls) != mixers:     # a mixer that reached its scan another way would leave a layer out silently
        raise ValueError(f"implicit attention: {len(calls)} scans recorded for {mixers} Mamba-2 / Mamba-3 layers")
    return calls


@torch.no_grad()
def implicit_matrices(model: nn.Module, ids: Tensor) -> Tensor:
    """(L, b, H, T, T) fp32, signed: each Mamba-2 / SISO Mamba-3 layer's implicit attention for
    ``ids`` (b, T), from one forward of the model, whose outputs it leaves as they are."""
    return torch.stack([call_matrix(c) for c in _scans(model, ids)])


@torch.no_grad()
def implicit_magnitudes(model: nn.Module, ids: Tensor) -> Tensor:
    """(L, b, H, T, T) fp32, >= 0: :func:`call_magnitude` of each layer, MIMO Mamba-3 included."""
    return torch.stack([call_magnitude(c) for c in _scans(model, ids)])

