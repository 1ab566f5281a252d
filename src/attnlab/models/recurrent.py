"""What the recurrent language models (Mamba, Mamba-2, Mamba-3, RWKV-4, RWKV-7) share: a stack of recurrent layers whose decoding state is a fixed
number of tensors per layer in an :class:`attnlab.nn.cache.RecurrentState`.

A subclass builds ``token_embedding``, ``layers``, ``norm`` and ``lm_head``, says how many state
tensors each layer keeps (``state_per_layer``) and implements ``embed(ids)`` and
``run_layers(x, real, states) -> (x, states)`` (``states``: one tuple per layer, None for an empty
state). This base holds the checks, the cache bookkeeping and the choice between consuming the
positions at once and one at a time:

- at once when there is no padding, or when the padding precedes every row's real tokens and
  the state is empty (a model zeroes the padded inputs and gives the padded keys no weight,
  which is exact there);
- one position at a time otherwise (holes left by rejected drafts, a rewind point marked), each
  layer carrying its state over a padded slot unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.cache import RecurrentState
from .causal_lm import GenerationMixin, check_token_ids
from .pretrained import SavePretrained

__all__ = ["RecurrentLM", "zero_padding", "keep_at_padding", "causal_conv"]


def zero_padding(x: Tensor, real: Tensor | None) -> Tensor:
    """x (b, l, c) with the padded positions (``real`` False) zeroed."""
    return x if real is None else x * real[..., None].to(x.dtype)


def causal_conv(window: Tensor, conv: nn.Conv1d) -> Tensor:
    """A depthwise ``conv`` (kernel k, groups = channels) over ``window`` (b, c, k - 1 + l) -> (b, c, l).

    One decoding step (l == 1) is the window weighted by the kernel and summed: on CPU, conv1d's
    set-up for a k-wide input costs several times the arithmetic (benchmarks/results/code.md), once
    per layer and token."""
    if window.size(-1) == conv.kernel_size[0]:
        out = (window * conv.weight[:, 0]).sum(-1, keepdim=True)
        return out if conv.bias is None else out + conv.bias[:, None]
    return F.conv1d(window, conv.weight, conv.bias, groups=conv.groups)


def keep_at_padding(real: Tensor | None, new, old):
    """One position's state: ``new`` where the slot is real, ``old`` where it is padding; ``real``
    (b, 1) or None; ``new`` and ``old`` tuples of (b, ...) tensors."""
    if real is None or old is None:
        return new
    return tuple(torch.where(real[:, 0].view(-1, *[1] * (n.dim() - 1)), n, o) for n, o in zip(new, old))


class RecurrentLM(GenerationMixin, SavePretrained, nn.Module):
    """Base of the recurrent language models (see the module docstring)."""

    state_per_layer: int

    def new_cache(self) -> RecurrentState:
        """The decoding state: ``state_per_layer`` tensors per layer, empty until the first forward."""
        return RecurrentState([None] * (self.state_per_layer * len(self.layers)))

    def checkpointing(self, state) -> bool:
        """Whether a layer is run under activation checkpointing (training, no state)."""
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled() and state is None

    def _check(self, input_ids: Tensor, attention_mask: Tensor | None, cache) -> Tensor | None:
        who = type(self).__name__
        check_token_ids(who, input_ids, self.config.vocab_size)
        size = self.state_per_layer * len(self.layers)
        if cache is not None and (not isinstance(cache, RecurrentState) or len(cache.tensors) != size):
            raise ValueError(f"{who}: cache must be the model's decoding state (model.new_cache()), got "
                             f"{type(cache).__name__}")
        if attention_mask is None:
            return None
        (b, l), past = input_ids.shape, 0 if cache is None else cache.length
        if attention_mask.shape != (b, past + l):
            raise ValueError(f"{who}: attention_mask must be (batch, cached + new tokens) = {(b, past + l)}, "
                             f"got {tuple(attention_mask.shape)}")
        real = attention_mask.bool()[:, past:]
        return None if bool(real.all()) else real

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache=None) -> Tensor:
        """(b, l) ids -> the final norm's output (b, l, E)."""
        real = self._check(input_ids, attention_mask, cache)
        fresh = cache is None or cache.tensors[0] is None
        at_once = (real is None or fresh and bool((real[:, 1:] >= real[:, :-1]).all())) \
            and not (cache is not None and cache.stepwise)
        x = self.embed(input_ids)
        if at_once:
            x = self._consume(x, real, cache)
        else:
            x = torch.cat([self._consume(x[:, t:t + 1], None if real is None else real[:, t:t + 1], cache)
                           for t in range(x.size(1))], dim=1)
        return self.norm(x)

    def _consume(self, x: Tensor, real: Tensor | None, cache) -> Tensor:
        k = self.state_per_layer
        if cache is None or cache.tensors[0] is None:
            states = [None] * len(self.layers)
        else:
            states = [tuple(cache.tensors[k * i:k * (i + 1)]) for i in range(len(self.layers))]
        x, new = self.run_layers(x, real, states)
        if cache is not None:
            if x.size(1) == 1:
                new = [keep_at_padding(real, n, s) for n, s in zip(new, states)]
            cache.tensors = [t for state in new for t in state]
            cache.advance(x.size(1))
        return x

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: RecurrentState | None = None) -> Tensor:
        return self.lm_head(self.hidden_states(input_ids, attention_mask, cache))
