"""BERT: a bidirectional Transformer encoder pre-trained by masked-LM and next-sentence
prediction (Devlin et al. 2019, sections 3.1 and 3.3).

    ids, token types (segments A/B), positions
        -> token + token-type + learned position embeddings -> LayerNorm -> dropout
        -> N x [x = LayerNorm(x + Attn(x)); x = LayerNorm(x + FFN(x))]   (Post-Norm, GELU; every token
                                                                         sees every real token)
        -> hidden (B, T, E)
    pool(hidden)   = tanh(hidden[:, 0] W_p + b_p)                          the [CLS] summary (B, E)
    masked-LM head = LayerNorm(GELU(hidden W_t + b_t)) W_emb^T + b         (B, T, V), tied to the embedding
    next sentence  = pool(hidden) W_s + b_s                                (B, 2): 0 IsNext, 1 NotNext
    classifier     = dropout(pool(hidden)) W_c + b_c                       (B, C)

Padding: ``attention_mask`` (B, T) is True/1 for real tokens; it reaches attention as a
(B, 1, 1, T) boolean key mask on the fused SDPA path, so real tokens never see padding and
their outputs do not depend on it. Q, K and V are one fused projection (``qkv_proj``); the
weight map splits it into Hugging Face's ``query``, ``key`` and ``value`` and joins them back.

``BertModel`` (the bare encoder) returns the last hidden state and keeps the pooler, as
transformers' BertModel does, so its checkpoints round-trip with no missing key:
``model.pool(hidden)`` gives the pooled (B, E) vector. The masked-LM model has no pooler (as
in transformers); loading a pre-training checkpoint into it skips the pooler and the
next-sentence head. :class:`BertEncoder` holds the embeddings, the stack, the checks and the
forward every head shares; ELECTRA (:mod:`attnlab.models.electra`) builds on it.
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import EncoderLayer
from ..nn.checkpoint import checkpoint
from ..nn.mlp import FeedForward, make_activation
from ..nn.norm import LayerNorm
from ..nn.position import LearnedPositionalEmbedding
from .convert import Rule, Split
from .registry import register_family

__all__ = ["BertConfig", "BertEmbeddings", "BertEncoder", "MaskedLMHead", "BertModel", "BertForMaskedLM",
           "BertForPreTraining", "BertForSequenceClassification", "BERT", "bert_rules", "bert_config_from_hf",
           "bert_config_to_hf", "build_config"]


@dataclass
class BertConfig:
    vocab_size: int = 30522
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    d_ff: int = 3072
    dropout: float = 0.1                   # embeddings and residual branches (hidden_dropout_prob)
    attention_dropout: float = 0.1         # attention weights (attention_probs_dropout_prob)
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    activation: str = "gelu"               # the exact (erf) GELU
    pad_token_id: int | None = 0
    num_labels: int | None = None          # classifiers; default len(id2label), else 2
    id2label: dict[int, str] | None = None  # default LABEL_0, LABEL_1, ... as transformers
    classifier_dropout: float | None = None  # default ``dropout``

    def __post_init__(self):
        name = type(self).__name__
        for f in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_position_embeddings",
                  "type_vocab_size"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{name}: {f} must be positive, got {getattr(self, f)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"{name}: d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads})")
        for f in ("dropout", "attention_dropout", "classifier_dropout"):
            if getattr(self, f) is not None and not 0.0 <= getattr(self, f) < 1.0:
                raise ValueError(f"{name}: {f} must be in [0, 1), got {getattr(self, f)}")
        if self.activation not in FeedForward.ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {FeedForward.ACTIVATIONS}, got {self.activation!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"{name}: pad_token_id {self.pad_token_id} is outside [0, vocab_size={self.vocab_size})")
        if self.id2label is None:
            self.id2label = {i: f"LABEL_{i}" for i in range(2 if self.num_labels is None else self.num_labels)}
        self.id2label = {int(i): str(label) for i, label in self.id2label.items()}     # JSON keys are strings
        if self.num_labels is None:
            self.num_labels = len(self.id2label)
        if self.num_labels <= 0 or sorted(self.id2label) != list(range(self.num_labels)):
            raise ValueError(f"{name}: id2label must name classes 0 .. num_labels - 1 ({self.num_labels}), "
                             f"got ids {sorted(self.id2label)}")

    @property
    def label2id(self) -> dict[str, int]:
        return {label: i for i, label in self.id2label.items()}

    @property
    def max_seq_len(self) -> int:
        return self.max_position_embeddings


# ----------------------------------------------------------------------------- the encoder
class BertEmbeddings(nn.Module):
    """token + token-type + position embeddings (width ``embedding_size``), LayerNorm, dropout, and
    (ELECTRA, when ``embedding_size`` != d_model) a linear ``project`` up to d_model.

    ``forward(input_ids (B, T), token_type_ids (B, T), positions (T,) or (B, T)) -> (B, T, E)``."""

    def __init__(self, config: BertConfig, embedding_size: int | None = None):
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

    def __init__(self, config: BertConfig, embedding_size: int | None = None, pooler: str | None = None):
        super().__init__()
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
        """Matrices and embeddings ~ N(0, 0.02), biases 0, the padding token's embedding 0; norms
        keep weight 1, bias 0 (pitfall 23: a large-scale init slows the CPU backward with denormals)."""
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


# ----------------------------------------------------------------------------- the models
class BertModel(BertEncoder):
    """The bare encoder (kind "base"): ``forward(input_ids, attention_mask=None, token_type_ids=None,
    position_ids=None) -> hidden (B, T, E)``; ``pool(hidden) -> (B, E)`` with the checkpoint's pooler,
    kept but not trained (:class:`Pooler`): fine-tune a classifier as BertForSequenceClassification."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="kept")
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        return self.encode(input_ids, attention_mask, token_type_ids, position_ids)


class BertForMaskedLM(BertEncoder):
    """Encoder + masked-LM head (kind "masked-lm"): ``forward(...) -> logits (B, T, V)`` at every position."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.mlm_head = MaskedLMHead(config.d_model, self.embeddings.token, config.activation, config.layer_norm_eps)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        return self.mlm_head(self.encode(input_ids, attention_mask, token_type_ids, position_ids))


class BertForPreTraining(BertEncoder):
    """Both pre-training heads (kind "pretraining"): ``forward(...) -> (masked-LM logits (B, T, V),
    next-sentence logits (B, 2))``; the second reads the pooled [CLS] of the pair "[CLS] A [SEP] B [SEP]"."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="trained")
        self.mlm_head = MaskedLMHead(config.d_model, self.embeddings.token, config.activation, config.layer_norm_eps)
        self.nsp_head = nn.Linear(config.d_model, 2)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None):
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.mlm_head(hidden), self.nsp_head(self.pool(hidden))


class BertForSequenceClassification(BertEncoder):
    """Encoder + pooler + linear classifier (kind "classifier"): ``forward(...) -> (B, num_labels)``."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="trained")
        p = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.classifier_dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.classifier(self.classifier_dropout(self.pool(hidden)))


# ----------------------------------------------------------------------------- Hugging Face
def bert_rules(layers: str = "encoder.layer") -> list[Rule]:
    """The encoder's keys relative to transformers' BertModel (ELECTRA's are the same)."""
    att = f"{layers}.{{i}}.attention"
    return [
        Rule("embeddings.token.weight", "embeddings.word_embeddings.weight"),
        Rule("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight"),
        Rule("embeddings.position.weight", "embeddings.position_embeddings.weight"),
        Rule("embeddings.norm.{p}", "embeddings.LayerNorm.{p}"),
        Rule("layers.{i}.self_attn.qkv_proj.{p}", tuple(f"{att}.self.{n}.{{p}}" for n in ("query", "key", "value")),
             Split(0, 3)),
        Rule("layers.{i}.self_attn.out_proj.{p}", f"{att}.output.dense.{{p}}"),
        Rule("layers.{i}.self_attn_norm.{p}", f"{att}.output.LayerNorm.{{p}}"),
        Rule("layers.{i}.ff.linear1.{p}", f"{layers}.{{i}}.intermediate.dense.{{p}}"),
        Rule("layers.{i}.ff.linear2.{p}", f"{layers}.{{i}}.output.dense.{{p}}"),
        Rule("layers.{i}.ff_norm.{p}", f"{layers}.{{i}}.output.LayerNorm.{{p}}"),
    ]


def _mlm_rules(ours: str, dense: str, norm: str, decoder: str, bias: str) -> list[Rule]:
    return [Rule(f"{ours}.dense.{{p}}", f"{dense}.{{p}}"), Rule(f"{ours}.norm.{{p}}", f"{norm}.{{p}}"),
            Rule(f"{ours}.decoder.weight", f"{decoder}.weight"),   # tied: omitted on save, ignored on load
            Rule(f"{ours}.decoder.bias", bias)]


# our config field -> transformers' BertConfig / ElectraConfig field
BERT_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers", "d_ff": "intermediate_size", "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob", "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size", "layer_norm_eps": "layer_norm_eps", "pad_token_id": "pad_token_id",
    "classifier_dropout": "classifier_dropout"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


def bert_config_from_hf(c: dict, cls: type = BertConfig, **extra):
    """Our config from a transformers config.json dict; ValueError for what the encoder does not do."""
    who = cls.__name__
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise ValueError(f"{who}: a decoder (is_decoder / add_cross_attention) is not supported; this is an encoder")
    if c.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{who}: position_embedding_type {c['position_embedding_type']!r} is not supported "
                         f"(only 'absolute')")
    if c.get("tie_word_embeddings") is False:
        raise ValueError(f"{who}: a masked-LM decoder untied from the token embedding is not supported")
    act = c.get("hidden_act", "gelu")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"{who}: hidden_act {act!r} is not supported ({', '.join(_ACT_FROM_HF)})")
    kwargs = {ours: c[hf] for ours, hf in BERT_HF_NAMES.items() if hf in c}
    labels = c.get("id2label")
    return cls(**kwargs, **extra, activation=_ACT_FROM_HF[act], id2label=labels,
               num_labels=len(labels) if labels else c.get("num_labels"))


def bert_config_to_hf(cfg: BertConfig) -> dict:
    return {**{hf: getattr(cfg, ours) for ours, hf in BERT_HF_NAMES.items()}, "hidden_act": _ACT_TO_HF[cfg.activation],
            "id2label": {str(i): label for i, label in cfg.id2label.items()}, "label2id": cfg.label2id,
            "position_embedding_type": "absolute", "tie_word_embeddings": True}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, type_vocab_size: int = 2, num_labels: int = 2,
                 pad_token_id: int | None = 0) -> BertConfig:
    """A BERT sized for training: ``context`` positions, d_ff 4 d_model unless given."""
    return BertConfig(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                      d_ff=d_ff or 4 * d_model, dropout=dropout, attention_dropout=dropout,
                      max_position_embeddings=context, type_vocab_size=type_vocab_size, num_labels=num_labels,
                      pad_token_id=pad_token_id)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, num_labels=3),
    "bert-base": dict(),                                                                # 110M parameters
    "bert-large": dict(d_model=1024, num_heads=16, num_layers=24, d_ff=4096),           # 340M
    "all-minilm-l6": dict(d_model=384, num_heads=12, num_layers=6, d_ff=1536),          # 22.7M
}

BERT = register_family("bert", BertConfig, base_rules=bert_rules(), config_from_hf=bert_config_from_hf,
                       config_to_hf=bert_config_to_hf, presets=PRESETS, build_config=build_config,
                       # buffers older writers stored, and the decoder bias transformers ties to cls.predictions.bias
                       ignore_on_load=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$",
                                       r"^cls\.predictions\.decoder\.bias$"))
_POOLER = [Rule("pooler.{p}", "bert.pooler.dense.{p}")]
_MLM = _mlm_rules("mlm_head", "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                  "cls.predictions.decoder", "cls.predictions.bias")
BERT.register("BertModel", BertModel, kind="base", head_rules=[Rule("pooler.{p}", "pooler.dense.{p}")])
# a masked-LM model loads a pre-training checkpoint (bert-base-uncased's), leaving out the heads it has not
BERT.register("BertForMaskedLM", BertForMaskedLM, kind="masked-lm", prefix="bert.", head_rules=_MLM,
              ignore_on_load=(r"^bert\.pooler\.", r"^cls\.seq_relationship\."))
BERT.register("BertForPreTraining", BertForPreTraining, kind="pretraining", prefix="bert.",
              head_rules=_POOLER + _MLM + [Rule("nsp_head.{p}", "cls.seq_relationship.{p}")])
BERT.register("BertForSequenceClassification", BertForSequenceClassification, kind="classifier", prefix="bert.",
              head_rules=_POOLER + [Rule("classifier.{p}", "classifier.{p}")])
