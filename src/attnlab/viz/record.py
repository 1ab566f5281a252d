"""Record every attention layer's weights while a model runs.

    with record_attention(model) as rec:
        logits = model(ids)
    rec["layers.0.self_attn"]        # one (B, H, T, S) tensor per call of that layer
    rec.stack("self_attn")           # (L, B, H, T, S): every self-attention layer, in model order

Works for any model built from :class:`attnlab.nn.MultiHeadAttention` (self- and
cross-attention alike). The weights are those of ``scaled_dot_product_attention(...,
return_weights=True)``: softmax over the keys after masks and position biases, before
dropout, zero rows for queries with no allowed key. The model's outputs stay exactly as
without recording (the weights are computed beside the layer's usual path), and outside the
context nothing is recorded: each attention module holds a list to append to only while the
context is open, and checks for it with one attribute test otherwise.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention

__all__ = ["AttentionRecord", "record_attention"]


class AttentionRecord(Mapping):
    """Qualified module name -> list of per-call (B, H, T, S) weight tensors, in model order.

    Every attention module of the model has an entry, empty if it did not run.
    """

    def __init__(self, names: list[str]):
        self._calls: dict[str, list[Tensor]] = {name: [] for name in names}

    def __getitem__(self, name: str) -> list[Tensor]:
        return self._calls[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._calls)

    def __len__(self) -> int:
        return len(self._calls)

    def weights(self, name: str) -> Tensor:
        """One module's calls as one (B, H, T, S) tensor: concatenated along the queries.

        Cached decoding calls a layer once per step with T = 1 and a growing S; the steps are
        padded with zeros on the right up to the longest S (keys a step could not see yet), so
        the result equals the weights of one full forward over the same tokens.
        """
        calls = self._calls[name]
        if not calls:
            raise ValueError(f"record_attention: {name!r} recorded nothing")
        S = max(w.size(-1) for w in calls)
        return torch.cat([nn.functional.pad(w, (0, S - w.size(-1))) for w in calls], dim=-2)

    def stack(self, suffix: str = "") -> Tensor:
        """(L, B, H, T, S): :meth:`weights` of every module whose name ends with ``suffix``
        (e.g. "cross_attn", "self_attn"; "" = all), stacked in model order."""
        names = [n for n in self._calls if n.endswith(suffix) and self._calls[n]]
        if not names:
            raise ValueError(f"record_attention: no recorded attention module name ends with {suffix!r} "
                             f"(modules: {', '.join(self._calls)})")
        return torch.stack([self.weights(n) for n in names])


@contextmanager
def record_attention(model: nn.Module) -> Iterator[AttentionRecord]:
    """Collect the attention weights of every :class:`MultiHeadAttention` in ``model`` during the
    forward passes inside the ``with`` block; yields an :class:`AttentionRecord`.

    Names are those of ``model.named_modules()`` ("decoder_layers.0.cross_attn"). Each call
    appends one detached (B, H, T, S) tensor, so a KV-cached decoding loop records one per step.
    Recording costs one extra attention-weights computation per layer call (without autograd);
    a checkpointed layer's recomputation in the backward pass is not recorded again.
    """
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    if not modules:
        raise ValueError(f"record_attention: {type(model).__name__} has no attnlab MultiHeadAttention")
    if any(m.attention_record is not None for _, m in modules):
        raise RuntimeError("record_attention: this model is already being recorded")
    record = AttentionRecord([name for name, _ in modules])
    try:
        for name, m in modules:
            m.attention_record = record[name]
        yield record
    finally:
        for _, m in modules:
            m.attention_record = None
