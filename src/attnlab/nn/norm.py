"""Normalisation layers: LayerNorm, RMSNorm and DyT (a normalisation-free replacement).

All take (..., E) and return (..., E), normalising over the last axis. Statistics are
computed in fp32 even for bf16/fp16 inputs (low precision sums lose the small variance
terms; transformers PR#29285).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerNorm", "RMSNorm", "JointHeadsRMSNorm", "GatedRMSNorm", "DyT", "make_norm", "NORM_KINDS"]


def _check_width(name: str, d: int, x: Tensor | None = None) -> None:
    if x is None:
        if d <= 0:
            raise ValueError(f"{name}: width d must be positive, got {d}")
    elif x.size(-1) != d:
        raise ValueError(f"{name}: input last dim {x.size(-1)} != normalised width {d} (shape {tuple(x.shape)})")


class LayerNorm(nn.Module):
    r"""LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias.

    Mean and (biased) variance over the last axis E. Ba, Kiros, Hinton 2016.
    Parameters ``weight`` (E,) and ``bias`` (E,) (None with ``bias=False``), named as in
    ``torch.nn.LayerNorm`` so state dicts load unchanged.

    Shapes: (..., E) -> (..., E), in the input's dtype. A half-precision input goes to
    ``F.layer_norm`` as it is, the kernel ``torch.nn.LayerNorm`` (and so transformers) runs:
    it accumulates the statistics in fp32 and rounds once, bit for bit what Hugging Face's
    bf16 models compute, in one pass where casting to fp32 and back took three. Under
    autocast the norm runs in fp32 (autocast's list) and is cast back to the input's dtype.
    """

    def __init__(self, d: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        _check_width("LayerNorm", d)
        self.d, self.eps = d, eps
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        _check_width("LayerNorm", self.d, x)
        return F.layer_norm(x, (self.d,), self.weight, self.bias, self.eps).to(x.dtype)

    def no_weight_decay(self) -> tuple[str, ...]:
        """Every parameter: the gain and shift set the output's scale, which decay would pull to 0."""
        return tuple(name for name, _ in self.named_parameters(recurse=False))

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    r"""RMSNorm(x) = x / sqrt(mean(x^2) + eps) * weight.

    No centring and no bias (Zhang & Sennrich 2019); used by LLaMA and T5. The
    statistic and the scaling run in fp32, the result is cast back to the input dtype and
    only *then* multiplied by ``weight``, the order of Hugging Face's ``LlamaRMSNorm``, so
    bf16 outputs are bit-identical to it. As there, the output dtype is the promotion of
    the input and weight dtypes (cast the module with the model).

    ``unit_offset=True``: the gain is ``1 + weight`` (weight initialised to 0, so weight decay
    pulls the gain to 1, not 0), and the product is taken in fp32 before the cast back, so a bf16
    model rounds once.

    Shapes: (..., E) -> (..., E). Parameter ``weight`` (E,).
    """

    def __init__(self, d: int, eps: float = 1e-6, *, unit_offset: bool = False):
        super().__init__()
        _check_width("RMSNorm", d)
        self.d, self.eps, self.unit_offset = d, eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(d) if unit_offset else torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        _check_width("RMSNorm", self.d, x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def no_weight_decay(self) -> tuple[str, ...]:
        """Every parameter: the gain and shift set the output's scale, which decay would pull to 0."""
        return tuple(name for name, _ in self.named_parameters(recurse=False))

    def extra_repr(self) -> str:
        return f"{self.d}, eps={self.eps}" + (", unit_offset=True" if self.unit_offset else "")


class JointHeadsRMSNorm(RMSNorm):
    r""":class:`RMSNorm` over all heads of a token at once: heads (B, H, T, D) -> (B, H, T, D),
    the statistic taken over the H * D channels of each token (a QK-norm over the whole projection
    width, before the split into heads, rather than per head). ``d`` = H * D; weight (H * D,)."""

    def forward(self, x: Tensor) -> Tensor:
        B, H, T, D = x.shape
        y = super().forward(x.transpose(1, 2).reshape(B, T, H * D))
        return y.view(B, T, H, D).transpose(1, 2)


class GatedRMSNorm(RMSNorm):
    r"""GatedRMSNorm(x, z) = RMSNorm(x * SiLU(z)) with the statistic taken over each of ``groups``
    equal slices of the last axis (Mamba-2's output norm, whose groups are its B/C head groups, so
    that a layer split across devices by groups normalises each part alone).

    The gate and the statistic run in fp32, the result is cast back and then scaled by
    ``weight``, as :class:`RMSNorm` and transformers' ``MambaRMSNormGated``.

    Shapes: x, z (..., E) -> (..., E). Parameter ``weight`` (E,).
    """

    def __init__(self, d: int, groups: int = 1, eps: float = 1e-6):
        super().__init__(d, eps)
        if groups <= 0 or d % groups:
            raise ValueError(f"GatedRMSNorm: {groups} groups do not divide the width {d}")
        self.groups = groups

    def forward(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        _check_width("GatedRMSNorm", self.d, x)
        x32 = x.float() if z is None else x.float() * F.silu(z.float())
        x32 = x32.unflatten(-1, (self.groups, -1))
        x32 = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return self.weight * x32.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.d}, groups={self.groups}, eps={self.eps}"


class DyT(nn.Module):
    r"""Dynamic Tanh: DyT(x) = weight * tanh(alpha * x) + bias.

    An element-wise replacement for a normalisation layer, no statistics at all
    (Zhu, Chen, He, LeCun, Liu 2025, "Transformers without Normalization", section 3).
    ``alpha`` is one learnable scalar (initialised to ``alpha_init``), ``weight`` (E,)
    starts at ones and ``bias`` (E,) at zeros.

    Shapes: (..., E) -> (..., E), in the input's dtype.
    """

    def __init__(self, d: int, alpha_init: float = 0.5):
        super().__init__()
        _check_width("DyT", d)
        self.d = d
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        _check_width("DyT", self.d, x)
        return (self.weight * torch.tanh(self.alpha * x) + self.bias).to(x.dtype)

    # the multiple of the learning rate alpha trains at (attnlab.train.optim.lr_scales); a class
    # default, so a DyT built or loaded anywhere trains alpha at the plain rate unless a task asks
    alpha_lr_scale: float = 1.0

    def no_weight_decay(self) -> tuple[str, ...]:
        """Every parameter: the gain and shift set the output's scale, which decay would pull to 0."""
        return tuple(name for name, _ in self.named_parameters(recurse=False))

    def lr_scale(self) -> dict[str, float]:
        """``{"alpha": alpha_lr_scale}`` when it is not 1. Adam moves a parameter by about the
        learning rate per step whatever its size, which is slow for a scalar that must move by a
        factor (the digits' alphas go from 4 to 0.01 or from 0.5 to 1.3; docs/vision.md)."""
        return {} if self.alpha_lr_scale == 1.0 else {"alpha": self.alpha_lr_scale}

    def extra_repr(self) -> str:
        return f"{self.d}"


NORM_KINDS = ("layernorm", "rmsnorm", "dyt")


def make_norm(kind: str, d: int, eps: float | None = None, dyt_alpha: float = 0.5) -> nn.Module:
    """Build a norm by name: "layernorm" | "rmsnorm" | "dyt".

    ``eps`` None keeps each layer's default (1e-5 LayerNorm, 1e-6 RMSNorm); DyT has no eps
    and ignores it. ``dyt_alpha`` is DyT's initial alpha (the others ignore it).
    """
    key = kind.lower() if isinstance(kind, str) else kind
    if key == "layernorm":
        return LayerNorm(d) if eps is None else LayerNorm(d, eps=eps)
    if key == "rmsnorm":
        return RMSNorm(d) if eps is None else RMSNorm(d, eps=eps)
    if key == "dyt":
        return DyT(d, dyt_alpha)
    raise ValueError(f"make_norm: unknown norm kind {kind!r}; valid kinds are {', '.join(NORM_KINDS)}")
