"""The Swin Transformer (Liu et al. 2021, "Swin Transformer: Hierarchical Vision Transformer using
Shifted Windows", section 3).

    pixel_values (B, C, H, W) -> pad to multiples of p -> Conv2d(kernel = stride = p) -> LayerNorm
        -> (B, H/p * W/p, E) -> dropout
        -> stage 1 .. S: depth_i x SwinBlock, then PatchMerging (not after the last stage)
               SwinBlock: x = x + DropPath((S)W-MSA(Norm(x)));  x = x + DropPath(MLP(Norm(x)))
               blocks alternate plain windows (even) and windows shifted by M // 2 (odd)
               PatchMerging: 2 x 2 tokens -> one token of twice the width
        -> Norm -> hidden (B, P_S, E * 2^(S-1))
    classifier: logits = mean(hidden over tokens) W + b

Window attention and its blocks are :mod:`attnlab.nn.window`. Each stage halves the map and
doubles the width and the heads (Swin-T: 96 wide, depths 2, 2, 6, 2, heads 3, 6, 12, 24, window 7:
maps of 56, 28, 14 and 7 tokens a side at 224 px). No class token and no absolute positions: the
relative position bias in every window is all the model knows of where a token sits, so any
image size runs.

Weights: transformers' SwinModel / SwinForImageClassification names as its save_pretrained writes
them and the Hub holds (``encoder.layers.{stage}.blocks.{block}.attention.self.query`` ...); our fused
Q/K/V projection is split into their query, key and value. Stochastic depth sits on both residual
branches as in the paper and timm (transformers' Swin drops the attention branch only); a model in
eval mode computes the same either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.checkpoint import checkpoint
from ..nn.inplace import may_overwrite
from ..nn.mlp import FeedForward
from ..nn.norm import LayerNorm
from ..nn.patch import PatchEmbedding
from ..nn.window import DropPath, PatchMerging, WindowAttention
from . import vit  # noqa: F401  (registers the "image-base" kind, bare image encoders)
from .convert import Rule, Split
from .encoder import ACT_FROM_HF, ACT_TO_HF, Encoder, labels_from_hf, labels_to_hf
from .registry import FamilyOption, register_family

__all__ = ["SwinConfig", "SwinBlock", "SwinEncoder", "SwinModel", "SwinForImageClassification", "SWIN",
           "swin_rules", "build_config"]

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


@dataclass
class SwinConfig:
    image_size: int = 224
    patch_size: int = 4
    in_channels: int = 3
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    dropout: float = 0.0                  # embeddings and residual branches (hidden_dropout_prob)
    attention_dropout: float = 0.0        # attention weights (attention_probs_dropout_prob)
    drop_path_rate: float = 0.1           # stochastic depth, rising linearly to this over the blocks
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5          # the blocks' and the final norm (the stem and merges use 1e-5)
    num_labels: int | None = None         # default len(id2label), else 2
    id2label: dict[int, str] | None = None

    prefix_tokens = 0                     # no class token: the classifier averages the tokens

    def __post_init__(self):
        who = type(self).__name__
        self.depths, self.num_heads = tuple(self.depths), tuple(self.num_heads)
        if self.id2label is None:
            self.id2label = {i: f"LABEL_{i}" for i in range(2 if self.num_labels is None else self.num_labels)}
        self.id2label = {int(i): str(n) for i, n in self.id2label.items()}
        if self.num_labels is None:
            self.num_labels = len(self.id2label)
        for f in ("image_size", "patch_size", "in_channels", "embed_dim", "window_size", "num_labels"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"{who}: {f} must be a positive integer, got {getattr(self, f)!r}")
        if not self.depths or len(self.num_heads) != len(self.depths):
            raise ValueError(f"{who}: depths {self.depths} and num_heads {self.num_heads} must name the same, "
                             f"non-zero number of stages")
        if any(not isinstance(n, int) or n <= 0 for n in (*self.depths, *self.num_heads)):
            raise ValueError(f"{who}: depths and num_heads must be positive integers, got {self.depths}, "
                             f"{self.num_heads}")
        for i, h in enumerate(self.num_heads):
            if self.stage_dim(i) % h:
                raise ValueError(f"{who}: stage {i} is {self.stage_dim(i)} wide, not divisible by its {h} heads")
        if self.mlp_ratio <= 0 or int(self.mlp_ratio * self.embed_dim) <= 0:
            raise ValueError(f"{who}: mlp_ratio must be positive, got {self.mlp_ratio}")
        for f in ("dropout", "attention_dropout", "drop_path_rate"):
            if not 0.0 <= getattr(self, f) < 1.0:
                raise ValueError(f"{who}: {f} must be in [0, 1), got {getattr(self, f)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"{who}: activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if set(self.id2label) != set(range(self.num_labels)):
            raise ValueError(f"{who}: id2label must name classes 0 .. num_labels - 1 ({self.num_labels}), got ids "
                             f"{sorted(self.id2label)}")

    def stage_dim(self, i: int) -> int:
        """Stage i's width: embed_dim doubled by each patch merging before it."""
        return self.embed_dim * 2 ** i

    @property
    def d_model(self) -> int:
        """The width of the last hidden state (transformers' hidden_size)."""
        return self.stage_dim(len(self.depths) - 1)

    def grids(self, height: int, width: int) -> list[tuple[int, int]]:
        """Each stage's (rows, columns) of tokens for a (height, width) image: the patch grid of the
        image padded to multiples of the patch size, then halved (rounding up) by each merging."""
        grid = [(-(-height // self.patch_size), -(-width // self.patch_size))]
        for _ in self.depths[1:]:
            grid.append(((grid[-1][0] + 1) // 2, (grid[-1][1] + 1) // 2))
        return grid

    @property
    def num_patches(self) -> int:
        """Tokens of the last hidden state at image_size (each covers p * 2^(S-1) pixels a side)."""
        rows, cols = self.grids(self.image_size, self.image_size)[-1]
        return rows * cols


# ----------------------------------------------------------------------------- the models
class SwinBlock(nn.Module):
    """One Swin block over a (B, H, W, C) map given as (B, H * W, C) with its ``size`` (H, W):
    Pre-Norm window attention (shifted by ``shift``) and a Pre-Norm MLP, each branch through
    dropout and stochastic depth before its residual add."""

    def __init__(self, dim: int, num_heads: int, window: int, shift: int, c: SwinConfig, drop_path: float):
        super().__init__()
        self.attn_norm = LayerNorm(dim, eps=c.layer_norm_eps)
        self.attn = WindowAttention(dim, num_heads, window, shift, c.attention_dropout, c.qkv_bias)
        self.ff_norm = LayerNorm(dim, eps=c.layer_norm_eps)
        self.ff = FeedForward(dim, int(c.mlp_ratio * dim), 0.0, activation=c.activation)
        self.dropout = nn.Dropout(c.dropout)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: Tensor, size: tuple[int, int]) -> Tensor:
        B, L, C = x.shape
        h = self.attn(self.attn_norm(x).view(B, *size, C)).reshape(B, L, C)
        x = self._residual(x, h, self.attn)
        return self._residual(x, self.ff(self.ff_norm(x)), self.ff)

    def _residual(self, x: Tensor, h: Tensor, branch: nn.Module) -> Tensor:
        """x + DropPath(Dropout(h)), ``h`` the output of ``branch``; in inference the sum is
        written into h (attnlab.nn.inplace: same bits, no fresh tensor)."""
        h = self.drop_path(self.dropout(h))
        return h.add_(x) if h.shape == x.shape and may_overwrite(self, h, branch) else x + h


class SwinStage(nn.Module):
    """A stage's modules, run by :meth:`SwinEncoder.encode`: ``blocks`` at one resolution, then
    ``downsample`` (a :class:`PatchMerging`, or None after the last stage)."""

    def __init__(self, blocks: list[SwinBlock], downsample: PatchMerging | None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.downsample = downsample

    def forward(self, x: Tensor, size: tuple[int, int], checkpointed: bool = False) -> tuple[Tensor, tuple[int, int]]:
        """(B, H * W, C) at ``size`` -> the next stage's input and size. One call per stage (not
        its blocks one by one from outside), so that a wrapper of the stage, such as FSDP's, sees
        its forward."""
        for block in self.blocks:
            x = checkpoint(block, x, size) if checkpointed else block(x, size)
        if self.downsample is not None:
            x = self.downsample(x.view(x.size(0), *size, -1))
            size = x.shape[1:3]
            x = x.flatten(1, 2)
        return x, size


class SwinEncoder(Encoder):
    """Patches, stages and the final norm (see the module docstring), shared by the bare model and
    the classifier. ``encode(pixel_values (B, C, H, W)) -> hidden (B, P_S, d_model)``, any H and W.
    :meth:`stack` gives the blocks in the order they run, so that each block is one layer of an
    attention record (attnlab.viz.record_attention) as in transformers' per-block attention."""

    def __init__(self, config: SwinConfig):
        super().__init__(config)
        c, p = config, config.patch_size
        self.patch_embed = PatchEmbedding(-(-c.image_size // p) * p, p, c.in_channels, c.embed_dim)
        self.embed_norm = LayerNorm(c.embed_dim)
        self.dropout = nn.Dropout(c.dropout)
        total = sum(c.depths)
        rates = [c.drop_path_rate * i / max(total - 1, 1) for i in range(total)]
        stages, first = [], 0
        for i, (depth, heads) in enumerate(zip(c.depths, c.num_heads)):
            dim = c.stage_dim(i)
            blocks = [SwinBlock(dim, heads, c.window_size, 0 if b % 2 == 0 else c.window_size // 2, c,
                                rates[first + b]) for b in range(depth)]
            first += depth
            stages.append(SwinStage(blocks, PatchMerging(dim) if i < len(c.depths) - 1 else None))
        self.stages = nn.ModuleList(stages)
        self.norm = LayerNorm(c.d_model, eps=c.layer_norm_eps)

    def stack(self):
        return [block for stage in self.stages for block in stage.blocks]

    def reset_parameters(self) -> None:
        """Matrices and convolutions ~ N(0, 0.02) truncated at 2 std (timm's Swin), biases 0, norms
        at their identity, the relative position tables 0 (transformers' Swin)."""
        with torch.no_grad():
            for name, t in self.named_parameters():
                if name.endswith("position.table"):
                    t.zero_()
                elif t.dim() >= 2:
                    nn.init.trunc_normal_(t, std=0.02, a=-0.04, b=0.04)
                elif name.endswith("bias"):
                    t.zero_()

    def pool(self, hidden: Tensor) -> Tensor:
        """The mean of the tokens, (B, d_model): what the classifier reads (transformers' pooler_output)."""
        return hidden.mean(1)

    def _check(self, pixel_values) -> None:
        c, who = self.config, type(self).__name__
        if not isinstance(pixel_values, Tensor) or pixel_values.dim() != 4 or pixel_values.size(1) != c.in_channels:
            got = tuple(pixel_values.shape) if isinstance(pixel_values, Tensor) else type(pixel_values).__name__
            raise ValueError(f"{who}: pixel_values must be a (batch, {c.in_channels}, height, width) tensor, got {got}")

    def encode(self, pixel_values: Tensor) -> Tensor:
        self._check(pixel_values)
        p = self.config.patch_size
        H, W = pixel_values.shape[-2:]
        x = pixel_values.to(self.patch_embed.proj.weight.dtype)
        if H % p or W % p:                   # pad the image on the right and bottom to whole patches
            x = F.pad(x, (0, -W % p, 0, -H % p))
        x = self.dropout(self.embed_norm(self.patch_embed(x)))
        size = (-(-H // p), -(-W // p))
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for stage in self.stages:
            x, size = stage(x, size, checkpointed)
        return self.norm(x)


class SwinModel(SwinEncoder):
    """The bare Swin encoder (kind "image-base", transformers' SwinModel): ``forward(pixel_values
    (B, C, H, W)) -> last hidden state (B, P_S, d_model)``; ``pool(hidden)`` is transformers'
    pooler_output (the mean of the tokens, no weights)."""

    def __init__(self, config: SwinConfig):
        super().__init__(config)
        self.reset_parameters()

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.encode(pixel_values)


class SwinForImageClassification(SwinEncoder):
    """Swin with a linear classifier on the mean of the last hidden state (kind "image-classifier"):
    ``forward(pixel_values (B, C, H, W)) -> logits (B, num_labels)``."""

    def __init__(self, config: SwinConfig):
        super().__init__(config)
        self.head = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.head(self.pool(self.encode(pixel_values)))


# ----------------------------------------------------------------------------- Hugging Face
def swin_rules() -> list[Rule]:
    """Our encoder's keys <-> transformers' SwinModel names, as its save_pretrained writes them."""
    ours, theirs = "stages.{s}.blocks.{b}", "encoder.layers.{s}.blocks.{b}"
    qkv = tuple(f"{theirs}.attention.self.{n}.{{p}}" for n in ("query", "key", "value"))
    return [
        Rule("patch_embed.proj.{p}", "embeddings.patch_embeddings.projection.{p}"),
        Rule("embed_norm.{p}", "embeddings.norm.{p}"),
        Rule(f"{ours}.attn.attn.qkv_proj.{{p}}", qkv, Split(0, 3)),
        Rule(f"{ours}.attn.attn.position.table", f"{theirs}.attention.self.relative_position_bias_table"),
        *[Rule(f"{ours}.{a}.{{p}}", f"{theirs}.{t}.{{p}}") for a, t in [
            ("attn.attn.out_proj", "attention.output.dense"), ("attn_norm", "layernorm_before"),
            ("ff.linear1", "intermediate.dense"), ("ff.linear2", "output.dense"), ("ff_norm", "layernorm_after")]],
        Rule("stages.{s}.downsample.{m}.{p}", "encoder.layers.{s}.downsample.{m}.{p}"),
        Rule("norm.{p}", "layernorm.{p}"),
    ]


# transformers' in-memory names (what a state dict saved without its save_pretrained holds) ->
# the names on disk that the rules read
ALIASES = tuple((rf"\.attention\.{new}\.", f".attention.{old}.") for new, old in [
    ("q_proj", "self.query"), ("k_proj", "self.key"), ("v_proj", "self.value"), ("o_proj", "output.dense")]) + (
    (r"\.attention\.relative_position_bias\.relative_position_bias_table$",
     ".attention.self.relative_position_bias_table"),
    (r"\.mlp\.fc1\.", ".intermediate.dense."), (r"\.mlp\.fc2\.", ".output.dense."))

# our config field -> transformers' SwinConfig field
SWIN_HF_NAMES = {
    "image_size": "image_size", "patch_size": "patch_size", "in_channels": "num_channels", "embed_dim": "embed_dim",
    "depths": "depths", "num_heads": "num_heads", "window_size": "window_size", "mlp_ratio": "mlp_ratio",
    "qkv_bias": "qkv_bias", "dropout": "hidden_dropout_prob", "attention_dropout": "attention_probs_dropout_prob",
    "drop_path_rate": "drop_path_rate", "layer_norm_eps": "layer_norm_eps"}


def swin_config_from_hf(c: dict) -> SwinConfig:
    """Our config from a transformers Swin config.json dict; ValueError for what we do not build."""
    for f in ("image_size", "patch_size"):
        if isinstance(c.get(f), (list, tuple)):
            if len(set(c[f])) != 1:
                raise ValueError(f"SwinConfig: a non-square {f} {c[f]} is not supported")
            c = {**c, f: c[f][0]}
    if c.get("use_absolute_embeddings", False):
        raise ValueError("SwinConfig: use_absolute_embeddings=true (an absolute position table) is not supported")
    act = c.get("hidden_act", "gelu")
    if ACT_FROM_HF.get(act) not in ACTIVATIONS:
        known = ", ".join(hf for hf, ours in ACT_FROM_HF.items() if ours in ACTIVATIONS)
        raise ValueError(f"SwinConfig: hidden_act {act!r} is not supported ({known})")
    kwargs = {ours: c[hf] for ours, hf in SWIN_HF_NAMES.items() if hf in c}
    return SwinConfig(**kwargs, activation=ACT_FROM_HF[act], **labels_from_hf(c))


def swin_config_to_hf(cfg: SwinConfig) -> dict:
    out = {hf: getattr(cfg, ours) for ours, hf in SWIN_HF_NAMES.items()}
    return {**out, "depths": list(cfg.depths), "num_heads": list(cfg.num_heads), "use_absolute_embeddings": False,
            "hidden_act": ACT_TO_HF[cfg.activation], "encoder_stride": cfg.patch_size * 2 ** (len(cfg.depths) - 1),
            **labels_to_hf(cfg.num_labels, cfg.id2label)}


# ----------------------------------------------------------------------------- registration
def build_config(*, image_size: int, patch_size: int, in_channels: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_labels: int = 2, window_size: int | None = None,
                 drop_path_rate: float = 0.1) -> SwinConfig:
    """A Swin sized for training: ``num_layers`` blocks in stages of two (a plain and a shifted
    window block; an odd count ends with a stage of one), ``d_model`` and ``num_heads`` the first
    stage's (each later stage doubles both), MLP ``d_ff / d_model`` times each stage's width
    (default 4), the window half the patch grid's side, at most 7, unless given."""
    depths = (2,) * (num_layers // 2) + (1,) * (num_layers % 2)
    window = window_size or max(1, min(7, -(-image_size // patch_size) // 2))
    return SwinConfig(image_size=image_size, patch_size=patch_size, in_channels=in_channels, embed_dim=d_model,
                      depths=depths, num_heads=tuple(num_heads * 2 ** i for i in range(len(depths))),
                      window_size=window, mlp_ratio=d_ff / d_model if d_ff else 4.0, dropout=dropout,
                      attention_dropout=dropout, drop_path_rate=drop_path_rate, num_labels=num_labels)


OPTIONS = (
    FamilyOption("window_size", int, "Swin's window side in tokens (default: half the patch grid, at most 7)",
                 ("image",), check=lambda v: None if v > 0 else "must be positive"),
    FamilyOption("drop_path_rate", float, "Swin's stochastic depth, rising to this over the blocks", ("image",),
                 check=lambda v: None if 0.0 <= v < 1.0 else "must be in [0, 1)"),
)

PRESETS = {
    "tiny": dict(image_size=32, patch_size=4, embed_dim=16, depths=(2, 2), num_heads=(2, 4), window_size=4,
                 num_labels=3),
    "swin-t": dict(num_labels=1000),                                                      # 28.3M parameters
    "swin-s": dict(depths=(2, 2, 18, 2), num_labels=1000),                                # 49.6M
    "swin-b": dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), num_labels=1000),   # 87.8M
}

SWIN = register_family("swin", SwinConfig, base_rules=swin_rules(), config_from_hf=swin_config_from_hf,
                       config_to_hf=swin_config_to_hf, presets=PRESETS, build_config=build_config, modality="image",
                       limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                         "in_channels": c.in_channels}, options=OPTIONS,
                       ignore_on_load=(r"attention\.self\.relative_position_index$",))
SWIN.register("SwinForImageClassification", SwinForImageClassification, kind="image-classifier", prefix="swin.",
              head_rules=[Rule("head.{p}", "classifier.{p}")], aliases=ALIASES)
SWIN.register("SwinModel", SwinModel, kind="image-base", aliases=ALIASES)
