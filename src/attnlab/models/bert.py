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

Padding, checks and the shared forward live in :mod:`attnlab.models.encoder` (ELECTRA builds on
it too): ``attention_mask`` (B, T) is True/1 for real tokens and reaches the fused SDPA kernel as
a (B, 1, 1, T) boolean key mask. Q, K and V are one fused projection (``qkv_proj``); the weight
map splits it into transformers' ``query``, ``key`` and ``value`` and joins them back.

``BertModel`` (the bare encoder) returns the last hidden state and keeps the pooler that
transformers' BertModel checkpoints carry, so they round-trip with no missing key:
``model.pool(hidden)`` gives the pooled (B, E) vector. No output of its forward reads the pooler,
so a checkpoint without one (transformers' ``add_pooling_layer=False``) loads too, with a warning. The masked-LM model has no pooler (as in
transformers); loading a pre-training checkpoint into it (bert-base-uncased's names
BertForMaskedLM) skips the pooler and the next-sentence head, as transformers does.
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .convert import Rule, Split
from .encoder import (ACT_TO_HF, EMBEDDING_RULES, BertEncoder, MaskedLMHead, activation_from_hf, check_config,
                      labels_from_hf, labels_to_hf, layer_rules, masked_rows, mlm_head_rules)
from .registry import register_family

__all__ = ["BertConfig", "BertModel", "BertForMaskedLM", "BertForPreTraining", "BertForSequenceClassification",
           "BERT", "bert_rules", "bert_config_from_hf", "bert_config_to_hf", "build_config",
           "sized_fields"]


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
        if self.id2label is None:
            self.id2label = {i: f"LABEL_{i}" for i in range(2 if self.num_labels is None else self.num_labels)}
        if self.num_labels is None:
            self.num_labels = len(self.id2label)
        check_config(self, positive=("vocab_size", "d_model", "num_heads", "num_layers", "d_ff",
                                     "max_position_embeddings", "type_vocab_size"),
                     fractions=("dropout", "attention_dropout", "classifier_dropout"))

    @property
    def label2id(self) -> dict[str, int]:
        return {label: i for i, label in self.id2label.items()}

    @property
    def max_seq_len(self) -> int:
        return self.max_position_embeddings


# ----------------------------------------------------------------------------- the models
class BertModel(BertEncoder):
    """The bare encoder (kind "base"): ``forward(input_ids, attention_mask=None, token_type_ids=None,
    position_ids=None) -> hidden (B, T, E)``; ``pool(hidden) -> (B, E)`` with the checkpoint's
    pooler, kept but not trained (:class:`~attnlab.models.encoder.Pooler`): fine-tune a classifier
    as BertForSequenceClassification, whose pooler trains."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="kept")
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        return self.encode(input_ids, attention_mask, token_type_ids, position_ids)


class BertForMaskedLM(BertEncoder):
    """Encoder + masked-LM head (kind "masked-lm"): ``forward(...) -> logits (B, T, V)`` at every
    position, or (M, V) at the ``masked_positions`` (B, T) bool alone (:func:`masked_rows`)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.mlm_head = MaskedLMHead(config.d_model, self.embeddings.token, config.activation, config.layer_norm_eps)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                masked_positions=None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.mlm_head(masked_rows(self, hidden, masked_positions))


class BertForPreTraining(BertEncoder):
    """Both pre-training heads (kind "pretraining"): ``forward(...) -> (masked-LM logits (B, T, V),
    next-sentence logits (B, 2))``; the second reads the pooled [CLS] of the pair "[CLS] A [SEP] B [SEP]".
    ``masked_positions`` (B, T) bool: masked-LM logits (M, V) at those positions alone."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="trained")
        self.mlm_head = MaskedLMHead(config.d_model, self.embeddings.token, config.activation, config.layer_norm_eps)
        self.nsp_head = nn.Linear(config.d_model, 2)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, masked_positions=None):
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.mlm_head(masked_rows(self, hidden, masked_positions)), self.nsp_head(self.pool(hidden))


class BertForSequenceClassification(BertEncoder):
    """Encoder + pooler + linear classifier (kind "classifier"): ``forward(...) -> (B, num_labels)``."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooler="trained")
        p = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.classifier_dropout = nn.Dropout(p)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids, first_only=True)
        return self.classifier(self.classifier_dropout(self.pool(hidden)))


# ----------------------------------------------------------------------------- Hugging Face
def bert_rules() -> list[Rule]:
    """The encoder's keys relative to transformers' BertModel (ELECTRA's are the same): our fused
    Q/K/V projection is split into their query, key and value."""
    qkv = tuple(f"encoder.layer.{{i}}.attention.self.{n}.{{p}}" for n in ("query", "key", "value"))
    return [*EMBEDDING_RULES, Rule("layers.{i}.self_attn.qkv_proj.{p}", qkv, Split(0, 3)), *layer_rules()]


# our config field -> transformers' BertConfig / ElectraConfig field
BERT_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers", "d_ff": "intermediate_size", "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob", "max_position_embeddings": "max_position_embeddings",
    "type_vocab_size": "type_vocab_size", "layer_norm_eps": "layer_norm_eps", "pad_token_id": "pad_token_id",
    "classifier_dropout": "classifier_dropout"}


def bert_config_from_hf(c: dict, cls: type = BertConfig, **extra):
    """Our config from a transformers config.json dict; ValueError for what the encoder does not do."""
    who = cls.__name__
    if c.get("is_decoder") or c.get("add_cross_attention"):
        raise ValueError(f"{who}: a decoder (is_decoder / add_cross_attention) is not supported; this is an encoder")
    kwargs = {ours: c[hf] for ours, hf in BERT_HF_NAMES.items() if hf in c}
    return cls(**kwargs, **extra, activation=activation_from_hf(c, who), **labels_from_hf(c))


def bert_config_to_hf(cfg: BertConfig) -> dict:
    return {**{hf: getattr(cfg, ours) for ours, hf in BERT_HF_NAMES.items()}, "hidden_act": ACT_TO_HF[cfg.activation],
            **labels_to_hf(cfg.num_labels, cfg.id2label), "position_embedding_type": "absolute",
            "tie_word_embeddings": True}


# ----------------------------------------------------------------------------- registration
def sized_fields(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None, dropout: float, type_vocab_size: int, num_labels: int,
                 pad_token_id: int | None) -> dict:
    """The config fields a sizing builder sets (ELECTRA's builder shares them): ``context``
    positions, d_ff 4 d_model unless given, one dropout for the hidden states and the attention."""
    return dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                d_ff=d_ff or 4 * d_model, dropout=dropout, attention_dropout=dropout, max_position_embeddings=context,
                type_vocab_size=type_vocab_size, num_labels=num_labels, pad_token_id=pad_token_id)


def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, type_vocab_size: int = 2, num_labels: int = 2,
                 pad_token_id: int | None = 0) -> BertConfig:
    """A BERT sized for training (see :func:`sized_fields`)."""
    return BertConfig(**sized_fields(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                                     num_layers=num_layers, d_ff=d_ff, dropout=dropout,
                                     type_vocab_size=type_vocab_size, num_labels=num_labels,
                                     pad_token_id=pad_token_id))


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, num_labels=3),
    "bert-base": dict(),                                                                # 110M parameters
    "bert-large": dict(d_model=1024, num_heads=16, num_layers=24, d_ff=4096),           # 340M
    "all-minilm-l6": dict(d_model=384, num_heads=12, num_layers=6, d_ff=1536),          # 22.7M
}

# the special tokens of BERT's WordPiece vocabulary, by the names transformers' tokenizers read
BERT_TOKENS = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "mask_token": "[MASK]",
               "unk_token": "[UNK]"}
BERT = register_family("bert", BertConfig, base_rules=bert_rules(), config_from_hf=bert_config_from_hf,
                       limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_position_embeddings},
                       config_to_hf=bert_config_to_hf, presets=PRESETS, build_config=build_config,
                       # buffers older writers stored, and the decoder bias transformers ties to cls.predictions.bias
                       ignore_on_load=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$",
                                       r"^cls\.predictions\.decoder\.bias$"),
                       token_ids={"pad_token_id": "pad"}, special_tokens=BERT_TOKENS)
_POOLER = [Rule("pooler.{p}", "bert.pooler.dense.{p}")]
_MLM = mlm_head_rules("mlm_head", "cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                  "cls.predictions.decoder", "cls.predictions.bias")
BERT.register("BertModel", BertModel, kind="base", head_rules=[Rule("pooler.{p}", "pooler.dense.{p}")])
# a masked-LM model loads a pre-training checkpoint (bert-base-uncased's), leaving out the heads it has not
BERT.register("BertForMaskedLM", BertForMaskedLM, kind="masked-lm", prefix="bert.", head_rules=_MLM,
              ignore_on_load=(r"^bert\.pooler\.", r"^cls\.seq_relationship\."))
BERT.register("BertForPreTraining", BertForPreTraining, kind="pretraining", prefix="bert.",
              head_rules=_POOLER + _MLM + [Rule("nsp_head.{p}", "cls.seq_relationship.{p}")], default=True)
BERT.register("BertForSequenceClassification", BertForSequenceClassification, kind="classifier", prefix="bert.",
              head_rules=_POOLER + [Rule("classifier.{p}", "classifier.{p}")])
