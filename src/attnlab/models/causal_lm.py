"""The shared machinery of decoder-only language models (GPT, LLaMA, Mixtral, ...).

    ids (B, T) -> embed (+ positions) -> N x CausalLayer -> final norm -> lm_head -> logits (B, T, V)

A model file builds ``token_embedding``, ``layers`` (a ModuleList of
:class:`~attnlab.nn.CausalLayer`), ``norm`` and ``lm_head`` and may override
:meth:`CausalLM.embed` (GPT adds learned positions); this base holds the one forward, the
cache, the checks, initialisation and the auxiliary-loss interface; ``generate`` comes from
:class:`GenerationMixin`, which a causal LM of another kind (a recurrent one) inherits too.

Masks and positions (shape letters as in :mod:`attnlab.nn.attention`; P = cached tokens,
S = P + T): ``attention_mask`` (B, S) is True/1 for real tokens and covers the cached tokens
too; it is combined with the causal triangle inside attention. Without padding and without a
cache the fused SDPA kernel runs with ``is_causal`` (1.2-1.5x faster on CPU than the same
triangle passed as a boolean mask). Without a mask, positions
are ``P + arange(T)``; with one, every slot's position is ``cumsum(mask) - 1`` clamped at 0,
for the queries and for the keys: a left-padded row's first real token is position 0, and
the False slots a speculative decoder leaves for rejected drafts are not counted, so ALiBi
and the T5 bias see true distances, and a padded batch decodes as each row alone.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..nn.cache import LayerCaches
from ..nn.checkpoint import checkpoint
from .pretrained import SavePretrained

__all__ = ["CausalLM", "GenerationMixin", "Headless"]


def check_token_ids(who: str, input_ids: Tensor, vocab_size: int) -> None:
    """ValueError naming ``who`` unless ``input_ids`` is a non-empty (batch, seq) integer tensor of
    ids in [0, vocab_size)."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.size(1) == 0 \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"{who}: input_ids must be a non-empty integer (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    lo, hi = (int(v) for v in input_ids.aminmax())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{who}: token id {hi if hi >= vocab_size else lo} is out of range "
                         f"[0, vocab_size={vocab_size})")


class GenerationMixin:
    """``model.generate(...)`` for any causal LM that meets :func:`attnlab.generate.generate`'s
    model protocol (``forward(ids, attention_mask=, cache=)``, ``new_cache()``, ``config``),
    whatever its state: :class:`CausalLM` with its KV cache, a recurrent LM with an
    :class:`attnlab.nn.cache.RecurrentState` (inherit it beside ``nn.Module``)."""

    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float | None = None, eos_token_id: int | None = None, draft_model=None, **options) -> Tensor:
        """Continue ``input_ids`` (B, T) by up to ``max_new_tokens`` tokens -> (B, T + n).

        Temperature 0 is greedy; ``draft_model`` turns on speculative decoding, ``num_beams`` > 1
        beam search. Generation lives outside the model: this calls
        :func:`attnlab.generate.generate`, which documents the keyword ``options`` (attention_mask,
        repetition_penalty, generator, num_draft_tokens, streamer, pad_token_id, use_cache, stats,
        num_beams, length_penalty).
        """
        from ..generate import generate
        return generate(self, input_ids, max_new_tokens, temperature, top_k, top_p, eos_token_id, draft_model,
                        **options)


class Headless:
    """A language model's bare base (transformers' GPT2Model, MambaModel, ...): list it before the
    language model's class, ``class GPTModel(Headless, GPT)``, and name the class with the head in
    ``with_head``. It drops the head (the tied head holds no weight of its own, so no checkpoint
    key goes with it): forward returns the last hidden state (B, T, E), after the final norm; and
    ``generate`` refuses, naming the checkpoint that generates."""

    with_head = "the language model with its head"

    def __init__(self, config):
        super().__init__(config)
        self.lm_head = nn.Identity()

    def generate(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} has no language-model head, so it does not generate; load a "
                        f"{self.with_head} checkpoint to generate")


class CausalLM(GenerationMixin, SavePretrained, nn.Module):
    """Base of the decoder-only LMs. Subclasses set ``token_embedding``, ``layers``, ``norm``,
    ``lm_head``; ``config`` must have ``vocab_size`` and ``max_seq_len``.

    ``forward(input_ids (B, T), attention_mask=None (B, S), positions=None (B, T) or (T,),
    cache=None) -> logits (B, T, V)``; see the module docstring for masks and positions.
    ``aux_loss()``, ``aux_loss_coef`` and ``aux_stats()`` give a training loop the auxiliary
    loss of the last forward (Mixtral's load balancing) without knowing what produced it.
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
        """Matrices ~ N(0, init_std), biases 0; norms keep their own init (PyTorch's
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
        check_token_ids(type(self).__name__, input_ids, self.config.vocab_size)

    def _padding(self, attention_mask: Tensor | None, B: int, S: int) -> Tensor | None:
        if attention_mask is None:
            return None
        if attention_mask.shape != (B, S):
            raise ValueError(f"{type(self).__name__}: attention_mask must be (batch, cached + new tokens) = "
                             f"{(B, S)}, got {tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        return None if bool(mask.all()) else mask      # no padding: keep the fused causal path

    def _positions(self, positions: Tensor | None, mask: Tensor | None, past: int, B: int, T: int,
                   device, bounded: bool = True) -> tuple[Tensor, Tensor | None]:
        """(query positions (T,) or (B, T), key positions (B, S) or None = arange(S))."""
        keys = None
        if positions is None:
            if mask is None:
                # the keys' positions made once for every layer; the queries' are a view of them,
                # which tells a rotary module that the new keys sit where the queries do
                keys = torch.arange(past + T, device=device)
                positions = keys[past:]
            else:
                keys = (mask.long().cumsum(-1) - 1).clamp(min=0)                 # (B, S)
                positions = keys[:, -T:]
        elif positions.shape not in ((T,), (B, T)) or positions.is_floating_point():
            raise ValueError(f"{type(self).__name__}: positions must be integer (T,) or (B, T) = {(B, T)}, "
                             f"got {positions.dtype} {tuple(positions.shape)}")
        elif past == 0:
            keys = positions                         # without a cache the keys are these tokens
        hi, limit = int(positions.max()), self.config.max_seq_len
        if bounded and hi >= limit:
            raise ValueError(f"{type(self).__name__}: position {hi} is beyond the model's context of {limit} "
                             f"tokens (cached + new)")
        return positions, keys

    def _run(self, layer: nn.Module, x: Tensor, mask, **kwargs) -> Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and kwargs["cache"] is None:
            return checkpoint(layer, x, mask, **kwargs)
        return layer(x, mask, **kwargs)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: LayerCaches | None = None, inputs_embeds: Tensor | None = None) -> Tensor:
        """Token ids (B, T) -> next-token logits (B, T, V).

        ``positions`` (T,) or (B, T) overrides the query positions; without a cache they are
        the keys' positions too (with one, the keys' come from the mask, or are arange(S)).
        ``inputs_embeds`` (B, T, E): the tokens' vectors to use instead of embedding ``input_ids``
        (a vision-language model puts image features among them); the ids still give the shape.
        """
        self._check_ids(input_ids)
        B, T = input_ids.shape
        past = 0 if cache is None else cache.length
        if cache is not None and not isinstance(cache, LayerCaches):
            raise ValueError(f"{type(self).__name__}: cache must be the model's KV cache (model.new_cache()), "
                             f"got {type(cache).__name__}")
        if cache is not None and len(cache.self_attn) != len(self.layers):
            raise ValueError(f"{type(self).__name__}: cache has {len(cache.self_attn)} layers, the model "
                             f"{len(self.layers)}; use model.new_cache()")
        mask = self._padding(attention_mask, B, past + T)
        # a cache that places keys at positions of its own (attention sinks) reads past the context,
        # unless the model also embeds absolute positions (its own embed)
        bounded = cache is None or not cache.rebases_positions or type(self).embed is not CausalLM.embed
        positions, key_positions = self._positions(positions, mask, past, B, T, input_ids.device, bounded)
        x = self.embed(input_ids, positions) if inputs_embeds is None else inputs_embeds
        for i, layer in enumerate(self.layers):
            x = self._run(layer, x, mask, positions=positions, key_positions=key_positions,
                          cache=None if cache is None else cache.self_attn[i])
        return self.lm_head(self.norm(x))

    # ------------------------------------------------------------------ auxiliary losses
    @property
    def aux_loss_coef(self) -> float:
        """Weight of :meth:`aux_loss` in the training loss (0.0 for a model without one)."""
        return 0.0

    def aux_loss(self) -> Tensor | None:
        """The auxiliary training loss of the last forward, a scalar fp32 tensor with its graph,
        to add as ``aux_loss_coef * aux_loss()`` to the mean per-token loss; None for a model
        without one (the dense ones). Read from the model itself, so it works when the forward
        ran through a DDP wrapper or with gradient checkpointing."""
        return None

    def aux_stats(self) -> dict[str, Tensor]:
        """Statistics of the last forward worth logging beside the loss, each a detached scalar
        averaged over the real tokens (Mixtral: each expert's share of the routing); {} by default."""
        return {}

