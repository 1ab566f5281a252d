"""The machinery every bidirectional encoder shares (BERT, ELECTRA, ALBERT, DeBERTa-v2): input
checks, initialisation, the embeddings, the Post-Norm stack, the [CLS] pooler, the tied masked-LM
head, and the names these take in a Hugging Face checkpoint (weights, activations, labels).

    ids, token types, positions -> BertEmbeddings (token + token-type + position, LayerNorm, dropout,
        and a projection when the embeddings are narrower than the encoder)
        -> N x EncoderLayer, Post-Norm: x = LayerNorm(x + Attn(x)); x = LayerNorm(x + FFN(x))
        -> hidden (B, T, E)

Every model subclasses :class:`Encoder` (BERT and ELECTRA through :class:`BertEncoder`; ALBERT
with its shared layers and DeBERTa with its own embeddings and attention directly), adds its
heads and calls ``reset_parameters()`` once built; its forward is ``head(self.encode(input_ids,
attention_mask, token_type_ids, position_ids))``. ``attention_mask`` (B, T) is True/1 for real tokens; it
reaches attention as a (B, 1, 1, T) boolean key mask on the fused SDPA path (no mask at all when
nothing is padded), so a real token's output never depends on padding. A padded batch runs the
layers on its real tokens alone (:class:`~attnlab.nn.packing.Packing`): every projection and
feed-forward skips the padding, and the hidden state is zero at padded positions (transformers
computes values there that nothing should read; torch's TransformerEncoder fast path gives zeros).
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
from ..nn.packing import Packing
from ..nn.position import LearnedPositionalEmbedding
from .convert import Rule
from .pretrained import SavePretrained

__all__ = ["ACT_FROM_HF", "ACT_TO_HF", "check_config", "check_inputs", "init_weights", "BertEmbeddings",
           "EMBEDDING_RULES", "layer_rules", "Encoder", "BertEncoder", "Pooler", "MaskedLMHead", "mlm_head_rules",
           "masked_rows",
           "activation_from_hf", "labels_from_hf", "labels_to_hf"]

# Hugging Face's activation names <-> ours (make_activation's; "gelu_new" is GPT-2's tanh approximation)
ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


# ----------------------------------------------------------------------------- checks and init
def check_config(cfg, positive: tuple[str, ...], fractions: tuple[str, ...],
                 activations: tuple[str, ...] = ("activation",)) -> None:
    """The checks every encoder config makes, each a ValueError naming the field: the sizes
    ``positive``, d_model divisible by num_heads, the dropouts ``fractions`` (None: unset) in
    [0, 1), ``activations`` ones config.json can name, the padding id a token, and id2label (when
    set) naming the classes 0 .. num_labels - 1."""
    who = type(cfg).__name__
    for f in positive:
        if getattr(cfg, f) <= 0:
            raise ValueError(f"{who}: {f} must be positive, got {getattr(cfg, f)}")
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"{who}: d_model ({cfg.d_model}) is not divisible by num_heads ({cfg.num_heads})")
    for f in fractions:
        if getattr(cfg, f) is not None and not 0.0 <= getattr(cfg, f) < 1.0:
            raise ValueError(f"{who}: {f} must be in [0, 1), got {getattr(cfg, f)}")
    for f in activations:
        if getattr(cfg, f) not in ACT_TO_HF:
            raise ValueError(f"{who}: {f} must be one of {tuple(ACT_TO_HF)}, got {getattr(cfg, f)!r}")
    if cfg.pad_token_id is not None and not 0 <= cfg.pad_token_id < cfg.vocab_size:
        raise ValueError(f"{who}: pad_token_id {cfg.pad_token_id} is outside [0, vocab_size={cfg.vocab_size})")
    if cfg.id2label is not None:
        try:                                     # a config read back from JSON has string keys
            cfg.id2label = {int(i): str(name) for i, name in cfg.id2label.items()}
        except (TypeError, ValueError):
            pass                                 # not class ids: refused just below
        if cfg.num_labels <= 0 or set(cfg.id2label) != set(range(cfg.num_labels)):
            raise ValueError(f"{who}: id2label must name classes 0 .. num_labels - 1 ({cfg.num_labels}), "
                             f"got ids {sorted(cfg.id2label, key=str)}")


def _check_ids(who: str, what: str, ids, shape: tuple | None, high: int, limit: str) -> None:
    """``ids`` must be a non-empty integer tensor of ``shape`` (or any (B, T)) with values in [0, high)."""
    if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.numel() == 0 \
            or (ids.shape != shape if shape else ids.dim() != 2):
        raise ValueError(f"{who}: {what} must be a non-empty integer tensor of shape {shape or '(batch, seq)'}, "
                         f"got {getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
    lo, hi = (int(v) for v in ids.aminmax())
    if lo < 0 or hi >= high:
        raise ValueError(f"{who}: {what} holds {hi if hi >= high else lo}, outside [0, {limit}={high})")


def check_inputs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None,
                 token_type_ids: Tensor | None = None, position_ids: Tensor | None = None):
    """Validate an encoder's inputs against ``model.config`` (vocab_size, max_position_embeddings,
    type_vocab_size) and return (mask (B, T) bool or None when nothing is padded, token types
    (default all 0, segment A), positions (default arange(T))). One clear ValueError per problem:
    ids, types or positions not integer tensors of the right shape or out of range, a sequence
    longer than the positions, a mask of another shape."""
    c, who = model.config, type(model).__name__
    _check_ids(who, "input_ids", input_ids, None, c.vocab_size, "vocab_size")
    B, T = input_ids.shape
    if position_ids is None:
        if T > c.max_position_embeddings:
            raise ValueError(f"{who}: a sequence of {T} tokens is longer than max_position_embeddings="
                             f"{c.max_position_embeddings}")
        position_ids = torch.arange(T, device=input_ids.device)
    else:
        shape = (T,) if position_ids.dim() == 1 else (B, T)
        _check_ids(who, "position_ids", position_ids, shape, c.max_position_embeddings, "max_position_embeddings")
    if token_type_ids is None:
        token_type_ids = torch.zeros_like(input_ids)
    else:
        _check_ids(who, "token_type_ids", token_type_ids, (B, T), c.type_vocab_size, "type_vocab_size")
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or attention_mask.shape != (B, T):
            raise ValueError(f"{who}: attention_mask must be (batch, seq) = {(B, T)}, True/1 for real tokens, "
                             f"got {tuple(getattr(attention_mask, 'shape', ()))}")
        mask = attention_mask.bool()
        mask = None if bool(mask.all()) else mask          # no padding: attention without a mask
    return mask, token_type_ids, position_ids


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """Matrices and embedding tables ~ N(0, std), biases 0, norm scales left at 1, a padding
    token's embedding 0, as BERT-style checkpoints start: PyTorch's N(0, 1) embedding, tied to the
    masked-LM decoder, would give huge logits and a CPU backward slowed by denormal floats. A kept
    :class:`Pooler`'s buffers are initialised like the parameters they stand in for."""
    kept = [(f"{name}.{n}", b) for name, m in model.named_modules() if isinstance(m, Pooler)
            for n, b in m.named_buffers(recurse=False)]
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *kept]:
            if t.dim() >= 2:
                t.normal_(0.0, std)
            elif name.endswith("bias"):
                t.zero_()
        for m in model.modules():                    # after the loop: a tied decoder shares the row
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()


# ----------------------------------------------------------------------------- the encoder
class BertEmbeddings(nn.Module):
    """token + token-type + position embeddings (width ``embedding_size``), LayerNorm, dropout, and
    (ELECTRA, ALBERT, when ``embedding_size`` != d_model) a linear ``project`` up to d_model.

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


# the embeddings' weights (relative to the base model), named alike in every BERT-style checkpoint
EMBEDDING_RULES = [
    Rule("embeddings.token.weight", "embeddings.word_embeddings.weight"),
    Rule("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight"),
    Rule("embeddings.position.weight", "embeddings.position_embeddings.weight"),
    Rule("embeddings.norm.{p}", "embeddings.LayerNorm.{p}"),
]


def layer_rules(*pairs: tuple[str, str]) -> list[Rule]:
    """The Post-Norm layers' weights <-> transformers' "encoder.layer.{i}." names (BERT, ELECTRA,
    DeBERTa): the attention output, the feed-forward and both norms, and ``pairs`` (ours, theirs)
    of the family's own, its Q/K/V projections."""
    return [Rule(f"layers.{{i}}.{ours}.{{p}}", f"encoder.layer.{{i}}.{theirs}.{{p}}") for ours, theirs in [
        *pairs, ("self_attn.out_proj", "attention.output.dense"), ("self_attn_norm", "attention.output.LayerNorm"),
        ("ff.linear1", "intermediate.dense"), ("ff.linear2", "output.dense"), ("ff_norm", "output.LayerNorm")]]


class Encoder(SavePretrained, nn.Module):
    """The base of every bidirectional encoder: a subclass builds ``embeddings`` (called as
    ``embeddings(input_ids, token_type_ids, positions)``), the layers :meth:`stack` yields in
    order (default ``self.layers``) and ``pooler`` (a :class:`Pooler` or None), then its heads.

    ``encode(input_ids (B, T), attention_mask=None (B, T) True/1 = real token, token_type_ids=None
    (B, T) (default all 0, segment A), position_ids=None (T,) or (B, T) (default arange(T)),
    first_only=False) -> hidden (B, T, E)``, checked by :func:`check_inputs`; each layer's
    activations are recomputed in backward when ``gradient_checkpointing`` is set. ``first_only``
    (the classifiers, whose heads read [CLS] alone): the last layer computes the first position
    only, its keys and values over every token, and the result is (B, 1, E) -- ~1/N of the
    encoder's work saved, N the number of layers. ``pool(hidden) -> (B, E)`` =
    tanh(hidden[:, 0] W_p + b_p), the [CLS] summary.
    """

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False

    def stack(self):
        return self.layers

    def reset_parameters(self) -> None:
        """:func:`init_weights`: N(0, 0.02) matrices and embeddings, as BERT."""
        init_weights(self)

    def pool(self, hidden: Tensor) -> Tensor:
        if self.pooler is None:
            raise TypeError(f"{type(self).__name__} has no pooler (transformers' model of this class has none)")
        return self.pooler(hidden)

    def encode(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
               position_ids: Tensor | None = None, first_only: bool = False) -> Tensor:
        mask, token_type_ids, position_ids = check_inputs(self, input_ids, attention_mask, token_type_ids,
                                                          position_ids)
        x = self.embeddings(input_ids, token_type_ids, position_ids)
        # a padded batch runs the layers on its real tokens alone (attnlab.nn.packing)
        packing = Packing.of(mask)
        if packing is not None:
            x = packing.pack(x)
        layers = list(self.stack())
        for i, layer in enumerate(layers):
            # a head that reads the first position alone needs only its row of the last layer
            # (unless its attention weights are being recorded, which want every query)
            first = first_only and i == len(layers) - 1 and layer.self_attn.attention_record is None
            if first and packing is not None:
                x, packing = packing.unpack(x), None
            key_mask = mask if packing is None else None
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, None, key_mask, packing=packing, first_only=first)
            else:
                x = layer(x, None, key_mask, packing=packing, first_only=first)
        return x if packing is None else packing.unpack(x)


class BertEncoder(Encoder):
    """BERT's and ELECTRA's :class:`Encoder`: :class:`BertEmbeddings` (of width ``embedding_size``,
    default d_model), ``num_layers`` Post-Norm layers whose Q, K and V are one fused projection
    (``qkv_proj``), and the pooler where ``pooler`` is "trained" (a head reads it) or "kept" (see
    :class:`Pooler`). The config needs BERT's fields (:class:`attnlab.models.bert.BertConfig`).
    """

    def __init__(self, config, embedding_size: int | None = None, pooler: str | None = None):
        super().__init__(config)
        c = config
        self.embeddings = BertEmbeddings(c, embedding_size)
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, norm_first=False, norm="layernorm",
                         eps=c.layer_norm_eps,
                         self_attn=MultiHeadAttention(c.d_model, c.num_heads, c.attention_dropout, fused_qkv=True),
                         ff=FeedForward(c.d_model, c.d_ff, 0.0, activation=c.activation))
            for _ in range(c.num_layers))
        self.pooler = Pooler.make(c.d_model, pooler, type(self).__name__)


# ----------------------------------------------------------------------------- heads
def masked_rows(model: nn.Module, hidden: Tensor, masked_positions: Tensor | None) -> Tensor:
    """What a masked-LM head scores: every position of ``hidden`` (B, T, E), or, given
    ``masked_positions`` (B, T) bool, only those rows, (M, E) in row-major order. Pre-training
    reads the loss at the ~15 % of positions it masked, and the head's vocabulary-wide product is
    the largest in the model: scoring the masked rows alone saves it on the other ~85 %."""
    if masked_positions is None:
        return hidden
    if not isinstance(masked_positions, Tensor) or masked_positions.dtype != torch.bool \
            or masked_positions.shape != hidden.shape[:2]:
        raise ValueError(f"{type(model).__name__}: masked_positions must be a (batch, seq) = {tuple(hidden.shape[:2])} "
                         f"bool tensor, got {getattr(masked_positions, 'dtype', type(masked_positions).__name__)} "
                         f"{tuple(getattr(masked_positions, 'shape', ()))}")
    return hidden[masked_positions]


class Pooler(nn.Module):
    """pool(hidden) = tanh(hidden[:, 0] W + b): hidden (B, T, E) -> the [CLS] token's summary (B, E).

    ``trainable`` False keeps W and b as buffers: loaded and saved with the checkpoint, never
    trained. The bare encoders do that: their forward returns the hidden state, so nothing it
    computes reaches the pooler, yet transformers' BertModel and AlbertModel checkpoints carry one.
    Such a kept pooler says so in :meth:`unread_weights`, so a checkpoint without one (transformers'
    ``BertModel(add_pooling_layer=False)``) loads too, with a warning."""

    def __init__(self, d_model: int, trainable: bool = True):
        super().__init__()
        weight, bias = torch.empty(d_model, d_model), torch.zeros(d_model)
        if trainable:
            self.weight, self.bias = nn.Parameter(weight), nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)

    @classmethod
    def make(cls, d_model: int, kind: str | None, who: str) -> Pooler | None:
        """None (no pooler), "kept" (buffers) or "trained" (parameters)."""
        if kind not in (None, "kept", "trained"):
            raise ValueError(f"{who}: pooler must be None, 'kept' or 'trained', got {kind!r}")
        return None if kind is None else cls(d_model, trainable=kind == "trained")

    def unread_weights(self) -> tuple[str, ...]:
        """The tensors of this module that no output of the model's forward reads: a loader may
        go without them (see :func:`attnlab.models.convert.unread_tensors`)."""
        return () if isinstance(self.weight, nn.Parameter) else ("weight", "bias")

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(F.linear(hidden[:, 0], self.weight, self.bias))


class MaskedLMHead(nn.Module):
    """logits = LayerNorm(act(h W_t + b_t)) W_emb^T + b: hidden (B, T, E) -> (B, T, V).

    ``dense`` maps E to the embedding width (narrower under ALBERT's and ELECTRA's factorised
    embeddings); ``decoder`` shares its weight with the token embedding (one tensor, stored once)
    and has its own output bias, the only output weight a checkpoint holds."""

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


def mlm_head_rules(ours: str, dense: str, norm: str, decoder: str, bias: str) -> list[Rule]:
    """A :class:`MaskedLMHead` called ``ours`` <-> its checkpoint names."""
    return [Rule(f"{ours}.dense.{{p}}", f"{dense}.{{p}}"), Rule(f"{ours}.norm.{{p}}", f"{norm}.{{p}}"),
            Rule(f"{ours}.decoder.weight", f"{decoder}.weight"),   # tied: omitted on save, ignored on load
            Rule(f"{ours}.decoder.bias", bias)]


# ----------------------------------------------------------------------------- config.json
def activation_from_hf(c: dict, who: str, default: str = "gelu") -> str:
    """The checks a BERT-style config.json passes (absolute positions, the masked-LM decoder tied
    to the token embedding, a hidden_act we have), each a ValueError naming it; returns our name of
    its activation (``default``: transformers' for the family, when the file names none)."""
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{who}: position_embedding_type {c['position_embedding_type']!r} is not supported "
                         f"(only 'absolute')")
    if c.get("tie_word_embeddings") is False:
        raise ValueError(f"{who}: a masked-LM decoder untied from the token embedding is not supported")
    act = c.get("hidden_act", default)
    if act not in ACT_FROM_HF:
        raise ValueError(f"{who}: hidden_act {act!r} is not supported ({', '.join(ACT_FROM_HF)})")
    return ACT_FROM_HF[act]


def labels_to_hf(num_labels: int, id2label: dict[int, str] | None) -> dict:
    """config.json's label fields: num_labels, and the names when the config has them."""
    if id2label is None:
        return {"num_labels": num_labels}
    return {"num_labels": num_labels, "id2label": {str(i): n for i, n in id2label.items()},
            "label2id": {n: int(i) for i, n in id2label.items()}}


def labels_from_hf(c: dict) -> dict:
    """(num_labels, id2label) from config.json; transformers' placeholder names LABEL_i read as none."""
    names = {int(i): n for i, n in (c.get("id2label") or {}).items()}
    num_labels = len(names) if names else c.get("num_labels", 2)
    if names and sorted(names) != list(range(num_labels)):
        raise ValueError(f"config.json: id2label keys must be 0 .. {num_labels - 1}, got {sorted(names)}")
    if all(n == f"LABEL_{i}" for i, n in names.items()):
        names = {}
    return {"num_labels": num_labels, "id2label": names or None}
