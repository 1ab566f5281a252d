"""The machinery every BERT-like bidirectional encoder shares (BERT, ELECTRA): embeddings, the
Post-Norm stack, the input checks and the forward, the [CLS] pooler and the tied masked-LM head.

    ids, token types, positions -> BertEmbeddings (token + token-type + position, LayerNorm, dropout,
        and a projection when the embeddings are narrower than the encoder)
        -> N x EncoderLayer, Post-Norm: x = LayerNorm(x + Attn(x)); x = LayerNorm(x + FFN(x))
        -> hidden (B, T, E)

A model file subclasses :class:`BertEncoder`, adds its heads and calls ``reset_parameters()``
once built; its forward is ``head(self.encode(input_ids, attention_mask, token_type_ids,
position_ids))``. ``attention_mask`` (B, T) is True/1 for real tokens; it reaches attention as a
(B, 1, 1, T) boolean key mask on the fused SDPA path (no mask at all when nothing is padded), so
a real token's output never depends on padding. Q, K and V are one fused projection
(``qkv_proj``). The config needs BERT's fields (:class:`attnlab.models.bert.BertConfig`).
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import EncoderLayer
from ..nn.checkpoint import checkpoint
from ..nn.mlp import FeedForward, make_activation
from ..nn.norm import LayerNorm
from ..nn.position import LearnedPositionalEmbedding

__all__ = ["BertEmbeddings", "BertEncoder", "Pooler", "MaskedLMHead"]


class BertEmbeddings(nn.Module):
    """token + token-type + position embeddings (width ``embedding_size``), LayerNorm, dropout, and
    (ELECTRA, when ``embedding_size`` != d_model) a linear ``project`` up to d_model.

    ``forward(input_ids (B, T), token_type_ids (B, T), positions (T,) or (B, T)) -> (B, T, E)``."""

    def __init__(self, config, embedding_size: int | None = None):
        super().__init__()
        c, width = config, embedding_size or config.d_model
        self.token = nn.Embedding(c.vocab_size, width, padding_idx=c.pad_token_id)
        self.token_type = nn.Embedding(c.type_vocab_size, width)
        self.position = LearnedPositionalEmbedding(c.max_position_embeddings, width)
        self.norm = LayerNorm(width, c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)
        self.project = nn.Linear(width, c.d_model) if width != c.d_model else None

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.position(self.token(input_ids) + self.token_type(token_type_ids), positions=positions)
        x = self.dropout(self.norm(x))
        return x if self.project is None else self.project(x)


class BertEncoder(nn.Module):
    """The embeddings and the Post-Norm stack every BERT-like model shares, and the pooler where
    ``pooler`` is set; subclasses add heads and call :meth:`reset_parameters` once built.

    ``encode(input_ids (B, T), attention_mask=None (B, T) True/1 = real token, token_type_ids=None
    (B, T) (default all 0, segment A), position_ids=None (T,) or (B, T) (default arange(T)))
    -> hidden (B, T, E)``, raising ValueError for ids, types or positions out of range, a
    sequence longer than ``max_position_embeddings`` and masks or types of the wrong shape.
    ``pool(hidden) -> (B, E)`` = tanh(hidden[:, 0] W_p + b_p), the [CLS] summary, where ``pooler``
    is "trained" (a head reads it) or "kept" (see :class:`Pooler`).
    """

    init_std = 0.02                        # N(0, 0.02) for matrices and embeddings, as BERT

    def __init__(self, config, embedding_size: int | None = None, pooler: str | None = None):
        super().__init__()
        if pooler not in (None, "kept", "trained"):
            raise ValueError(f"{type(self).__name__}: pooler must be None, 'kept' or 'trained', got {pooler!r}")
        self.config, c = config, config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(c, embedding_size)
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, norm_first=False, norm="layernorm",
                         eps=c.layer_norm_eps,
                         self_attn=MultiHeadAttention(c.d_model, c.num_heads, c.attention_dropout, fused_qkv=True),
                         ff=FeedForward(c.d_model, c.d_ff, 0.0, activation=c.activation))
            for _ in range(c.num_layers))
        self.pooler = None if pooler is None else Pooler(c.d_model, trainable=pooler == "trained")

    def reset_parameters(self) -> None:
        """Matrices and embeddings ~ N(0, 0.02), biases 0, the padding token's embedding 0, norms
        weight 1 and bias 0, as BERT: PyTorch's N(0, 1) embedding, tied to the masked-LM decoder,
        would give huge logits and a CPU backward slowed by denormal floats."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, (nn.Linear, nn.Embedding, LearnedPositionalEmbedding, Pooler)):
                    module.weight.normal_(0.0, self.init_std)
                if isinstance(module, (nn.Linear, Pooler)) and module.bias is not None:
                    module.bias.zero_()
            pad = self.embeddings.token.padding_idx          # after the loop: a tied decoder shares the row
            if pad is not None:
                self.embeddings.token.weight[pad].zero_()

    def pool(self, hidden: Tensor) -> Tensor:
        if self.pooler is None:
            raise TypeError(f"{type(self).__name__} has no pooler (transformers' model of this class has none)")
        return self.pooler(hidden)

    # ------------------------------------------------------------------ checks
    def _ids(self, what: str, ids: Tensor, shape: tuple | None, high: int, limit: str) -> None:
        """``ids`` must be an integer tensor of ``shape`` (or any (B, T)) with values in [0, high)."""
        who = type(self).__name__
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool \
                or (ids.shape != shape if shape else ids.dim() != 2 or ids.size(1) == 0):
            raise ValueError(f"{who}: {what} must be an integer tensor of shape {shape or '(batch, seq)'}, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        lo, hi = (int(v) for v in ids.aminmax())
        if lo < 0 or hi >= high:
            raise ValueError(f"{who}: {what} holds {hi if hi >= high else lo}, outside [0, {limit}={high})")

    def _inputs(self, input_ids, attention_mask, token_type_ids, position_ids):
        """Checked (mask or None when nothing is padded, token types, positions)."""
        c, who = self.config, type(self).__name__
        self._ids("input_ids", input_ids, None, c.vocab_size, "vocab_size")
        B, T = input_ids.shape
        if position_ids is None:
            if T > c.max_position_embeddings:
                raise ValueError(f"{who}: a sequence of {T} tokens is longer than max_position_embeddings="
                                 f"{c.max_position_embeddings}")
            position_ids = torch.arange(T, device=input_ids.device)
        else:
            shape = (T,) if position_ids.dim() == 1 else (B, T)
            self._ids("position_ids", position_ids, shape, c.max_position_embeddings, "max_position_embeddings")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        else:
            self._ids("token_type_ids", token_type_ids, (B, T), c.type_vocab_size, "type_vocab_size")
        mask = None
        if attention_mask is not None:
            if not isinstance(attention_mask, Tensor) or attention_mask.shape != (B, T):
                raise ValueError(f"{who}: attention_mask must be (batch, seq) = {(B, T)}, True/1 for real tokens, "
                                 f"got {tuple(getattr(attention_mask, 'shape', ()))}")
            mask = attention_mask.bool()
            mask = None if bool(mask.all()) else mask      # no padding: attention without a mask
        return mask, token_type_ids, position_ids

    # ------------------------------------------------------------------ forward
    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
               position_ids: Tensor | None = None) -> Tensor:
        mask, token_type_ids, position_ids = self._inputs(input_ids, attention_mask, token_type_ids, position_ids)
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, None, mask)
            else:
                x = layer(x, None, mask)
        return x

    def save_pretrained(self, path) -> None:
        """Write a Hugging Face directory for the model's registered architecture (see
        attnlab.models.pretrained; attnlab.hub is its public face)."""
        from .pretrained import save_pretrained
        save_pretrained(self, path)


class Pooler(nn.Module):
    """pool(hidden) = tanh(hidden[:, 0] W + b): hidden (B, T, E) -> the [CLS] token's summary (B, E).

    ``trainable`` False keeps W and b as buffers: loaded and saved with the checkpoint, never
    trained. The bare encoder does that: its forward returns the hidden state, so nothing it
    computes reaches the pooler, yet transformers' BertModel checkpoints carry one."""

    def __init__(self, d_model: int, trainable: bool = True):
        super().__init__()
        weight, bias = torch.empty(d_model, d_model), torch.zeros(d_model)
        if trainable:
            self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(F.linear(hidden[:, 0], self.weight, self.bias))


class MaskedLMHead(nn.Module):
    """logits = LayerNorm(act(h W_t + b_t)) W_emb^T + b: hidden (B, T, E) -> (B, T, V).

    ``dense`` maps E to the embedding width; ``decoder`` shares its weight with the token
    embedding (one tensor, stored once) and has its own output bias."""

    def __init__(self, d_model: int, embedding: nn.Embedding, activation: str, eps: float):
        super().__init__()
        width = embedding.embedding_dim
        self.dense = nn.Linear(d_model, width)
        self.act = make_activation(activation)
        self.norm = LayerNorm(width, eps)
        self.decoder = nn.Linear(width, embedding.num_embeddings)
        self.decoder.weight = embedding.weight

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.norm(self.act(self.dense(hidden))))
