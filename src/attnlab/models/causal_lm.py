"""The shared machinery of decoder-only language models (GPT, LLaMA, Mixtral, ...).

    ids (B, T) -> embed (+ positions) -> N x CausalLayer -> final norm -> lm_head -> logits (B, T, V)

A model file builds ``token_embedding``, ``layers`` (a ModuleList of :class:`CausalLayer`),
``norm`` and ``lm_head`` and may override :meth:`CausalLM.embed` (GPT adds learned positions);
this base holds the one forward, the cache, the checks, initialisation and ``generate``.

Masks and positions (shape letters as in :mod:`attnlab.nn.attention`; P = cached tokens,
S = P + T): ``attention_mask`` (B, S) is True/1 for real tokens and covers the cached tokens
too; it is combined with the causal triangle inside attention. Without padding and without a
cache the fused SDPA kernel runs with ``is_causal`` (pitfall 24). Positions default to
``P + arange(T)``, or, when a mask is given, to ``cumsum(mask) - 1`` clamped at 0 (left-padded
batches: every row's first real token is position 0; pitfalls 9 and 11).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..nn.block import EncoderLayer
from ..nn.cache import KVCache, LayerCaches
from ..nn.mlp import SparseMoE

__all__ = ["CausalLayer", "CausalLM"]


class CausalLayer(EncoderLayer):
    """One decoder-only block (EncoderLayer's wiring with causal attention, a cache and positions):

        Pre-Norm:  x = x + Attn(Norm(x));  x = x + FF(Norm(x))

    ``forward(x (B, T, E), key_padding_mask (B, S) or None, positions (T,) or (B, T), cache,
    token_mask (B, T) or None) -> (x (B, T, E), router logits (B*T, X) or None)``. A
    :class:`SparseMoE` feed-forward gets ``token_mask`` (padding is routed nowhere) and returns
    its router logits; a dense one returns None.
    """

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None, *, positions: Tensor | None = None,
                cache: KVCache | None = None, token_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        h = self.sub1.pre(x)
        a, _ = self.self_attn(h, key_padding_mask=key_padding_mask, is_causal=True, cache=cache, positions=positions)
        x = self.sub1.post(x, a)
        h = self.sub2.pre(x)
        if isinstance(self.ff, SparseMoE):
            y, router_logits = self.ff(h, token_mask)
        else:
            y, router_logits = self.ff(h), None
        return self.sub2.post(x, y), router_logits


class CausalLM(nn.Module):
    """Base of the decoder-only LMs. Subclasses set ``token_embedding``, ``layers``, ``norm``,
    ``lm_head``; ``config`` must have ``vocab_size`` and ``max_seq_len``.

    ``forward(input_ids (B, T), attention_mask=None (B, S), positions=None (B, T) or (T,),
    cache=None) -> logits (B, T, V)``; see the module docstring for masks and positions.
    """

    init_std = 0.02                       # N(0, 0.02) for every matrix, as GPT-2 and LLaMA

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False

    # ------------------------------------------------------------------ building
    def residual_projections(self) -> list[nn.Parameter]:
        """Weights writing into the residual stream that get std / sqrt(2 N) (GPT-2); none by default."""
        return []

    def reset_parameters(self) -> None:
        """Matrices ~ N(0, init_std), biases 0; norms keep their own init (pitfall 23: PyTorch's
        N(0, 1) embedding tied to the head gives huge logits and a denormal-filled, slow CPU backward)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, self.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        std = self.init_std / math.sqrt(2 * len(self.layers))
        for p in self.residual_projections():
            nn.init.normal_(p, 0.0, std)

    def new_cache(self) -> LayerCaches:
        """An empty KV cache for step-by-step decoding: pass it to every forward call."""
        return LayerCaches(len(self.layers), cross=False)

    # ------------------------------------------------------------------ forward
    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Token ids (B, T) -> (B, T, E). Positions are used by models with absolute positions."""
        return self.token_embedding(input_ids)

    def _check_ids(self, input_ids: Tensor) -> None:
        who, V = type(self).__name__, self.config.vocab_size
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.size(1) == 0 \
                or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"{who}: input_ids must be a non-empty integer (batch, seq) tensor, got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                             f"{tuple(getattr(input_ids, 'shape', ()))}")
        lo, hi = (int(v) for v in input_ids.aminmax())
        if lo < 0 or hi >= V:
            raise ValueError(f"{who}: token id {hi if hi >= V else lo} is out of range [0, vocab_size={V})")

    def _padding(self, attention_mask: Tensor | None, B: int, S: int) -> Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.shape != (B, S):
            raise ValueError(f"{type(self).__name__}: attention_mask must be (batch, cached + new tokens) = "
                             f"{(B, S)}, got {tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        return None if bool(mask.all()) else mask      # no padding: keep the fused causal path

    def _positions(self, positions: Tensor | None, mask: Tensor | None, past: int, B: int, T: int,
                   device) -> Tensor:
        if positions is None:
            if mask is None:
                positions = torch.arange(past, past + T, device=device)
            else:
                positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        elif positions.shape not in ((T,), (B, T)) or positions.is_floating_point():
            raise ValueError(f"{type(self).__name__}: positions must be integer (T,) or (B, T) = {(B, T)}, "
                             f"got {positions.dtype} {tuple(positions.shape)}")
        hi, limit = int(positions.max()), self.config.max_seq_len
        if hi >= limit:
            raise ValueError(f"{type(self).__name__}: position {hi} is beyond the model's context of {limit} "
                             f"tokens (cached + new)")
        return positions

    def _run(self, layer: nn.Module, x: Tensor, mask, **kwargs):
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and kwargs["cache"] is None:
            return checkpoint(layer, x, mask, use_reentrant=False, **kwargs)
        return layer(x, mask, **kwargs)

    def forward_with_router_logits(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                                   positions: Tensor | None = None, cache: LayerCaches | None = None,
                                   ) -> tuple[Tensor, list[Tensor]]:
        """:meth:`forward` plus the router logits of every mixture-of-experts layer, a list of
        (B*T, X) tensors (empty for a dense model), for the load-balancing loss."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        past = 0 if cache is None else cache.length
        if cache is not None and len(cache.self_attn) != len(self.layers):
            raise ValueError(f"{type(self).__name__}: cache has {len(cache.self_attn)} layers, the model "
                             f"{len(self.layers)}; use model.new_cache()")
        mask = self._padding(attention_mask, B, past + T)
        positions = self._positions(positions, mask, past, B, T, input_ids.device)
        x = self.embed(input_ids, positions)
        token_mask = None if mask is None else mask[:, -T:]
        router_logits = []
        for i, layer in enumerate(self.layers):
            x, r = self._run(layer, x, mask, positions=positions, token_mask=token_mask,
                             cache=None if cache is None else cache.self_attn[i])
            if r is not None:
                router_logits.append(r)
        return self.lm_head(self.norm(x)), router_logits

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: LayerCaches | None = None) -> Tensor:
        """Token ids (B, T) -> next-token logits (B, T, V)."""
        return self.forward_with_router_logits(input_ids, attention_mask, positions, cache)[0]

    # ------------------------------------------------------------------ generation and saving
    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | None = None, draft_model=None, **options) -> Tensor:
        """Continue ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens -> (B, T + n).

        Temperature 0 is greedy; ``draft_model`` turns on speculative decoding. Generation lives
        outside the model: this calls :func:`attnlab.generate.generate`, which documents the keyword
        ``options`` (attention_mask, repetition_penalty, generator, num_draft_tokens, streamer,
        pad_token_id, use_cache, stats).
        """
        from ..generate import generate
        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, draft_model,
                        **options)

    def save_pretrained(self, path) -> None:
        """Write a Hugging Face directory (config.json + model.safetensors) for the model's registered
        architecture; see attnlab.models.pretrained (attnlab.hub is its public face)."""
        from .pretrained import save_pretrained      # models/pretrained.py imports the registry, not this file
        save_pretrained(self, path)
