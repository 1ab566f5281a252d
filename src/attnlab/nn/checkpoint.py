"""Activation checkpointing that keeps a forward pass's side records written once.

Some modules keep a record of their last forward beside their output: a mixture of experts
its router logits (for the load-balancing loss), an attention layer its weights while
``attnlab.viz.record_attention`` listens. Gradient checkpointing runs a layer's forward a
second time inside the backward pass; a record written then would be a duplicate, and one
holding a graph would keep that recomputation's activations alive, undoing the memory the
checkpoint saved. :func:`checkpoint` marks the recomputation so those modules skip it.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext

from torch.utils.checkpoint import checkpoint as _torch_checkpoint

__all__ = ["checkpoint", "recomputing"]

# thread-local: the autograd engine may run the recomputation on its own thread
_state = threading.local()


def recomputing() -> bool:
    """True while a checkpointed forward is being recomputed for the backward pass."""
    return getattr(_state, "depth", 0) > 0


class _Recomputation:
    """Marks the recomputation; a class, not a generator, because torch may enter it again."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc) -> None:
        _state.depth -= 1


def _contexts():
    return nullcontext(), _Recomputation()


def checkpoint(function, *args, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` (non-reentrant) with the recomputation marked."""
    return _torch_checkpoint(function, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
