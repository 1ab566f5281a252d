"""The implicit attention matrix of a state-space layer (Mamba-2's duality, Dao & Gu 2024, section 3;
Mamba-3's trapezoidal and rotated form): the (T, T) matrix per head that the scan multiplies its
input by, read off the layer's own scan inputs during a forward.

    with record_scans(model) as calls:            # every mixer's call that has a map, in call order
        model(ids)
    M = implicit_matrices(model, ids)             # (L, b, H, T, T), fp32

Nothing here knows a family: each mixer reports its calls and their maps itself
(attnlab.nn.record: ``MixerCall.matrix``, ``.blocks``, ``.magnitude``), the scans' math lives in
attnlab.nn.ssd.ssd_matrix and attnlab.nn.mamba3_scan.mamba3_blocks, and a new mixer that reports a
map is drawn as these are. What the two scans report:

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
decay is a (d, n) matrix, has none per head and is refused (its mixer reports no map, and says why).

Entries can be negative (C · B is a dot product): attnlab.viz.views.implicit_views draws their
magnitude, :func:`implicit_magnitudes`.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..nn.record import MixerCall, ReportsMixing

__all__ = ["ScanCall", "record_scans", "implicit_matrices", "implicit_magnitudes", "implicit_title", "call_matrix",
           "call_blocks", "call_magnitude", "has_implicit_attention"]

ScanCall = MixerCall          # the name this module's callers knew a recorded scan by


def _mapped(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, ReportsMixing) and m.map_per_head]


@contextmanager
def record_scans(model: nn.Module) -> Iterator[list[MixerCall]]:
    """Record the calls of every mixer of ``model`` that reports a map per head (attnlab.nn.record),
    in call order (the layers' order for a forward); the mixers run unchanged."""
    calls: list[MixerCall] = []
    mixers = _mapped(model)
    try:
        for m in mixers:
            m.mixing_record = calls.append
        yield calls
    finally:
        for m in mixers:
            m.mixing_record = None


def call_blocks(call: MixerCall) -> Tensor:
    """The finer map of a call whose entries are blocks (a MIMO scan's (b, H, T, R, T, R))."""
    if call.blocks is None:
        raise ValueError(f"implicit attention: call_blocks reads a call whose map has blocks; this {call.family} "
                         f"one has none (use call_matrix)")
    return call.blocks()


def call_matrix(call: MixerCall) -> Tensor:
    """The signed (b, H, T, T) map of one recorded call (the module docstring)."""
    if call.matrix is None:
        raise ValueError(f"implicit attention: the {call.family} call reports no map")
    return call.matrix()


def call_magnitude(call: MixerCall) -> Tensor:
    """(b, H, T, T) >= 0: what is drawn of a call, |M| or a block's Frobenius norm."""
    if call.magnitude is None:
        raise ValueError(f"implicit attention: the {call.family} call reports no map")
    return call.magnitude()


def implicit_title(calls: list[MixerCall]) -> str:
    """What the drawn values of ``calls`` are, as their mixers say (distinct titles joined)."""
    return "; ".join(dict.fromkeys(c.title or f"{c.family} map" for c in calls))


def has_implicit_attention(model: nn.Module) -> bool:
    """Whether a mixer of ``model`` reports a (T, T) map per head."""
    return bool(_mapped(model))


def _scans(model: nn.Module, ids: Tensor) -> list[MixerCall]:
    """The mapped calls of one forward of ``model`` over ``ids``, one per such mixer."""
    mixers = _mapped(model)
    if not mixers:
        reasons = list(dict.fromkeys(m.no_map_reason for m in model.modules()
                                     if isinstance(m, ReportsMixing) and m.no_map_reason))
        raise ValueError(f"implicit attention: {type(model).__name__} has no mixer that reports a (T, T) map per "
                         f"head" + (f" ({'; '.join(reasons)})" if reasons else ""))
    with record_scans(model) as calls:
        model(ids)
    if len(calls) != len(mixers):     # a mixer that ran another way would leave a layer out silently
        raise ValueError(f"implicit attention: {len(calls)} calls recorded for {len(mixers)} mixers with a map")
    return calls


@torch.no_grad()
def implicit_matrices(model: nn.Module, ids: Tensor) -> Tensor:
    """(L, b, H, T, T) fp32, signed: each mapped mixer's implicit attention for ``ids`` (b, T), from
    one forward of the model, whose outputs it leaves as they are."""
    return torch.stack([call_matrix(c) for c in _scans(model, ids)])


@torch.no_grad()
def implicit_magnitudes(model: nn.Module, ids: Tensor, *, title: bool = False):
    """(L, b, H, T, T) fp32, >= 0: :func:`call_magnitude` of each layer (with ``title``: and
    :func:`implicit_title` of the calls)."""
    calls = _scans(model, ids)
    M = torch.stack([call_magnitude(c) for c in calls])
    return (M, implicit_title(calls)) if title else M
