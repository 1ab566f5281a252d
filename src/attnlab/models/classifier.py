"""Text classifiers: the chapter's self-attention classifier, and any registered encoder with a head.

TextClassifier (the chapter's section "text classification", built from attnlab.nn):

    ids (B, T) -> Embedding * sqrt(E) + positions -> [CLS]? -> N x EncoderLayer -> Norm
               -> Pooling (mean | cls | attention, padding excluded) -> Dropout -> Linear -> logits (B, C)

What the chapter's version gets wrong, and what this one does instead:
- it has no padding mask: padded positions are attended to and averaged into ``x.mean(dim=1)``,
  so one text gets another prediction when batched with a longer one. Here padding is masked
  in attention and in the pooling (``attention_mask``, or the ids equal to ``pad_id``);
- its position encoding sits inside the attention block, so stacking blocks would add the
  positions again at every layer; here they are added once, after the embedding;
- one Post-Norm block, no dropout, no final norm; here ``num_layers`` Pre-Norm layers (stable
  without a long warmup) with a final norm and dropout.
Constructor names are the chapter's (vocab_size, embed_dim, num_heads, num_classes).

EncoderClassifier: a registered "base" model (one whose forward gives the last hidden state,
e.g. BertModel or GPT2Model) + Pooling + Dropout + Linear, for fine-tuning a pretrained encoder
on labels. Its config names the base's family, architecture and config, so a saved classifier
is rebuilt through the model registry like any other model.

Both are attnlab-native families of kind "classifier": ``forward(input_ids, attention_mask=None)
-> logits (B, num_labels)``; ``hidden_states(input_ids, attention_mask=None) -> (x (B, T, E),
mask (B, T) or None)`` gives the token vectors before pooling (``attnlab embed`` averages them).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from ..nn.block import EncoderLayer
from ..nn.packing import Packing
from ..nn.norm import make_norm
from ..nn.pooling import POOLINGS, Pooling
from ..nn.position import LearnedPositionalEmbedding, PositionalEncoding
from .gpt import PRESETS as _GPT_PRESETS, GPTConfig
from .pretrained import SavePretrained
from .registry import architecture_of, family, register_family

__all__ = ["TextClassifierConfig", "TextClassifier", "EncoderClassifierConfig", "EncoderClassifier"]


@dataclass
class TextClassifierConfig:
    vocab_size: int
    embed_dim: int = 128
    num_heads: int = 4
    num_classes: int = 2
    num_layers: int = 1
    d_ff: int | None = None           # default 4 * embed_dim
    pooling: str = "mean"             # "mean" | "cls" (a learned [CLS] vector is prepended) | "attention"
    dropout: float = 0.1
    max_len: int = 512                # longest input (the position table's rows)
    pad_id: int | None = 0            # ids equal to it are padding when no attention_mask is given
    positions: str = "sinusoidal"     # "sinusoidal" | "learned"
    norm_first: bool = True           # Pre-Norm layers (with a final norm); False: the chapter's Post-Norm

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.embed_dim
        for name in ("vocab_size", "embed_dim", "num_heads", "num_classes", "num_layers", "d_ff", "max_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TextClassifierConfig: {name} must be positive, got {getattr(self, name)}")
        if self.embed_dim % self.num_heads:
            raise ValueError(f"TextClassifierConfig: embed_dim ({self.embed_dim}) is not divisible by num_heads "
                             f"({self.num_heads})")
        if self.pooling not in POOLINGS or self.positions not in ("sinusoidal", "learned"):
            raise ValueError(f"TextClassifierConfig: pooling must be one of {POOLINGS} and positions 'sinusoidal' "
                             f"or 'learned', got {self.pooling!r} and {self.positions!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TextClassifierConfig: dropout must be in [0, 1), got {self.dropout}")

    @property
    def num_labels(self) -> int:      # the name Hugging Face classifiers use
        return self.num_classes

    @property
    def d_model(self) -> int:
        return self.embed_dim


def _padding(input_ids: Tensor, attention_mask: Tensor | None, pad_id: int | None, who: str) -> Tensor | None:
    if input_ids.dim() != 2:
        raise ValueError(f"{who}: input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return None if pad_id is None else input_ids != pad_id
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"{who}: attention_mask must be {tuple(input_ids.shape)} (True/1 = real token), got "
                         f"{tuple(attention_mask.shape)}")
    return attention_mask.bool()


class TextClassifier(SavePretrained, nn.Module):
    """The chapter's classifier, fixed (module docstring). forward(input_ids (B, T),
    attention_mask (B, T) True/1 = real token, default ``input_ids != pad_id``) -> logits (B, C)."""

    def __init__(self, vocab_size: int, embed_dim: int = 128, num_heads: int = 4, num_classes: int = 2,
                 num_layers: int = 1, pooling: str = "mean", dropout: float = 0.1, max_len: int = 512,
                 pad_id: int | None = 0, **options):
        super().__init__()
        c = TextClassifierConfig(vocab_size, embed_dim, num_heads, num_classes, num_layers, pooling=pooling,
                                 dropout=dropout, max_len=max_len, pad_id=pad_id, **options)
        self.config = c
        self.embedding = nn.Embedding(c.vocab_size, c.embed_dim)
        rows = c.max_len + (c.pooling == "cls")
        self.pos_encoding = (PositionalEncoding(c.embed_dim, rows, c.dropout) if c.positions == "sinusoidal"
                             else LearnedPositionalEmbedding(rows, c.embed_dim, c.dropout))
        self.cls = nn.Parameter(torch.zeros(c.embed_dim)) if c.pooling == "cls" else None
        self.layers = nn.ModuleList(EncoderLayer(c.embed_dim, c.num_heads, c.d_ff, c.dropout, norm_first=c.norm_first)
                                    for _ in range(c.num_layers))
        self.norm = make_norm("layernorm", c.embed_dim) if c.norm_first else nn.Identity()
        self.pooling = Pooling(c.pooling, c.embed_dim)
        self.dropout = nn.Dropout(c.dropout)
        self.classifier = nn.Linear(c.embed_dim, c.num_classes)
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: TextClassifierConfig) -> "TextClassifier":
        return cls(**asdict(config))

    def reset_parameters(self) -> None:
        """Xavier for the projections; the embedding N(0, E^-1/2), so that after the sqrt(E)
        scaling a token vector has unit scale like the position signal added to it."""
        for name, p in self.named_parameters():
            if p.dim() > 1 and not name.startswith("pos_encoding"):
                nn.init.xavier_uniform_(p)
        nn.init.normal_(self.embedding.weight, std=self.config.embed_dim ** -0.5)
        if self.cls is not None:
            nn.init.normal_(self.cls, std=self.config.embed_dim ** -0.5)

    def no_weight_decay(self) -> tuple[str, ...]:
        """The [CLS] vector is an embedding of one token: not decayed."""
        return () if self.cls is None else ("cls",)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(token vectors (B, T, E) after the last layer's norm, their padding mask (B, T));
        with cls pooling T includes the prepended [CLS] vector. A padded batch runs its real tokens
        alone (:class:`~attnlab.nn.packing.Packing`): the vectors are zero at padded positions."""
        mask = _padding(input_ids, attention_mask, self.config.pad_id, "TextClassifier")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"TextClassifier: token id out of range [0, {self.config.vocab_size})")
        x = self.embedding(input_ids) * math.sqrt(self.config.embed_dim)
        if self.cls is not None:               # [CLS] first, then the tokens at their usual positions + 1
            x = torch.cat([self.cls.to(x.dtype).expand(x.size(0), 1, -1), x], 1)
            if mask is not None:
                mask = torch.cat([mask.new_ones(mask.size(0), 1), mask], 1)
        x = self.pos_encoding(x)
        packing = Packing.of(mask)             # the layers and the norm run on the real tokens alone
        if packing is not None:
            x = packing.pack(x)
        for layer in self.layers:
            x = layer(x, packing=packing)
        x = self.norm(x)
        return (x if packing is None else packing.unpack(x)), mask

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        x, mask = self.hidden_states(input_ids, attention_mask)
        return self.classifier(self.dropout(self.pooling(x, mask)))


# ----------------------------------------------------------------------------- any encoder + a head
@dataclass
class EncoderClassifierConfig:
    base_model_type: str              # a registered family with a "base" architecture
    base_architecture: str
    base_config: dict = field(default_factory=dict)   # the base config's fields
    num_labels: int = 2
    pooling: str = "mean"
    dropout: float = 0.1

    def __post_init__(self):
        if self.num_labels <= 0 or self.pooling not in POOLINGS or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"EncoderClassifierConfig: num_labels must be positive, pooling one of {POOLINGS}, "
                             f"dropout in [0, 1); got {self.num_labels}, {self.pooling!r}, {self.dropout}")

    @property
    def vocab_size(self) -> int:
        return self.base_config["vocab_size"]


class EncoderClassifier(SavePretrained, nn.Module):
    """A registered base model + pooling + linear head (module docstring). forward(input_ids (B, T),
    attention_mask (B, T) or None = every token real) -> logits (B, num_labels)."""

    def __init__(self, config: EncoderClassifierConfig):
        super().__init__()
        self.config = config
        fam = family(config.base_model_type, "EncoderClassifierConfig")
        arch = fam.architecture(config.base_architecture, "EncoderClassifierConfig")
        if arch.kind != "base":
            raise ValueError(f"EncoderClassifier: {arch.name} is a {arch.kind} model, not a base encoder")
        self.encoder = arch.build(fam.config_cls(**config.base_config))
        width = self.encoder.config.d_model
        self.pooling = Pooling(config.pooling, width)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(width, config.num_labels)
        nn.init.normal_(self.classifier.weight, std=0.02)         # BERT's head initialisation
        nn.init.zeros_(self.classifier.bias)

    @classmethod
    def from_base(cls, base: nn.Module, num_labels: int, pooling: str = "mean",
                  dropout: float = 0.1) -> "EncoderClassifier":
        """A classifier whose encoder holds ``base``'s weights (a pretrained model of kind "base")."""
        arch = architecture_of(base)
        model = cls(EncoderClassifierConfig(arch.model_type, arch.name, asdict(base.config), num_labels, pooling,
                                            dropout))
        model.encoder.load_state_dict(base.state_dict())
        return model

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        mask = _padding(input_ids, attention_mask, None, "EncoderClassifier")
        return self.encoder(input_ids, attention_mask=mask), mask

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        x, mask = self.hidden_states(input_ids, attention_mask)
        return self.classifier(self.dropout(self.pooling(x, mask)))


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_classes: int = 2, pooling: str = "mean",
                 pad_id: int | None = 0, positions: str = "sinusoidal",
                 norm_first: bool = True) -> TextClassifierConfig:
    """A TextClassifier sized for training: ``context`` is the longest input, d_ff 4 d_model unless given."""
    return TextClassifierConfig(vocab_size, d_model, num_heads, num_classes, num_layers, d_ff, pooling, dropout,
                                context, pad_id, positions, norm_first)


def build_encoder_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                         d_ff: int | None = None, dropout: float = 0.0, base_model_type: str = "gpt2",
                         num_labels: int = 2, pooling: str = "mean") -> EncoderClassifierConfig:
    """An EncoderClassifier over a fresh base of ``base_model_type``, sized by that family's builder."""
    fam = family(base_model_type, "build_config")
    base = fam.build_config(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                            num_layers=num_layers, d_ff=d_ff, dropout=dropout)
    return EncoderClassifierConfig(base_model_type, fam.for_kind("base").name, asdict(base), num_labels, pooling,
                                   dropout)


def _base_limits(config: EncoderClassifierConfig) -> dict:
    fam = family(config.base_model_type, "EncoderClassifierConfig")
    return fam.input_limits(fam.config_cls(**config.base_config))


TEXT_CLASSIFIER = register_family("text-classifier", TextClassifierConfig, build_config=build_config,
                                  limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_len}, presets={
    "tiny": dict(vocab_size=96, embed_dim=32, num_heads=4, num_classes=3, num_layers=2, max_len=64, dropout=0.0),
    "chapter": dict(vocab_size=10000, embed_dim=128, num_heads=4, num_classes=2, num_layers=1)})
TEXT_CLASSIFIER.register("TextClassifier", TextClassifier, kind="classifier", factory=TextClassifier.from_config)

ENCODER_CLASSIFIER = register_family("encoder-classifier", EncoderClassifierConfig, build_config=build_encoder_config,
                                     limits=_base_limits,
                                     presets={"tiny": dict(base_model_type="gpt2", base_architecture="GPT2Model",
                                                           base_config=asdict(GPTConfig(**_GPT_PRESETS["tiny"])),
                                                           num_labels=3, dropout=0.0)})
ENCODER_CLASSIFIER.register("EncoderClassifier", EncoderClassifier, kind="classifier")
