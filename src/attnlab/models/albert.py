"""ALBERT: BERT with factorised embeddings and one set of layer weights applied N times
(Lan et al. 2020, "ALBERT: A Lite BERT", sections 3.1 and 3.2).

    ids -> token (V x E_emb) + position + token type embeddings -> LayerNorm -> dropout
        -> Linear E_emb -> E                                   (factorised embedding)
        -> N x the shared layer group: [x = Norm(x + Attn(x)); x = Norm(x + FFN(x))]   (Post-Norm)
        -> last hidden state (B, T, E)
    heads: masked-LM (tied to the token embedding) | pooler tanh(W h_0) -> sentence order (2)
           | pooler -> dropout -> class logits

The vocabulary costs V x E_emb + E_emb x E parameters instead of V x E. Every pass through the
stack uses the same weights: layer i runs group ``i * num_hidden_groups // num_layers`` (one
group by default, every checkpoint Google published), and a group runs its
``inner_group_num`` layers in turn. The feed-forward is E -> d_ff -> E with GELU's tanh
approximation ("gelu_new"), LayerNorm eps 1e-12. Attention masks: ``attention_mask`` (B, T)
is True/1 for real tokens. Shape letters: see :mod:`attnlab.nn.attention`.

One difference in training only: transformers' ALBERT layer has no dropout on the feed-forward
output, EncoderLayer puts ``dropout`` on every residual branch; ALBERT v2 trains with dropout 0,
where the two are the same.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from ..nn.block import EncoderLayer
from ..nn.mlp import FeedForward
from .convert import Rule
from .encoder import (ACT_TO_HF, EMBEDDING_RULES, BertEmbeddings, Encoder, MaskedLMHead, Pooler,
                      activation_from_hf, check_config, labels_from_hf, labels_to_hf, masked_rows,
                      mlm_head_rules)
from .registry import register_family

__all__ = ["AlbertConfig", "Albert", "AlbertModel", "AlbertForMaskedLM", "AlbertForPreTraining",
           "AlbertForSequenceClassification", "ALBERT", "build_config"]


@dataclass
class AlbertConfig:
    vocab_size: int = 30000
    d_model: int = 768                # E, the hidden width (HF hidden_size)
    num_heads: int = 12
    num_layers: int = 12              # passes through the shared layers
    d_ff: int = 3072
    dropout: float = 0.0              # embeddings, attention weights, residual branches
    embedding_size: int = 128         # E_emb, the factorised embedding width
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    num_hidden_groups: int = 1        # distinct sets of layer weights
    inner_group_num: int = 1          # layers in each set
    layer_norm_eps: float = 1e-12
    activation: str = "gelu_tanh"
    classifier_dropout: float = 0.1
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 3
    num_labels: int = 2               # the classifier's classes
    id2label: dict[int, str] | None = field(default=None)

    def __post_init__(self):
        check_config(self, positive=("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "embedding_size",
                                     "max_position_embeddings", "type_vocab_size", "num_hidden_groups",
                                     "inner_group_num", "num_labels"),
                     fractions=("dropout", "classifier_dropout"))
        if self.num_hidden_groups > self.num_layers:
            raise ValueError(f"AlbertConfig: {self.num_hidden_groups} layer groups for {self.num_layers} layers: "
                             f"some groups would never run")


class Albert(Encoder):
    """The encoder every ALBERT architecture is built on (no forward of its own):
    ``encode(input_ids, attention_mask, token_type_ids) -> (B, T, E)`` and ``pool(h) -> (B, E)``
    (:class:`~attnlab.models.encoder.Encoder`), the layer groups run as :meth:`stack` says."""

    def __init__(self, config: AlbertConfig, pooler: str | None = "trained"):
        super().__init__(config)
        c, E = config, config.d_model
        self.embeddings = BertEmbeddings(c, c.embedding_size)        # E_emb wide, then projected to E
        self.groups = nn.ModuleList(
            nn.ModuleList(EncoderLayer(E, c.num_heads, c.d_ff, c.dropout, norm_first=False, eps=c.layer_norm_eps,
                                       ff=FeedForward(E, c.d_ff, 0.0, activation=c.activation))
                          for _ in range(c.inner_group_num))
            for _ in range(c.num_hidden_groups))
        self.pooler = Pooler.make(E, pooler, type(self).__name__)

    def stack(self):
        """Pass i runs group i * num_hidden_groups // num_layers: the same weights again and again."""
        c = self.config
        for i in range(c.num_layers):
            yield from self.groups[i * c.num_hidden_groups // c.num_layers]


class AlbertModel(Albert):
    """The bare encoder (transformers' AlbertModel): forward(input_ids (B, T), attention_mask=None,
    token_type_ids=None) -> the last hidden state (B, T, E). It keeps the pooler a checkpoint of
    this class holds, so that loading and saving lose nothing, as buffers: forward does not use it,
    so it is never trained (:class:`~attnlab.models.encoder.Pooler`)."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config, pooler="kept")
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        return self.encode(input_ids, attention_mask, token_type_ids)


class AlbertForMaskedLM(Albert):
    """forward(input_ids, attention_mask=None, token_type_ids=None, masked_positions=None) -> token
    logits (B, T, V), or (M, V) at the ``masked_positions`` (B, T) bool alone."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config, pooler=None)
        self.predictions = MaskedLMHead(config.d_model, self.embeddings.token, config.activation, config.layer_norm_eps)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, masked_positions: Tensor | None = None) -> Tensor:
        return self.predictions(masked_rows(self, self.encode(input_ids, attention_mask, token_type_ids),
                                            masked_positions))


class AlbertForPreTraining(Albert):
    """The pretraining heads: forward(...) -> (token logits (B, T, V), sentence-order logits (B, 2));
    sentence order: 0 = the two segments in their original order, 1 = swapped. ``masked_positions``
    (B, T) bool: token logits (M, V) at those positions alone."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        c = config
        self.predictions = MaskedLMHead(c.d_model, self.embeddings.token, c.activation, c.layer_norm_eps)
        self.sop_dropout = nn.Dropout(c.classifier_dropout)
        self.sop_classifier = nn.Linear(c.d_model, 2)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, masked_positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h = self.encode(input_ids, attention_mask, token_type_ids)
        return (self.predictions(masked_rows(self, h, masked_positions)),
                self.sop_classifier(self.sop_dropout(self.pool(h))))


class AlbertForSequenceClassification(Albert):
    """forward(...) -> class logits (B, num_labels), from the pooled first token."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, first_only=True)
        return self.classifier(self.dropout(self.pool(hidden)))


# ----------------------------------------------------------------------------- Hugging Face
_LAYER, _HF_LAYER = "groups.{g}.{j}.", "encoder.albert_layer_groups.{g}.albert_layers.{j}."
BASE_RULES = [
    *EMBEDDING_RULES,
    Rule("embeddings.project.{p}", "encoder.embedding_hidden_mapping_in.{p}"),
    *(Rule(_LAYER + ours + ".{p}", _HF_LAYER + theirs + ".{p}") for ours, theirs in [
        ("self_attn.q_proj", "attention.query"), ("self_attn.k_proj", "attention.key"),
        ("self_attn.v_proj", "attention.value"), ("self_attn.out_proj", "attention.dense"),
        ("self_attn_norm", "attention.LayerNorm"), ("ff.linear1", "ffn"), ("ff.linear2", "ffn_output"),
        ("ff_norm", "full_layer_layer_norm")]),
    Rule("pooler.{p}", "pooler.{p}"),
]
MLM_RULES = mlm_head_rules("predictions", "predictions.dense", "predictions.LayerNorm", "predictions.decoder",
                           "predictions.bias")


def config_from_hf(c: dict) -> AlbertConfig:
    """An HF AlbertConfig dict -> AlbertConfig; absent fields take transformers' defaults."""
    return AlbertConfig(
        vocab_size=c.get("vocab_size", 30000), d_model=c.get("hidden_size", 4096),
        num_heads=c.get("num_attention_heads", 64), num_layers=c.get("num_hidden_layers", 12),
        d_ff=c.get("intermediate_size", 16384), dropout=c.get("hidden_dropout_prob", 0.0),
        embedding_size=c.get("embedding_size", 128), max_position_embeddings=c.get("max_position_embeddings", 512),
        type_vocab_size=c.get("type_vocab_size", 2), num_hidden_groups=c.get("num_hidden_groups", 1),
        inner_group_num=c.get("inner_group_num", 1), layer_norm_eps=c.get("layer_norm_eps", 1e-12),
        activation=activation_from_hf(c, "AlbertConfig", "gelu_new"),
        classifier_dropout=c.get("classifier_dropout_prob", 0.1),
        pad_token_id=c.get("pad_token_id", 0), bos_token_id=c.get("bos_token_id", 2),
        eos_token_id=c.get("eos_token_id", 3), **labels_from_hf(c))


def config_to_hf(cfg: AlbertConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_attention_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.d_ff, "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout, "embedding_size": cfg.embedding_size,
            "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": cfg.type_vocab_size,
            "num_hidden_groups": cfg.num_hidden_groups, "inner_group_num": cfg.inner_group_num,
            "layer_norm_eps": cfg.layer_norm_eps, "hidden_act": ACT_TO_HF[cfg.activation],
            "classifier_dropout_prob": cfg.classifier_dropout, "pad_token_id": cfg.pad_token_id,
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": True,
            **labels_to_hf(cfg.num_labels, cfg.id2label)}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, embedding_size: int | None = None,
                 num_labels: int = 2) -> AlbertConfig:
    """An ALBERT sized for training: ``context`` positions, d_ff 4 d_model and E_emb
    min(128, d_model) unless given."""
    return AlbertConfig(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                        d_ff=4 * d_model if d_ff is None else d_ff, dropout=dropout,
                        embedding_size=min(128, d_model) if embedding_size is None else embedding_size,
                        max_position_embeddings=context, num_labels=num_labels)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_layers=3, d_ff=48, embedding_size=16,
                 max_position_embeddings=64, classifier_dropout=0.0),
    "albert-base-v2": dict(d_model=768, num_heads=12, d_ff=3072),                             # 11.7M parameters
    "albert-large-v2": dict(d_model=1024, num_heads=16, num_layers=24, d_ff=4096),            # 17.7M
    "albert-xlarge-v2": dict(d_model=2048, num_heads=16, num_layers=24, d_ff=8192),           # 58.7M
    "albert-xxlarge-v2": dict(d_model=4096, num_heads=64, d_ff=16384),                        # 223M
}

ALBERT = register_family("albert", AlbertConfig, base_rules=BASE_RULES, config_from_hf=config_from_hf,
                         limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_position_embeddings},
                         config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                         ignore_on_load=(r"embeddings\.position_ids$",),       # a buffer older writers stored
                         # ALBERT pre-trains with sentence-order prediction where BERT has next-sentence
                         task_defaults={"mlm": {"objective": "sop"}},
                         special_tokens={"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"})
ALBERT.register("AlbertModel", AlbertModel, kind="base")
# the decoder bias is transformers' predictions.bias: older checkpoints store a copy
ALBERT.register("AlbertForMaskedLM", AlbertForMaskedLM, kind="masked-lm", prefix="albert.", head_rules=MLM_RULES,
                ignore_on_load=(r"^predictions\.decoder\.bias$",))
ALBERT.register("AlbertForPreTraining", AlbertForPreTraining, kind="pretraining", prefix="albert.",
                head_rules=MLM_RULES + [Rule("sop_classifier.{p}", "sop_classifier.classifier.{p}")],
                ignore_on_load=(r"^predictions\.decoder\.bias$",))
ALBERT.register("AlbertForSequenceClassification", AlbertForSequenceClassification, kind="classifier",
                prefix="albert.", head_rules=[Rule("classifier.{p}", "classifier.{p}")])
