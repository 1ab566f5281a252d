"""LoRA: a frozen Linear layer plus a trainable low-rank update (Hu et al. 2021, section 4.1).

    y = x W^T + b + (alpha / r) * B(A(dropout(x)))        A: (r, in), B: (out, r)

Only A and B train; W and b stay as they were. A starts as ``nn.Linear``'s own initialisation
(Kaiming-uniform with a = sqrt(5)) and B at zero, so at step 0 the layer is exactly the frozen
one and the first gradient reaches B alone. ``alpha / r`` keeps the size of the update roughly
independent of the rank chosen. :meth:`LoRALinear.merge` folds ``(alpha / r) B A`` into W and gives
back a plain ``nn.Linear``: the same outputs without the extra products.

This module knows no model: which layers get adapters, and under which names they are saved,
is :mod:`attnlab.adapters`' business.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LoRALinear"]


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA update (see the module docstring); the state-dict keys of the
    wrapped layer (``weight``, ``bias``) do not change, the adapter adds ``lora_A.weight`` and
    ``lora_B.weight``. ``rank`` r >= 1, ``alpha`` > 0, ``dropout`` in [0, 1) on the adapter's input."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._add_adapter(rank, alpha, dropout)

    def _add_adapter(self, rank: int, alpha: float, dropout: float) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRALinear: rank must be an int >= 1, got {rank!r}")
        if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"LoRALinear: alpha must be a number > 0, got {alpha!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRALinear: dropout must be in [0, 1), got {dropout!r}")
        self.rank, self.alpha = rank, float(alpha)
        kw = {"device": self.weight.device, "dtype": self.weight.dtype}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora_parameters()

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def dropout(self) -> float:
        return self.lora_dropout.p if isinstance(self.lora_dropout, nn.Dropout) else 0.0

    def reset_lora_parameters(self) -> None:
        """A as nn.Linear initialises a weight (what PEFT does too), B = 0: the update starts at zero."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> "LoRALinear":
        """A LoRALinear around ``linear``'s own ``Parameter`` objects (a weight tied elsewhere stays
        tied), with a fresh adapter on the weight's device and dtype."""
        if not isinstance(linear, nn.Linear) or isinstance(linear, LoRALinear):
            raise ValueError(f"LoRALinear.wrap: expected an nn.Linear without an adapter, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.training = linear.training
        layer._add_adapter(rank, alpha, dropout)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        # the frozen product first, then the update added to it (the order PEFT sums in)
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """(alpha / r) B A, shaped like ``weight`` (out, in)."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """A plain ``nn.Linear`` whose weight is W + (alpha / r) B A (the same ``Parameter``, updated
        in place, so a tie survives) and whose bias is this layer's."""
        self.weight.add_(self.delta_weight().to(self.weight.dtype))
        plain = nn.Linear.__new__(nn.Linear)
        nn.Module.__init__(plain)
        plain.in_features, plain.out_features = self.in_features, self.out_features
        plain.weight, plain.bias, plain.training = self.weight, self.bias, self.training
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}, dropout={self.dropout:g}"
