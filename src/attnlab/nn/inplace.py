"""When a layer may overwrite its own intermediate tensors instead of allocating new ones.

On a CPU a fresh tensor of a few MB costs more than the arithmetic that fills it: the allocator
hands large blocks back to the kernel when they are freed and gets new pages for the next one,
and every new 4 KiB page is a page fault that the kernel zero-fills: tens of thousands of them
in a BERT-base forward. Writing the feed-forward's activation into its hidden tensor and each
residual sum into the sublayer's output, as nothing needs the values they replace, removes most
of them, to the same last bit (figures: benchmarks/results/code.md; benchmarks/encoders.py,
tests/test_inplace.py).

That is safe only where nobody else can see the tensor being overwritten:

- autograd records nothing for it (training saves activations for backward: there the layers
  compute out of place, exactly as before);
- no forward hook is registered on the layer, on any of its submodules, or globally (a hook may
  keep a reference to a submodule's output, and must find the value it was given);
- the tensor came out of an ``nn.Linear`` or one of attnlab's own sublayers, which return new
  tensors (``returns_new_tensor = True`` on the class); the output of any other module a user
  plugs in is never overwritten.

Small tensors (under :data:`MIN_ELEMENTS`) are not worth the checks and stay out of place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module

__all__ = ["MIN_ELEMENTS", "may_overwrite", "activate_in_place", "hooked"]

MIN_ELEMENTS = 1 << 16          # 256 KiB of fp32: below that, allocations come from reused memory anyway


def hooked(layer: nn.Module, pre: bool = False) -> bool:
    """Whether a forward hook is registered on ``layer``, on any of its submodules, or globally;
    ``pre``: a forward pre-hook counts too (for a caller that skips calling a submodule)."""
    if getattr(_module, "_global_forward_hooks", None) or (pre and getattr(_module, "_global_forward_pre_hooks", None)):
        return True
    return any(m._forward_hooks or (pre and m._forward_pre_hooks) for m in layer.modules())


def may_overwrite(layer: nn.Module, t: Tensor, *sources: nn.Module) -> bool:
    """Whether ``layer`` may overwrite ``t``, the output of its submodule(s) ``sources`` (all of
    them ``nn.Linear`` layers or modules declaring ``returns_new_tensor``): large, outside any
    autograd graph, unhooked."""
    if t.numel() < MIN_ELEMENTS or (torch.is_grad_enabled() and t.requires_grad):
        return False
    if not all(isinstance(s, nn.Linear) or getattr(s, "returns_new_tensor", False) for s in sources):
        return False
    return not hooked(layer)


def activate_in_place(act: nn.Module, h: Tensor) -> Tensor | None:
    """``act(h)`` written into ``h`` for the activation modules attnlab builds (ReLU, SiLU, GELU
    exact or tanh); None for any other module (the caller then calls it out of place)."""
    kind = type(act)
    if kind is nn.ReLU:
        return torch.relu_(h)
    if kind is nn.SiLU:
        return F.silu(h, inplace=True)
    if kind is nn.GELU:
        return torch.ops.aten.gelu_(h, approximate=act.approximate)
    return None
