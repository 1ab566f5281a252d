"""DeBERTa-v2/v3: a Post-Norm encoder whose attention separates content from relative
position (He et al. 2021, "DeBERTa", section 3.1; v3: He et al. 2023).

    ids -> token embedding (+ absolute positions only if position_biased_input) (+ token types)
        -> [Linear E_emb -> E] -> LayerNorm -> dropout
        -> N x [x = Norm(x + DisentangledAttn(x)); x = Norm(x + FFN(x))]  -> last hidden state (B, T, E)

Disentangled attention, per head, with P the shared table of relative-position embeddings
(LayerNorm'd, 2k rows), P_q = P W_q and P_k = P W_k (the content projections themselves when
share_att_key, else separate ones) and d(i, j) the bucket of the relative position i - j:

    A[i, j] = ( q_i . k_j  +  q_i . P_k[d(i, j)]  +  k_j . P_q[d(i, j)] ) / sqrt(3 D)
               content       content-to-position     position-to-content

(the divisor counts the terms: sqrt(D (1 + number of position terms))). Relative positions
within k/2 = position_buckets/2 keep their own bucket; farther ones share log-spaced buckets up
to max_relative_positions (:func:`log_bucket_position`). The two position terms are an
:class:`~attnlab.nn.position.AttentionPosition` (:class:`DisentangledPosition`) plugged into
:class:`~attnlab.nn.attention.MultiHeadAttention`, whose ``scale`` is 1/sqrt(3 D).
Shape letters: see :mod:`attnlab.nn.attention`; R = 2k relative-embedding rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import EncoderLayer
from ..nn.mlp import FeedForward, make_activation
from ..nn.norm import LayerNorm
from ..nn.position import AttentionPosition, LearnedPositionalEmbedding
from .bert import BERT_TOKENS
from .convert import Rule
from .encoder import (ACT_FROM_HF, ACT_TO_HF, EMBEDDING_RULES, Encoder, MaskedLMHead, check_config, labels_from_hf,
                      labels_to_hf, layer_rules, masked_rows, mlm_head_rules)
from .registry import register_family

__all__ = ["DebertaV2Config", "log_bucket_position", "RelativeEmbeddings", "DisentangledPosition", "DebertaEmbeddings",
           "DebertaV2", "DebertaV2Model", "DebertaV2ForMaskedLM", "DebertaV2ForSequenceClassification", "DEBERTA_V2"]

TERMS = ("c2p", "p2c")


@dataclass
class DebertaV2Config:
    vocab_size: int = 128100
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    d_ff: int = 3072
    dropout: float = 0.1                       # embeddings, attention weights, residual branches
    max_position_embeddings: int = 512         # the longest sequence
    type_vocab_size: int = 0                   # 0: no token-type embedding
    layer_norm_eps: float = 1e-7
    activation: str = "gelu"
    embedding_size: int | None = None          # E_emb; None: d_model (no projection)
    relative_attention: bool = True
    max_relative_positions: int = -1           # < 1: max_position_embeddings
    position_buckets: int = 256                # k/2 ... see the module docstring; <= 0: no buckets
    pos_att_type: tuple[str, ...] = TERMS
    share_att_key: bool = True
    norm_rel_ebd: bool = True                  # LayerNorm on the relative table ("layer_norm")
    position_biased_input: bool = False        # absolute position embeddings added to the input
    pad_token_id: int | None = 0
    pooler_dropout: float = 0.0
    pooler_activation: str = "gelu"
    classifier_dropout: float | None = None    # None: dropout
    num_labels: int = 2
    id2label: dict[int, str] | None = field(default=None)

    def __post_init__(self):
        self.pos_att_type = tuple(self.pos_att_type)
        check_config(self, positive=("vocab_size", "d_model", "num_heads", "num_layers", "d_ff",
                                     "max_position_embeddings", "num_labels"),
                     fractions=("dropout",), activations=("activation", "pooler_activation"))
        if not set(self.pos_att_type) <= set(TERMS):
            raise ValueError(f"DebertaV2Config: pos_att_type may hold {TERMS}, got {self.pos_att_type}")
        if self.relative_attention and not self.pos_att_type:
            raise ValueError("DebertaV2Config: relative_attention needs at least one of pos_att_type c2p, p2c")

    @property
    def max_relative(self) -> int:
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def span(self) -> int:
        """k: relative buckets on each side; the table has 2k rows."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative


def log_bucket_position(relative: Tensor, buckets: int, max_position: int) -> Tensor:
    """DeBERTa's bucket of each relative position (same shape, long, sign kept): |r| <= buckets/2
    stays r; farther, mid + ceil(log(|r|/mid) / log((max_position - 1)/mid) * (mid - 1)), mid = buckets/2,
    so buckets grow logarithmically with the distance. He et al. 2023 (DeBERTa-v3's code)."""
    mid = buckets // 2
    distance = relative.abs()
    far = torch.where(distance < mid, mid - 1, distance).float()      # near ones never reach the log
    log_pos = torch.ceil(torch.log(far / mid) / torch.log(torch.tensor((max_position - 1) / mid))
                         * (mid - 1)) + mid
    return torch.where(distance <= mid, relative, (log_pos * relative.sign()).long())


class RelativeEmbeddings(nn.Module):
    """The (R = 2k, E) table of relative-position embeddings that every layer shares, through its
    LayerNorm when ``norm``; forward() -> the table, with dropout in training."""

    def __init__(self, span: int, d_model: int, eps: float, norm: bool, dropout: float):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2 * span, d_model) * 0.02)
        self.norm = LayerNorm(d_model, eps) if norm else None
        self.dropout = nn.Dropout(dropout)

    def no_weight_decay(self) -> tuple[str, ...]:
        """A position table, like the absolute ones: not decayed (its norm declares its own)."""
        return ("weight",)

    def forward(self) -> Tensor:
        return self.dropout(self.weight if self.norm is None else self.norm(self.weight))


class DisentangledPosition(AttentionPosition):
    """c2p[i, j] = q_i . P_k[d(i, j)] and p2c[i, j] = k_j . P_q[d(i, j)] (module docstring),
    summed over ``terms`` and times ``scale``: the bias added to the scaled content scores.

    ``table``: the model's :class:`RelativeEmbeddings`; ``attention``: the attention this plugs
    into, whose q/k projections make P_q, P_k when ``shared`` (else ``pos_query_proj``,
    ``pos_key_proj`` of its own). Both are read at every call, not owned: their weights stay
    where the model keeps them (no second state-dict key), kept out of the module tree.
    Positions: the hook's true token positions, so padding never shifts a distance.
    """

    def __init__(self, table: RelativeEmbeddings, attention: MultiHeadAttention, terms: tuple[str, ...],
                 scale: float, buckets: int, max_position: int, shared: bool):
        super().__init__()
        self._table, self._attention = (table,), (attention,)        # tuples: not registered submodules
        self.terms, self.scale, self.shared = terms, scale, shared
        self.buckets, self.max_position = buckets, max_position
        E = attention.d_model
        if not shared:
            if "c2p" in terms:
                self.pos_key_proj = nn.Linear(E, E)
            if "p2c" in terms:
                self.pos_query_proj = nn.Linear(E, E)

    def _heads(self, rows: Tensor, proj: nn.Module) -> Tensor:
        attn = self._attention[0]                                       # (R, E) -> (H, R, D)
        return proj(rows).view(rows.size(0), attn.num_heads, attn.head_dim).transpose(0, 1)

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        rows, attn = self._table[0](), self._attention[0]
        span = rows.size(0) // 2
        relative = q_pos[..., :, None] - k_pos[..., None, :]          # (T, S) or (B, T, S): i - j
        if self.buckets > 0 and self.max_position > 0:
            relative = log_bucket_position(relative, self.buckets, self.max_position)
        index = (relative + span).clamp(0, 2 * span - 1)
        index = (index if index.dim() == 3 else index[None])[:, None]   # (1 or B, 1, T, S)
        B, H, T, _ = q.shape
        S = k.size(-2)
        score = 0.0
        if "c2p" in self.terms:
            pos_k = self._heads(rows, attn.k_proj if self.shared else self.pos_key_proj)
            score = score + (q @ pos_k.transpose(-1, -2)).gather(-1, index.expand(B, H, T, S))
        if "p2c" in self.terms:
            pos_q = self._heads(rows, attn.q_proj if self.shared else self.pos_query_proj)
            by_key = (k @ pos_q.transpose(-1, -2)).gather(-1, index.transpose(-1, -2).expand(B, H, S, T))
            score = score + by_key.transpose(-1, -2)
        return score * self.scale


class DebertaEmbeddings(nn.Module):
    """token (+ position if position_biased_input) (+ token type if type_vocab_size > 0) embeddings
    of width E_emb, [``project`` E_emb -> E, no bias], then LayerNorm and dropout at width E: the
    projection comes before the norm, where BERT's embeddings put it after. Attribute names are
    BertEmbeddings', so both follow one weight map (:data:`attnlab.models.encoder.EMBEDDING_RULES`).

    ``forward(input_ids (B, T), token_type_ids (B, T), positions (T,) or (B, T)) -> (B, T, E)``."""

    def __init__(self, c: DebertaV2Config):
        super().__init__()
        E, X = c.d_model, c.embedding_size or c.d_model
        self.token = nn.Embedding(c.vocab_size, X)
        self.position = LearnedPositionalEmbedding(c.max_position_embeddings, X) if c.position_biased_input else None
        self.token_type = nn.Embedding(c.type_vocab_size, X) if c.type_vocab_size > 0 else None
        self.project = nn.Linear(X, E, bias=False) if X != E else None
        self.norm = LayerNorm(E, c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.token(input_ids)
        if self.position is not None:
            x = self.position(x, positions=positions)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids)
        if self.project is not None:
            x = self.project(x)
        return self.dropout(self.norm(x))


class DebertaV2(Encoder):
    """The encoder every DeBERTa-v2 architecture is built on: ``encode(input_ids, attention_mask,
    token_type_ids) -> (B, T, E)`` (:class:`~attnlab.models.encoder.Encoder`; relative positions
    are the tokens' own, so the optional absolute embeddings alone would see a ``position_ids``);
    no forward of its own, and a pooler only in the classifier."""

    def __init__(self, config: DebertaV2Config):
        super().__init__(config)
        c, E = config, config.d_model
        self.embeddings = DebertaEmbeddings(c)
        self.pooler = None
        self.relative = RelativeEmbeddings(c.span, E, c.layer_norm_eps, c.norm_rel_ebd, c.dropout) \
            if c.relative_attention else None
        # the position terms count in the scale even when relative_attention is off, as in the reference
        scale = 1.0 / math.sqrt(E // c.num_heads * (1 + len(c.pos_att_type)))
        self.layers = nn.ModuleList()
        for _ in range(c.num_layers):
            attn = MultiHeadAttention(E, c.num_heads, c.dropout, scale=scale)
            if c.relative_attention:
                attn.position = DisentangledPosition(self.relative, attn, c.pos_att_type, scale, c.position_buckets,
                                                     c.max_relative, c.share_att_key)
            self.layers.append(EncoderLayer(E, c.num_heads, c.d_ff, c.dropout, norm_first=False, eps=c.layer_norm_eps,
                                            self_attn=attn, ff=FeedForward(E, c.d_ff, 0.0, activation=c.activation)))


class DebertaV2Model(DebertaV2):
    """The bare encoder: forward(input_ids (B, T), attention_mask=None, token_type_ids=None) -> (B, T, E)."""

    def __init__(self, config: DebertaV2Config):
        super().__init__(config)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        return self.encode(input_ids, attention_mask, token_type_ids)


class DebertaV2ForMaskedLM(DebertaV2):
    """forward(...) -> token logits (B, T, V), the head tied to the token embedding; (M, V) at the
    ``masked_positions`` (B, T) bool alone."""

    def __init__(self, config: DebertaV2Config):
        super().__init__(config)
        self.predictions = MaskedLMHead(config.d_model, self.embeddings.token, config.activation,
                                        config.layer_norm_eps)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None, masked_positions: Tensor | None = None) -> Tensor:
        return self.predictions(masked_rows(self, self.encode(input_ids, attention_mask, token_type_ids),
                                            masked_positions))


class DebertaV2ForSequenceClassification(DebertaV2):
    """forward(...) -> class logits (B, num_labels): the first token through dropout, ``pooler``
    (E -> E) and its activation, dropout, ``classifier``."""

    def __init__(self, config: DebertaV2Config):
        super().__init__(config)
        c = config
        self.pooler_dropout = nn.Dropout(c.pooler_dropout)
        self.pooler = nn.Linear(c.d_model, c.d_model)
        self.pooler_act = make_activation(c.pooler_activation)
        self.dropout = nn.Dropout(c.dropout if c.classifier_dropout is None else c.classifier_dropout)
        self.classifier = nn.Linear(c.d_model, c.num_labels)
        self.reset_parameters()

    def pool(self, hidden: Tensor) -> Tensor:
        """DeBERTa's sentence vector: act(W dropout(hidden[:, 0]) + b), (B, T, E) -> (B, E)."""
        return self.pooler_act(self.pooler(self.pooler_dropout(hidden[:, 0])))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        hidden = self.encode(input_ids, attention_mask, token_type_ids, first_only=True)
        return self.classifier(self.dropout(self.pool(hidden)))


# ----------------------------------------------------------------------------- Hugging Face
BASE_RULES = [
    *EMBEDDING_RULES,
    Rule("embeddings.project.weight", "embeddings.embed_proj.weight"),
    Rule("relative.weight", "encoder.rel_embeddings.weight"),
    Rule("relative.norm.{p}", "encoder.LayerNorm.{p}"),
    *layer_rules(("self_attn.q_proj", "attention.self.query_proj"), ("self_attn.k_proj", "attention.self.key_proj"),
                 ("self_attn.v_proj", "attention.self.value_proj"),
                 ("self_attn.position.pos_key_proj", "attention.self.pos_key_proj"),
                 ("self_attn.position.pos_query_proj", "attention.self.pos_query_proj")),
]

def config_from_hf(c: dict) -> DebertaV2Config:
    """An HF DebertaV2Config dict -> DebertaV2Config; absent fields take transformers' defaults."""
    unsupported = [(c.get("conv_kernel_size", 0) > 0, "the convolution layer (conv_kernel_size > 0)"),
                   (c.get("tie_word_embeddings") is False, "an output head untied from the token embedding"),
                   (c.get("attention_head_size", c.get("hidden_size", 1536) // c.get("num_attention_heads", 24))
                    != c.get("hidden_size", 1536) // c.get("num_attention_heads", 24), "a custom attention_head_size"),
                   (c.get("pooler_hidden_size", c.get("hidden_size", 1536)) != c.get("hidden_size", 1536),
                    "a pooler_hidden_size other than hidden_size")]
    problems = [what for bad, what in unsupported if bad]
    norm = [x.strip() for x in str(c.get("norm_rel_ebd", "none")).lower().split("|")]
    if not set(norm) <= {"none", "layer_norm"}:
        problems.append(f"norm_rel_ebd {c['norm_rel_ebd']!r}")
    acts = [c.get("hidden_act", "gelu"), c.get("pooler_hidden_act", "gelu")]
    problems += [f"activation {a!r}" for a in acts if a not in ACT_FROM_HF]
    if problems:
        raise ValueError(f"DeBERTa-v2 config: not supported: {'; '.join(problems)}")
    terms = c.get("pos_att_type") or ()
    terms = [t.strip() for t in terms.lower().split("|")] if isinstance(terms, str) else list(terms)
    hidden = c.get("hidden_size", 1536)
    return DebertaV2Config(
        vocab_size=c.get("vocab_size", 128100), d_model=hidden, num_heads=c.get("num_attention_heads", 24),
        num_layers=c.get("num_hidden_layers", 24), d_ff=c.get("intermediate_size", 6144),
        dropout=c.get("hidden_dropout_prob", 0.1), max_position_embeddings=c.get("max_position_embeddings", 512),
        type_vocab_size=c.get("type_vocab_size", 0), layer_norm_eps=c.get("layer_norm_eps", 1e-7),
        activation=ACT_FROM_HF[acts[0]], embedding_size=None if c.get("embedding_size", hidden) == hidden
        else c["embedding_size"], relative_attention=c.get("relative_attention", False),
        max_relative_positions=c.get("max_relative_positions", -1), position_buckets=c.get("position_buckets", -1),
        pos_att_type=tuple(terms), share_att_key=c.get("share_att_key", False), norm_rel_ebd="layer_norm" in norm,
        position_biased_input=c.get("position_biased_input", True), pad_token_id=c.get("pad_token_id", 0),
        pooler_dropout=c.get("pooler_dropout", 0.0), pooler_activation=ACT_FROM_HF[acts[1]],
        classifier_dropout=c.get("cls_dropout"), **labels_from_hf(c))


def config_to_hf(cfg: DebertaV2Config) -> dict:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "num_attention_heads": cfg.num_heads,
            "num_hidden_layers": cfg.num_layers, "intermediate_size": cfg.d_ff, "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout, "max_position_embeddings": cfg.max_position_embeddings,
            "type_vocab_size": cfg.type_vocab_size, "layer_norm_eps": cfg.layer_norm_eps,
            "hidden_act": ACT_TO_HF[cfg.activation], "embedding_size": cfg.embedding_size or cfg.d_model,
            "relative_attention": cfg.relative_attention, "max_relative_positions": cfg.max_relative_positions,
            "position_buckets": cfg.position_buckets, "pos_att_type": list(cfg.pos_att_type),
            "share_att_key": cfg.share_att_key, "norm_rel_ebd": "layer_norm" if cfg.norm_rel_ebd else "none",
            "position_biased_input": cfg.position_biased_input, "pad_token_id": cfg.pad_token_id,
            "pooler_dropout": cfg.pooler_dropout, "pooler_hidden_act": ACT_TO_HF[cfg.pooler_activation],
            "pooler_hidden_size": cfg.d_model, "cls_dropout": cfg.classifier_dropout, "legacy": True,
            "tie_word_embeddings": True, **labels_to_hf(cfg.num_labels, cfg.id2label)}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, position_buckets: int = 256,
                 num_labels: int = 2) -> DebertaV2Config:
    """A DeBERTa-v3-style encoder sized for training: ``context`` positions, d_ff 4 d_model unless given."""
    return DebertaV2Config(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                           d_ff=4 * d_model if d_ff is None else d_ff, dropout=dropout,
                           max_position_embeddings=context, position_buckets=position_buckets, num_labels=num_labels)


_V3 = dict(vocab_size=128100, d_model=768, num_heads=12, d_ff=3072)
PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_layers=2, d_ff=48, dropout=0.0,
                 max_position_embeddings=64, position_buckets=8, num_labels=3),
    "deberta-v3-xsmall": dict(_V3, d_model=384, num_heads=6, d_ff=1536),          # 70.7M parameters
    "deberta-v3-small": dict(_V3, num_layers=6),                                  # 141.3M
    "deberta-v3-base": dict(_V3),                                                 # 183.8M
    "deberta-v3-large": dict(_V3, d_model=1024, num_heads=16, num_layers=24, d_ff=4096),    # 434.0M
}

DEBERTA_V2 = register_family("deberta-v2", DebertaV2Config, base_rules=BASE_RULES, config_from_hf=config_from_hf,
                             limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_position_embeddings},
                             config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                             ignore_on_load=(r"embeddings\.position_ids$",),    # a buffer older writers stored
                             special_tokens=BERT_TOKENS)
DEBERTA_V2.register("DebertaV2Model", DebertaV2Model, kind="base")
DEBERTA_V2.register("DebertaV2ForMaskedLM", DebertaV2ForMaskedLM, kind="masked-lm", prefix="deberta.",
                    head_rules=mlm_head_rules("predictions", "cls.predictions.transform.dense",
                                              "cls.predictions.transform.LayerNorm", "cls.predictions.decoder",
                                              "cls.predictions.bias"),
                    # the decoder bias is a copy of cls.predictions.bias; transformers ignores the
                    # replaced-token head that Microsoft's v3 checkpoints also carry
                    ignore_on_load=(r"^cls\.predictions\.decoder\.bias$", r"^mask_predictions\."),
                    # the non-legacy head's names (config "legacy": false, and Microsoft's checkpoints):
                    # the same dense, LayerNorm and bias; saving writes the legacy names, legacy true
                    aliases=((r"^lm_predictions\.lm_head\.(dense|LayerNorm)\.", r"cls.predictions.transform.\1."),
                             (r"^lm_predictions\.lm_head\.bias$", "cls.predictions.bias")))
DEBERTA_V2.register("DebertaV2ForSequenceClassification", DebertaV2ForSequenceClassification, kind="classifier",
                    prefix="deberta.", head_rules=[Rule("pooler.{p}", "pooler.dense.{p}"),
                                                   Rule("classifier.{p}", "classifier.{p}")])
