"""ELECTRA: a small generator fills masked positions, and the discriminator, the model kept
after pre-training, learns which tokens were replaced (Clark et al. 2020, section 2).

    the encoder is BERT's (:class:`~attnlab.models.encoder.BertEncoder`), with embeddings of their own
    width: ids -> token + token-type + position embeddings (width embedding_size) -> LayerNorm
              -> dropout -> Linear up to d_model (only when embedding_size != d_model)
              -> N x Post-Norm encoder layer -> hidden (B, T, E)
    generator (masked-LM)   = LayerNorm(GELU(hidden W_g + b_g)) W_emb^T + b     (B, T, V), tied
    discriminator           = act(hidden W_d + b_d) w_p + b_p                    (B, T): logit "replaced"
    classifier              = GELU(dropout(hidden[:, 0]) W + b) -> dropout -> out_proj   (B, C)

The generator and the discriminator are separate checkpoints (transformers' ElectraForMaskedLM
and ElectraForPreTraining); in pre-training the generator is a fraction of the discriminator's
size and they share the token embedding. Masks, checks and fused Q/K/V as in
:mod:`attnlab.models.encoder`. Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from ..nn.mlp import make_activation
from .bert import BERT_TOKENS, BertConfig, bert_config_from_hf, bert_config_to_hf, bert_rules, sized_fields
from .convert import Rule
from .encoder import BertEncoder, MaskedLMHead, masked_rows, mlm_head_rules
from .registry import register_family

__all__ = ["ElectraConfig", "ElectraModel", "ElectraForMaskedLM", "ElectraForPreTraining",
           "ElectraForSequenceClassification", "ELECTRA", "build_config"]


@dataclass
class ElectraConfig(BertConfig):
    """BERT's fields (with ELECTRA-small's sizes by default) and the embeddings' own width."""
    d_model: int = 256
    num_heads: int = 4
    d_ff: int = 1024
    embedding_size: int | None = 128           # None: d_model

    def __post_init__(self):
        super().__post_init__()
        if self.embedding_size is None:
            self.embedding_size = self.d_model
        if self.embedding_size <= 0:
            raise ValueError(f"ElectraConfig: embedding_size must be positive, got {self.embedding_size}")


class ElectraModel(BertEncoder):
    """The bare encoder (kind "base"): ``forward(input_ids, attention_mask=None, token_type_ids=None,
    position_ids=None) -> hidden (B, T, E)``. ELECTRA has no pooler."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config, config.embedding_size)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        return self.encode(input_ids, attention_mask, token_type_ids, position_ids)


class ElectraForMaskedLM(BertEncoder):
    """The generator (kind "masked-lm"): ``forward(...) -> logits (B, T, V)`` (or (M, V) at the
    ``masked_positions`` alone); its head's GELU is fixed whatever ``activation`` the encoder uses,
    as in the reference."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config, config.embedding_size)
        self.mlm_head = MaskedLMHead(config.d_model, self.embeddings.token, "gelu", config.layer_norm_eps)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None,
                masked_positions=None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, position_ids)
        return self.mlm_head(masked_rows(self, hidden, masked_positions))


class ReplacedTokenHead(nn.Module):
    """logit(replaced) = act(h W + b) w + c: hidden (B, T, E) -> (B, T)."""

    def __init__(self, d_model: int, activation: str):
        super().__init__()
        self.dense = nn.Linear(d_model, d_model)
        self.act = make_activation(activation)
        self.prediction = nn.Linear(d_model, 1)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.prediction(self.act(self.dense(hidden))).squeeze(-1)


class ElectraForPreTraining(BertEncoder):
    """The discriminator (kind "replaced-token"): ``forward(...) -> (B, T)`` logits that each token
    was replaced (sigmoid > 0.5: replaced)."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config, config.embedding_size)
        self.discriminator = ReplacedTokenHead(config.d_model, config.activation)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        return self.discriminator(self.encode(input_ids, attention_mask, token_type_ids, position_ids))


class ElectraForSequenceClassification(BertEncoder):
    """Encoder + a two-layer head on the first token (kind "classifier"): ``forward(...) -> (B, C)``.
    The head's GELU (where BERT's pooler has tanh) is the reference's choice."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config, config.embedding_size)
        p = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.classifier_dropout = nn.Dropout(p)
        self.classifier_dense = nn.Linear(config.d_model, config.d_model)
        self.classifier_act = make_activation("gelu")
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None) -> Tensor:
        first = self.encode(input_ids, attention_mask, token_type_ids, position_ids, first_only=True)[:, 0]
        h = self.classifier_act(self.classifier_dense(self.classifier_dropout(first)))
        return self.classifier(self.classifier_dropout(h))


# ----------------------------------------------------------------------------- Hugging Face
def config_from_hf(c: dict) -> ElectraConfig:
    return bert_config_from_hf(c, ElectraConfig, embedding_size=c.get("embedding_size"))


def config_to_hf(cfg: ElectraConfig) -> dict:
    return dict(bert_config_to_hf(cfg), embedding_size=cfg.embedding_size)


def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, embedding_size: int | None = None,
                 type_vocab_size: int = 2, num_labels: int = 2, pad_token_id: int | None = 0) -> ElectraConfig:
    """An ELECTRA sized for training; ``embedding_size`` None: d_model (no projection)."""
    return ElectraConfig(**sized_fields(vocab_size=vocab_size, context=context, d_model=d_model,
                                        num_heads=num_heads, num_layers=num_layers, d_ff=d_ff, dropout=dropout,
                                        type_vocab_size=type_vocab_size, num_labels=num_labels,
                                        pad_token_id=pad_token_id), embedding_size=embedding_size)


PRESETS = {
    "tiny": dict(vocab_size=96, embedding_size=16, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, num_labels=3),
    "electra-small": dict(),                                                              # 13.5M parameters
    "electra-base": dict(embedding_size=768, d_model=768, num_heads=12, d_ff=3072),       # 110M
}

ELECTRA = register_family("electra", ElectraConfig,
                          limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_position_embeddings},
                          base_rules=bert_rules() + [Rule("embeddings.project.{p}", "embeddings_project.{p}")],
                          config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS,
                          build_config=build_config,
                          ignore_on_load=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$"),
                          token_ids={"pad_token_id": "pad"}, special_tokens=BERT_TOKENS)
ELECTRA.register("ElectraModel", ElectraModel, kind="base")
ELECTRA.register("ElectraForPreTraining", ElectraForPreTraining, kind="replaced-token", prefix="electra.",
                 head_rules=[Rule("discriminator.dense.{p}", "discriminator_predictions.dense.{p}"),
                             Rule("discriminator.prediction.{p}", "discriminator_predictions.dense_prediction.{p}")])
ELECTRA.register("ElectraForMaskedLM", ElectraForMaskedLM, kind="masked-lm", prefix="electra.",
                 head_rules=mlm_head_rules("mlm_head", "generator_predictions.dense", "generator_predictions.LayerNorm",
                                           "generator_lm_head", "generator_lm_head.bias"))
ELECTRA.register("ElectraForSequenceClassification", ElectraForSequenceClassification, kind="classifier",
                 prefix="electra.", head_rules=[Rule("classifier_dense.{p}", "classifier.dense.{p}"),
                                                Rule("classifier.{p}", "classifier.out_proj.{p}")])
