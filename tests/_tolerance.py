"""The one tolerance policy of every parity test: errors are measured against the values' scale.

    max |got - want|  <=  rtol * scale,    scale = max(max |want|, max |got|)

An absolute threshold such as ``|got - want| <= 1e-5`` says different things about logits of
size 10 and about probabilities of size 0.01, and it breaks across CPUs: floating-point rounding
grows with the values, and each kernel family (scalar, AVX2, AVX-512/AMX, picked by the CPU or
by ``ATEN_CPU_CAPABILITY``) sums in its own order. Logits off by 1.01e-5 failed an absolute 1e-5
with one kernel family and passed with the next. Relative to the largest value, the bound is a
fixed number of units in the last place of that value whatever the kernel: in fp32 (one ulp is
about 1.2e-7 of the value) ``rtol=1e-5`` allows about 80 ulp, ``rtol=1e-6`` about 8.

Every test states its rtol; the usual ones:

- ``FP32_OP`` (1e-6): one fp32 operation or a short chain (a norm, a feed-forward, a rotation)
  against a reference computing the same formula;
- ``FP32`` (1e-5): an fp32 network (attention layers, softmax, norms) against another
  implementation, or a path that reorders the sums (cached vs full, fused vs explicit, padded vs
  unpadded, checkpointed vs not).

Lower precisions state their own rtol beside the comparison. Exact equality stays
``torch.equal`` (or ``rtol=0``). The scale is that of the values the comparison is about: a
tensor that is zero in exact arithmetic (the gradient of a key-projection bias, which the softmax
ignores) holds only round-off, so compare it inside the whole it belongs to (all the gradients
as one vector), not against its own noise.
"""
from __future__ import annotations

import torch

__all__ = ["FP32", "FP32_OP", "assert_close_scaled", "scaled_error"]

FP32 = 1e-5
FP32_OP = 1e-6


def _scale(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest finite magnitude of either (a NaN or inf then fails the comparison itself)."""
    both = torch.cat([got.detach().reshape(-1).double(), want.detach().reshape(-1).double()]).abs()
    both = both[torch.isfinite(both)]
    return float(both.max()) if both.numel() else 0.0


def scaled_error(got, want) -> float:
    """max |got - want| / max(max |want|, max |got|) (the plain difference when both are zeros)."""
    got, want = torch.as_tensor(got).detach().double(), torch.as_tensor(want).detach().double()
    scale = _scale(got, want)
    err = float((got - want).abs().max()) if got.numel() else 0.0
    return err / scale if scale else err


def assert_close_scaled(got, want, rtol: float = FP32, what: str = "") -> None:
    """Assert ``max |got - want| <= rtol * max(max |want|, max |got|)`` (same shape and dtype; NaN
    fails). The message names ``what``, the error, the scale and the error in units of the scale."""
    got, want = torch.as_tensor(got), torch.as_tensor(want)
    scale = _scale(got, want)
    err = scaled_error(got, want)
    torch.testing.assert_close(
        got, want, rtol=0.0, atol=rtol * scale,
        msg=lambda m: f"{what + ': ' if what else ''}max |got - want| = {err:.3g} * scale (scale {scale:.3g}), "
                      f"allowed {rtol:g} * scale\n{m}")
