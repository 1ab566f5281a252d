"""The Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", section 3.1).

    pixel_values (B, C, H, W) -> PatchEmbedding: Conv2d(kernel = stride = p) -> (B, P, E)
        -> [class token; patches] + learned positions (B, 1 + P, E) -> dropout
        -> N x Pre-Norm [x = x + Attn(Norm(x)); x = x + MLP(Norm(x))]        (GELU MLP)
        -> Norm -> hidden (B, 1 + P, E)
    classifier: logits = hidden[:, 0] W + b (class token), or the mean of the patch rows ("mean" pooling),
        or their attention-weighted mean ("seq" pooling, CCT's sequence pooling; no class token then)

At 224 px and p = 16: 14 x 14 = 196 patches of 16 * 16 * 3 = 768 values, plus the class token, so
197 positions. ``VisionTransformer(img_size=224, patch_size=16, num_classes=10)`` is the chapter's
constructor; every model is also built from a :class:`ViTConfig` (``VisionTransformer.from_config``).
``norm`` "dyt" puts DyT (:class:`attnlab.nn.DyT`) in place of every LayerNorm (Zhu et al. 2025).
``tokenizer`` "conv" puts CCT's convolutional tokeniser (:class:`attnlab.nn.patch.ConvTokenizer`,
Hassani et al. 2021) in place of the patch embedding: log2(patch_size) layers of 3x3 convolution,
ReLU and stride-2 max-pooling, which give the grid that patches of ``patch_size`` give; with
``pooling="seq"`` that makes a Compact Convolutional Transformer.

Another image size: ``forward(pixel_values, interpolate_pos_encoding=True)`` resizes the grid part of
the position table bicubically (:mod:`attnlab.nn.patch`), as transformers does; without it an image
of another size is refused, as there.

Weights: transformers' ViTModel / ViTForImageClassification names (``vit.encoder.layer.{i}...``,
what its save_pretrained writes and the Hub holds); our fused Q/K/V projection is split into their
query, key and value. transformers' own ViT has neither DyT nor mean pooling: such a config writes
``norm`` (with ``dyt_alpha``, DyT's initial alpha) / ``pooling`` into config.json for attnlab to read
back, and transformers cannot run it; nor a convolutional tokeniser or sequence pooling, whose
weights attnlab saves under names of its own (``embeddings.conv_tokenizer.{i}``, ``sequence_pool``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import EncoderLayer
from ..nn.mlp import FeedForward
from ..nn.norm import make_norm
from ..nn.patch import ConvTokenizer, PatchEmbedding, PatchPositionEmbedding, SequencePooling, patch_grid
from .convert import Rule, Split
from .encoder import ACT_FROM_HF, ACT_TO_HF, Pooler, labels_from_hf, labels_to_hf
from .pretrained import SavePretrained
from .registry import KINDS, FamilyOption, register_family, register_kind

__all__ = ["ViTConfig", "ViTEncoder", "ViTModel", "VisionTransformer", "VIT", "vit_rules", "vit_config_from_hf",
           "vit_config_to_hf", "build_config", "sized_fields"]

NORMS, POOLINGS, TOKENIZERS = ("layernorm", "dyt"), ("cls", "mean", "seq"), ("patch", "conv")


@dataclass
class ViTConfig:
    image_size: int = 224
    patch_size: int = 16
    in_channels: int = 3
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    d_ff: int = 3072
    dropout: float = 0.0                  # embeddings and residual branches (hidden_dropout_prob)
    attention_dropout: float = 0.0        # attention weights (attention_probs_dropout_prob)
    layer_norm_eps: float = 1e-12         # transformers' ViTConfig default
    activation: str = "gelu"
    qkv_bias: bool = True
    norm: str = "layernorm"               # "layernorm" | "dyt"
    # DyT's initial alpha (norm "dyt"): the DyT paper's 0.5 for a ViT, or one per depth, num_layers + 1
    # numbers (each layer's two norms, then the final norm), for a residual stream that grows with depth
    dyt_alpha: float | list[float] = 0.5
    pooling: str = "cls"                  # the classifier reads the class token, the patches' mean or "seq"
    tokenizer: str = "patch"              # "patch": a linear map of each patch; "conv": CCT's conv tokeniser
    num_labels: int | None = None         # default len(id2label), else 2
    id2label: dict[int, str] | None = None

    @property
    def prefix_tokens(self) -> int:
        """The tokens before the patches: the class token, none with sequence pooling (DeiT: 2)."""
        return 0 if self.pooling == "seq" else 1

    @property
    def prefix_names(self) -> tuple[str, ...]:
        """How a viewer labels the prefix tokens (attnlab.viz)."""
        return ("[CLS]",)[:self.prefix_tokens]

    def __post_init__(self):
        who = type(self).__name__
        if self.id2label is None:
            self.id2label = {i: f"LABEL_{i}" for i in range(2 if self.num_labels is None else self.num_labels)}
        self.id2label = {int(i): str(n) for i, n in self.id2label.items()}
        if self.num_labels is None:
            self.num_labels = len(self.id2label)
        for f in ("image_size", "patch_size", "in_channels", "d_model", "num_heads", "num_layers", "d_ff",
                  "num_labels"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"{who}: {f} must be a positive integer, got {getattr(self, f)!r}")
        if self.image_size % self.patch_size:
            raise ValueError(f"{who}: image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if self.d_model % self.num_heads:
            raise ValueError(f"{who}: d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads})")
        for f in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise ValueError(f"{who}: {f} must be in [0, 1), got {getattr(self, f)}")
        per_depth = isinstance(self.dyt_alpha, (list, tuple))
        alphas = self.dyt_alpha if per_depth else [self.dyt_alpha]
        if (not all(isinstance(a, (int, float)) and a > 0 for a in alphas)
                or (per_depth and len(alphas) != self.num_layers + 1)):
            raise ValueError(f"{who}: dyt_alpha must be a positive number or {self.num_layers + 1} of them (one per "
                             f"layer, then the final norm's), got {self.dyt_alpha!r}")
        if isinstance(self.dyt_alpha, (list, tuple)):
            self.dyt_alpha = [float(a) for a in self.dyt_alpha]
        for f, allowed in (("activation", tuple(ACT_TO_HF)), ("norm", NORMS), ("pooling", POOLINGS),
                           ("tokenizer", TOKENIZERS)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"{who}: {f} must be one of {allowed}, got {getattr(self, f)!r}")
        if self.tokenizer == "conv" and (self.patch_size < 2 or self.patch_size & (self.patch_size - 1)):
            raise ValueError(f"{who}: a conv tokenizer halves the side per layer: patch_size must be 2, 4, 8, ..., got "
                             f"{self.patch_size}")
        if set(self.id2label) != set(range(self.num_labels)):
            raise ValueError(f"{who}: id2label must name classes 0 .. num_labels - 1 ({self.num_labels}), got ids "
                             f"{sorted(self.id2label)}")

    def dyt_alpha_at(self, depth: int) -> float:
        """DyT's initial alpha in layer ``depth`` (``num_layers``: the final norm)."""
        return self.dyt_alpha[depth] if isinstance(self.dyt_alpha, list) else float(self.dyt_alpha)

    @property
    def grid(self) -> tuple[int, int]:
        return patch_grid(self.image_size, self.image_size, self.patch_size)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]


# ----------------------------------------------------------------------------- the models
class ViTEncoder(SavePretrained, nn.Module):
    """Patches, prefix tokens, positions and the Pre-Norm stack, shared by ViT and DeiT.

    ``encode(pixel_values (B, C, H, W), interpolate_pos_encoding=False, first_only=False) ->
    hidden (B, prefix + P, E)``, after the final norm; ``first_only``: the last layer computes the
    first position alone (its keys and values from every token), (B, 1, E), for a head that reads
    the class token only. :meth:`prefix` gives the tokens put before the patches (here the class
    token; DeiT adds its distillation token)."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = c = config
        if c.tokenizer == "conv":
            self.patch_embed = ConvTokenizer(c.image_size, c.patch_size.bit_length() - 1, c.in_channels, c.d_model)
        else:
            self.patch_embed = PatchEmbedding(c.image_size, c.patch_size, c.in_channels, c.d_model)
        if c.prefix_tokens:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.position = PatchPositionEmbedding(self.patch_embed.grid, c.d_model, prefix=c.prefix_tokens)
        self.dropout = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, norm_first=True, norm=c.norm, eps=c.layer_norm_eps,
                         dyt_alpha=c.dyt_alpha_at(i),
                         self_attn=MultiHeadAttention(c.d_model, c.num_heads, c.attention_dropout, bias=c.qkv_bias,
                                                      out_bias=True, fused_qkv=True),
                         ff=FeedForward(c.d_model, c.d_ff, 0.0, activation=c.activation))
            for i in range(c.num_layers))
        self.norm = make_norm(c.norm, c.d_model, c.layer_norm_eps, c.dyt_alpha_at(c.num_layers))

    def reset_parameters(self) -> None:
        """Matrices, convolutions and prefix tokens ~ N(0, 0.02) truncated at 2 std (as transformers'
        ViT), biases 0, norms at their identity; the position table is initialised by its module. A
        conv tokeniser's kernels are He-initialised (fan in, for the ReLU after each), as CCT's: at
        0.02 a stack of them would shrink the image towards zero."""
        with torch.no_grad():
            for name, t in [*self.named_parameters(), *self.named_buffers()]:
                if name.startswith("position."):
                    continue
                if name.startswith("patch_embed.convs."):
                    nn.init.kaiming_normal_(t, mode="fan_in", nonlinearity="relu")
                elif t.dim() >= 2:
                    nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04)
                elif name.endswith("bias"):
                    t.zero_()

    def no_weight_decay(self) -> tuple[str, ...]:
        """The prefix tokens: learned inputs, not weights; decay would pull them to 0."""
        return tuple(n for n, _ in self.named_parameters(recurse=False) if n.endswith("_token"))

    def prefix(self, batch: int) -> Tensor:
        """The tokens before the patches, (B, prefix_tokens, E)."""
        return self.cls_token.expand(batch, -1, -1)

    def encode(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False, first_only: bool = False) -> Tensor:
        c, who = self.config, type(self).__name__
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4:
            raise ValueError(f"{who}: pixel_values must be a (batch, channels, height, width) tensor, got "
                             f"{tuple(getattr(pixel_values, 'shape', ())) or type(pixel_values).__name__}")
        H, W = pixel_values.shape[-2:]
        if not interpolate_pos_encoding and (H, W) != (c.image_size, c.image_size):
            raise ValueError(f"{who}: a {H}x{W} image, the model's is {c.image_size}x{c.image_size}; pass "
                             f"interpolate_pos_encoding=True to resize the position table to it")
        x = self.patch_embed(pixel_values.to(next(self.patch_embed.parameters()).dtype))
        if c.prefix_tokens:
            x = torch.cat([self.prefix(x.size(0)), x], dim=1)
        x = self.dropout(self.position(x, patch_grid(H, W, c.patch_size)))
        for i, layer in enumerate(self.layers):
            last = i == len(self.layers) - 1 and layer.self_attn.attention_record is None
            x = layer(x, first_only=first_only and last)
        return self.norm(x)


class BareImageEncoder:
    """What makes an image encoder a bare model (kind "image-base"): ``forward(pixel_values (B, C,
    H, W), interpolate_pos_encoding=False) -> last hidden state``, and the pooler that transformers'
    ViTModel and DeiTModel checkpoints carry (tanh(hidden[:, 0] W + b), ``model.pool(hidden)``) kept
    as buffers that no output reads, so those checkpoints round-trip and one without it loads.
    Listed before the encoder class it completes."""

    def __init__(self, config):
        super().__init__(config)
        self.pooler = Pooler(config.d_model, trainable=False)
        self.reset_parameters()

    def pool(self, hidden: Tensor) -> Tensor:
        return self.pooler(hidden)

    def forward(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> Tensor:
        return self.encode(pixel_values, interpolate_pos_encoding)


class ViTModel(BareImageEncoder, ViTEncoder):
    """The bare ViT encoder: last hidden state (B, 1 + P, E) (see :class:`BareImageEncoder`)."""


def _chapter_args(config: ViTConfig) -> dict:
    """A config as the chapter's constructor arguments plus the other ViTConfig fields."""
    chapter = dict(img_size="image_size", patch_size="patch_size", in_channels="in_channels",
                   num_classes="num_labels", embed_dim="d_model", depth="num_layers", num_heads="num_heads",
                   dropout="dropout")
    args = {ours: getattr(config, f) for ours, f in chapter.items()}
    return {**args, **{f.name: getattr(config, f.name) for f in fields(config) if f.name not in chapter.values()}}


class VisionTransformer(ViTEncoder):
    """ViT with a linear classifier (kind "image-classifier", transformers' ViTForImageClassification):
    ``forward(pixel_values (B, C, H, W), interpolate_pos_encoding=False) -> logits (B, num_classes)``.

    ``VisionTransformer(img_size=224, patch_size=16, in_channels=3, num_classes=1000, embed_dim=768,
    depth=12, num_heads=12, mlp_ratio=4.0, dropout=0.0, **options)``: the chapter's arguments
    (``dropout`` on the embeddings, the residual branches and the attention weights; the MLP is
    ``mlp_ratio * embed_dim`` wide), ``options`` any other :class:`ViTConfig` field (``pooling="mean"``,
    ``norm="dyt"``, ``d_ff``, ``attention_dropout``, ``id2label``, ...).
    ``VisionTransformer.from_config(config)`` builds one from a config."""

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_channels: int = 3, num_classes: int = 1000,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 dropout: float = 0.0, **options):
        d_ff = options.pop("d_ff", None) or int(round(embed_dim * mlp_ratio))
        options.setdefault("attention_dropout", dropout)
        config = ViTConfig(image_size=img_size, patch_size=patch_size, in_channels=in_channels, d_model=embed_dim,
                           num_layers=depth, num_heads=num_heads, d_ff=d_ff, dropout=dropout, num_labels=num_classes,
                           **options)
        super().__init__(config)
        if config.pooling == "seq":
            self.seq_pool = SequencePooling(config.d_model)
        self.head = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: ViTConfig) -> "VisionTransformer":
        return cls(**_chapter_args(config))

    def forward(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> Tensor:
        cls_pooling = self.config.pooling == "cls"
        hidden = self.encode(pixel_values, interpolate_pos_encoding, first_only=cls_pooling)
        tokens = hidden[:, self.config.prefix_tokens:]
        pooled = hidden[:, 0] if cls_pooling else self.seq_pool(tokens) if self.config.pooling == "seq" else tokens.mean(1)
        return self.head(pooled)


# ----------------------------------------------------------------------------- Hugging Face
def vit_rules() -> list[Rule]:
    """Our encoder's keys <-> transformers' ViTModel (and DeiTModel) names, as they sit on disk."""
    layer = "encoder.layer.{i}"
    qkv = tuple(f"{layer}.attention.attention.{n}.{{p}}" for n in ("query", "key", "value"))
    return [
        Rule("patch_embed.proj.{p}", "embeddings.patch_embeddings.projection.{p}"),
        Rule("patch_embed.convs.{i}.weight", "embeddings.conv_tokenizer.{i}.weight"),      # attnlab's own names
        Rule("cls_token", "embeddings.cls_token"),
        Rule("position.weight", "embeddings.position_embeddings"),
        Rule("layers.{i}.self_attn.qkv_proj.{p}", qkv, Split(0, 3)),
        *[Rule(f"layers.{{i}}.{ours}.{{p}}", f"{layer}.{theirs}.{{p}}") for ours, theirs in [
            ("self_attn.out_proj", "attention.output.dense"), ("self_attn_norm", "layernorm_before"),
            ("ff.linear1", "intermediate.dense"), ("ff.linear2", "output.dense"), ("ff_norm", "layernorm_after")]],
        Rule("norm.{p}", "layernorm.{p}"),
    ]


# our config field -> transformers' ViTConfig (and DeiTConfig) field
VIT_HF_NAMES = {
    "image_size": "image_size", "patch_size": "patch_size", "in_channels": "num_channels", "d_model": "hidden_size",
    "num_heads": "num_attention_heads", "num_layers": "num_hidden_layers", "d_ff": "intermediate_size",
    "dropout": "hidden_dropout_prob", "attention_dropout": "attention_probs_dropout_prob",
    "layer_norm_eps": "layer_norm_eps", "qkv_bias": "qkv_bias"}
# what only attnlab reads back: transformers' ViT has neither (see the module docstring)
_OWN_FIELDS = {"norm": "layernorm", "dyt_alpha": 0.5, "pooling": "cls", "tokenizer": "patch"}


def vit_config_from_hf(c: dict, cls: type = ViTConfig):
    """Our config from a transformers ViT/DeiT config.json dict; ValueError for what we do not build."""
    who = cls.__name__
    for f in ("image_size", "patch_size"):
        if isinstance(c.get(f), (list, tuple)):
            if len(set(c[f])) != 1:
                raise ValueError(f"{who}: a non-square {f} {c[f]} is not supported")
            c = {**c, f: c[f][0]}
    if c.get("pooler_output_size") not in (None, c.get("hidden_size", 768)) or c.get("pooler_act", "tanh") != "tanh":
        raise ValueError(f"{who}: only a tanh pooler of width hidden_size is supported")
    act = c.get("hidden_act", "gelu")
    if act not in ACT_FROM_HF:
        raise ValueError(f"{who}: hidden_act {act!r} is not supported ({', '.join(ACT_FROM_HF)})")
    kwargs = {ours: c[hf] for ours, hf in VIT_HF_NAMES.items() if hf in c}
    own = {f: c[f] for f in _OWN_FIELDS if f in c}
    return cls(**kwargs, **own, activation=ACT_FROM_HF[act], **labels_from_hf(c))


def vit_config_to_hf(cfg: ViTConfig) -> dict:
    own = {f: getattr(cfg, f) for f, default in _OWN_FIELDS.items() if getattr(cfg, f) != default}
    return {**{hf: getattr(cfg, ours) for ours, hf in VIT_HF_NAMES.items()}, "hidden_act": ACT_TO_HF[cfg.activation],
            "encoder_stride": cfg.patch_size, **labels_to_hf(cfg.num_labels, cfg.id2label), **own}


# ----------------------------------------------------------------------------- registration
def sized_fields(*, image_size: int, patch_size: int, in_channels: int, d_model: int, num_heads: int,
                 num_layers: int, d_ff: int | None, dropout: float, num_labels: int, norm: str, pooling: str,
                 dyt_alpha: float = 0.5) -> dict:
    """The config fields a sizing builder sets (DeiT's shares them): d_ff 4 d_model unless given,
    one dropout for the hidden states and the attention."""
    return dict(image_size=image_size, patch_size=patch_size, in_channels=in_channels, d_model=d_model,
                num_heads=num_heads, num_layers=num_layers, d_ff=d_ff or 4 * d_model, dropout=dropout,
                attention_dropout=dropout, norm=norm, dyt_alpha=dyt_alpha, pooling=pooling, num_labels=num_labels)


def build_config(*, image_size: int, patch_size: int, in_channels: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_labels: int = 2, norm: str = "layernorm",
                 pooling: str = "cls", dyt_alpha: float = 0.5, tokenizer: str = "patch") -> ViTConfig:
    """A ViT sized for training (see :func:`sized_fields`)."""
    return ViTConfig(**sized_fields(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                                    d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff,
                                    dropout=dropout, num_labels=num_labels, norm=norm, pooling=pooling,
                                    dyt_alpha=dyt_alpha), tokenizer=tokenizer)


OPTIONS = (
    FamilyOption("norm", str, "the normalisation: layernorm, or dyt (dynamic tanh, no statistics)", ("image",),
                 choices=NORMS),
    FamilyOption("pooling", str, "what the classifier reads: the class token (cls), the patches' mean, or their "
                 "attention-weighted mean (seq: CCT's sequence pooling, no class token); an image folder trains with seq, the "
                 "digits with cls, unless told", ("image",), choices=POOLINGS),
    FamilyOption("tokenizer", str, "how an image becomes tokens: patch (a linear map of each patch) or conv (CCT's "
                 "3x3 convolution, ReLU and max-pool layers, one per halving of --patch-size: 4 takes two)",
                 ("image",), choices=TOKENIZERS),
)

PRESETS = {
    "tiny": dict(image_size=16, patch_size=4, in_channels=3, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 num_labels=3),
    "vit-base-patch16-224": dict(num_labels=1000),                                            # 86.6M parameters
    "vit-small-patch16-224": dict(d_model=384, num_heads=6, d_ff=1536, num_labels=1000),      # 22.1M
}


def _hidden(c, x) -> tuple:
    return x["pixel_values"].size(0), c.prefix_tokens + c.num_patches, c.d_model


if "image-base" not in KINDS:
    register_kind("image-base", modality="image", example=KINDS["image-classifier"].example, shapes=_hidden,
                  outputs=("last_hidden_state",),
                  does="forward(pixel_values (B, C, H, W)) -> the last hidden state (B, prefix + P, E): the prefix "
                       "tokens (class, distillation) then one vector per patch (a bare model, no head)")

def hf_unsupported(config) -> str | None:
    """Why transformers' ViT/DeiT could not run ``config``: the settings it lacks (it would read
    them as its defaults, silently), else None."""
    own = [f"{f}={getattr(config, f)!r}" for f, default in _OWN_FIELDS.items() if getattr(config, f) != default
           and (f != "dyt_alpha" or config.norm == "dyt")]        # alpha means nothing without DyT
    return f"{', '.join(own)} has no transformers counterpart (it would run the defaults)" if own else None


VIT = register_family("vit", ViTConfig, base_rules=vit_rules(), config_from_hf=vit_config_from_hf,
                      config_to_hf=vit_config_to_hf, presets=PRESETS, build_config=build_config, modality="image",
                      limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                        "in_channels": c.in_channels}, options=OPTIONS, hf_unsupported=hf_unsupported)
VIT.register("ViTForImageClassification", VisionTransformer, kind="image-classifier", prefix="vit.",
             head_rules=[Rule("head.{p}", "classifier.{p}"), Rule("seq_pool.proj.{p}", "sequence_pool.{p}")],
             factory=VisionTransformer.from_config, default=True)
VIT.register("ViTModel", ViTModel, kind="image-base", head_rules=[Rule("pooler.{p}", "pooler.dense.{p}")])
