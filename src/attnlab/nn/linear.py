"""Faster Linear layers for inference on CPU.

A decoding step multiplies one row per sequence by every weight matrix of the model: it is bound
by how fast the weights stream from memory, not by arithmetic. On this project's 2-core AVX2 CPU,
PyTorch's fp32 ``F.linear`` (an MKL GEMM) streams a weight at 13-16 GB/s for one row, while
oneDNN's matmul primitive (``torch.ops.mkldnn._linear_pointwise``, what PyTorch's own CPU
inference paths use under ``torch.compile``/IPEX) reaches 24-30 GB/s on the same weights, and is
also ahead for 8-128 rows (prefill, batched decoding) -- for weights of a few MB and up; small
ones stay on ``F.linear`` (see :data:`MIN_WEIGHT_ELEMENTS`). :class:`InferenceLinear` is an
``nn.Linear`` that takes that path when nothing needs a gradient, and :func:`optimize_for_inference`
swaps every ``nn.Linear`` of a model for one (same ``Parameter`` objects: tied weights stay tied,
``state_dict`` keys do not change).

The result equals ``F.linear``'s up to the summation order of the dot products (relative
differences ~1e-7, tests/test_linear.py). Anything else (a gradient required, another dtype or
device, a torch without oneDNN, a oneDNN that fails its first-use self-check) falls back to
``F.linear``, so an optimised model still trains, moves to CUDA and exports as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["InferenceLinear", "optimize_for_inference", "onednn_available", "MIN_WEIGHT_ELEMENTS"]

_ONEDNN: bool | None = None            # decided on first use by _self_check

# oneDNN costs ~20 us more per call than MKL here; it pays off once the weight is large enough
# for its faster streaming to matter. Measured (one row, 2 threads): 256 x 256 takes 27 us instead
# of 9 (0.33x), 1024 x 256 is level, 8000 x 256 is 2.1x faster, 2304 x 768 1.7x, 50257 x 768 2.3x.
MIN_WEIGHT_ELEMENTS = 1 << 19          # 2 MB of fp32: smaller weights stay on F.linear


def _dnn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _self_check() -> bool:
    """Whether this torch has the oneDNN linear op and it agrees with F.linear (checked once)."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 40), (24, 40), (24,)))
        ok = torch.allclose(_dnn_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        return ok and torch.allclose(_dnn_linear(x[0, :1], w, None), F.linear(x[0, :1], w), rtol=1e-5, atol=1e-5)
    except Exception:                   # noqa: BLE001 - any failure means: do not use it
        return False


def onednn_available() -> bool:
    """True when :class:`InferenceLinear` will use oneDNN for fp32 CPU inference."""
    global _ONEDNN
    if _ONEDNN is None:
        _ONEDNN = _self_check()
    return _ONEDNN


class InferenceLinear(nn.Linear):
    """``nn.Linear`` whose gradient-free fp32 CPU calls run oneDNN's matmul (see the module docstring).

    Build one with :meth:`from_linear` (it shares the original's parameters) or directly like an
    ``nn.Linear``. The oneDNN path is taken when autograd is off or nothing involved requires a
    gradient, input and weight are fp32 on the CPU and the weight is contiguous; otherwise forward is
    exactly ``nn.Linear.forward``. Weights under :data:`MIN_WEIGHT_ELEMENTS` elements also stay on
    ``F.linear``: oneDNN's fixed cost per call outweighs its faster streaming there.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> InferenceLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"InferenceLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight                 # the same Parameter objects: ties and optimizers survive
        new.bias = linear.bias
        new.train(linear.training)
        return new

    def _fast(self, x: Tensor) -> bool:
        w = self.weight
        if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or not w.is_contiguous() \
                or w.numel() < MIN_WEIGHT_ELEMENTS:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad
                                        or (self.bias is not None and self.bias.requires_grad)):
            return False
        return onednn_available()

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:                 # oneDNN's own message would be obscure
            raise ValueError(f"{type(self).__name__}: input last dim {x.size(-1)} != in_features "
                             f"{self.in_features} (shape {tuple(x.shape)})")
        if self._fast(x) and x.numel() > 0:
            return _dnn_linear(x.contiguous(), self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def optimize_for_inference(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``model`` (the model itself included) by an
    :class:`InferenceLinear` sharing its parameters; returns the model (a new module only when
    ``model`` itself is an ``nn.Linear``). Idempotent; subclasses of ``nn.Linear`` other than
    plain ones (e.g. a user's custom layer) are left alone, as are non-Linear layers such as
    :class:`attnlab.quantize.Int8Linear`."""
    if type(model) is nn.Linear:
        return InferenceLinear.from_linear(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InferenceLinear.from_linear(child))
    return model
