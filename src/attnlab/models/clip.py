"""CLIP (Radford et al. 2021, "Learning Transferable Visual Models From Natural Language
Supervision", section 2.3): an image tower and a text tower that meet in one embedding space.

    pixel_values (B, C, H, W) -> patches (Conv2d, no bias) -> [class; patches] + positions
        -> LayerNorm ("pre_layrnorm") -> N x Pre-Norm encoder layer -> class row -> LayerNorm
        -> W_image (no bias) -> image vector (B, P)
    input_ids (B, T) -> tokens + positions -> N x Pre-Norm *causal* encoder layer -> LayerNorm
        -> the row of the end-of-text token -> W_text (no bias) -> text vector (B, P)
    logits_per_text = exp(t) * normalise(text) normalise(image)^T   (B_text, B_image); per image: its transpose

Training pulls the matching (image, caption) pairs of a batch together and pushes the others apart:
the cross-entropy over each row of ``logits_per_image`` and each row of ``logits_per_text``,
averaged (:meth:`CLIPModel.loss`). The temperature t (``logit_scale``) is learned, in log space.

Which text row is the sentence's vector: the first end-of-text token (``eos_token_id``). A config whose
``eos_token_id`` is 2 reads the row of the largest token id instead, as transformers does for
checkpoints written before it knew the end token's id (OpenAI's BPE gives the end token the largest id).

Weights: transformers' CLIPModel names (``text_model.encoder.layers.{i}.self_attn.q_proj...``).
Both towers share the activation (QuickGELU in OpenAI's checkpoints) and the norm's epsilon.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import EncoderLayer
from ..nn.mlp import FeedForward
from ..nn.patch import PatchEmbedding, PatchPositionEmbedding, patch_grid
from .convert import Op, Rule
from .pretrained import SavePretrained
from .registry import KINDS, register_family, register_kind

__all__ = ["CLIPConfig", "CLIPModel", "CLIPVisionTower", "CLIPTextTower", "CLIP", "contrastive_loss"]

ACT_FROM_HF = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu"}
ACT_TO_HF = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


@dataclass
class CLIPConfig:
    # text tower
    vocab_size: int = 49408
    context: int = 77                       # max_position_embeddings: the longest text
    text_d_model: int = 512
    text_num_heads: int = 8
    text_num_layers: int = 12
    text_d_ff: int = 2048
    pad_token_id: int = 1
    bos_token_id: int = 49406
    eos_token_id: int = 49407
    # image tower
    image_size: int = 224
    patch_size: int = 32
    in_channels: int = 3
    vision_d_model: int = 768
    vision_num_heads: int = 12
    vision_num_layers: int = 12
    vision_d_ff: int = 3072
    # shared
    projection_dim: int = 512
    activation: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    attention_dropout: float = 0.0
    logit_scale_init: float = 2.6592        # log(1 / 0.07): the paper's initial temperature

    def __post_init__(self):
        for f in ("vocab_size", "context", "text_d_model", "text_num_heads", "text_num_layers", "text_d_ff",
                  "image_size", "patch_size", "in_channels", "vision_d_model", "vision_num_heads",
                  "vision_num_layers", "vision_d_ff", "projection_dim"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                raise ValueError(f"CLIPConfig: {f} must be a positive integer, got {getattr(self, f)!r}")
        for tower in ("text", "vision"):
            d, h = getattr(self, f"{tower}_d_model"), getattr(self, f"{tower}_num_heads")
            if d % h:
                raise ValueError(f"CLIPConfig: {tower}_d_model ({d}) is not divisible by {tower}_num_heads ({h})")
        if self.image_size % self.patch_size:
            raise ValueError(f"CLIPConfig: image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}")
        if self.activation not in ACT_TO_HF:
            raise ValueError(f"CLIPConfig: activation must be one of {tuple(ACT_TO_HF)}, got {self.activation!r}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"CLIPConfig: attention_dropout must be in [0, 1), got {self.attention_dropout}")


def _layers(n: int, d: int, heads: int, d_ff: int, c: CLIPConfig, causal: bool) -> nn.ModuleList:
    return nn.ModuleList(
        EncoderLayer(d, heads, d_ff, 0.0, norm_first=True, eps=c.layer_norm_eps,
                     self_attn=MultiHeadAttention(d, heads, c.attention_dropout, causal=causal),
                     ff=FeedForward(d, d_ff, activation=c.activation))
        for _ in range(n))


class CLIPVisionTower(nn.Module):
    """pixel_values (B, C, H, W) -> (last hidden state (B, 1 + P, E), pooled (B, E)): the class row
    after the final norm. ``interpolate_pos_encoding``: another image size, the grid part of the
    position table resized bicubically."""

    def __init__(self, c: CLIPConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbedding(c.image_size, c.patch_size, c.in_channels, c.vision_d_model, bias=False)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.vision_d_model))
        self.position = PatchPositionEmbedding(self.patch_embed.grid, c.vision_d_model, prefix=1)
        self.pre_norm = nn.LayerNorm(c.vision_d_model, eps=c.layer_norm_eps)
        self.layers = _layers(c.vision_num_layers, c.vision_d_model, c.vision_num_heads, c.vision_d_ff, c, False)
        self.post_norm = nn.LayerNorm(c.vision_d_model, eps=c.layer_norm_eps)

    def no_weight_decay(self) -> tuple[str, ...]:
        """The class token, a learned input as the patch positions are (whichever model holds the tower)."""
        return ("cls_token",)

    def forward(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> tuple[Tensor, Tensor]:
        x = self.hidden_states(pixel_values, len(self.layers), interpolate_pos_encoding)
        return x, self.post_norm(x[:, 0])

    def hidden_states(self, pixel_values: Tensor, layers: int, interpolate_pos_encoding: bool = False) -> Tensor:
        """(B, 1 + P, E): the tokens after the first ``layers`` layers (0: the embeddings after
        ``pre_norm``), transformers' ``hidden_states[layers]`` (a vision-language model reads one)."""
        c = self.config
        H, W = pixel_values.shape[-2:]
        if not interpolate_pos_encoding and (H, W) != (c.image_size, c.image_size):
            raise ValueError(f"CLIPModel: a {H}x{W} image, the model's is {c.image_size}x{c.image_size}; pass "
                             f"interpolate_pos_encoding=True to resize the position table to it")
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], dim=1)
        x = self.pre_norm(self.position(x, patch_grid(H, W, c.patch_size)))
        for layer in self.layers[:layers]:
            x = layer(x)
        return x


class CLIPTextTower(nn.Module):
    """input_ids (B, T), attention_mask (B, T) True/1 for real tokens -> (last hidden state
    (B, T, E) after the final norm, pooled (B, E): the end-of-text row, see the module docstring)."""

    def __init__(self, c: CLIPConfig):
        super().__init__()
        self.config = c
        self.token_embedding = nn.Embedding(c.vocab_size, c.text_d_model)
        self.position_embedding = nn.Embedding(c.context, c.text_d_model)
        self.layers = _layers(c.text_num_layers, c.text_d_model, c.text_num_heads, c.text_d_ff, c, True)
        self.final_norm = nn.LayerNorm(c.text_d_model, eps=c.layer_norm_eps)

    def end_positions(self, input_ids: Tensor) -> Tensor:
        """(B,) the row each text is read at."""
        if self.config.eos_token_id == 2:
            return input_ids.argmax(-1)
        return (input_ids == self.config.eos_token_id).int().argmax(-1)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        T = input_ids.size(1)
        if T > self.config.context:
            raise ValueError(f"CLIPModel: a text of {T} tokens, the model takes at most {self.config.context}")
        x = self.token_embedding(input_ids) + self.position_embedding.weight[:T]
        mask = None if attention_mask is None else attention_mask.bool()
        for layer in self.layers:
            x = layer(x, key_padding_mask=mask)
        x = self.final_norm(x)
        return x, x[torch.arange(x.size(0), device=x.device), self.end_positions(input_ids)]


class CLIPModel(SavePretrained, nn.Module):
    """The two towers and their projections (kind "contrastive").

    ``forward(input_ids (B_t, T), pixel_values (B_i, C, H, W), attention_mask=None) ->
    (logits_per_image (B_i, B_t), logits_per_text (B_t, B_i), text_embeds (B_t, P), image_embeds
    (B_i, P))``, the embeddings of unit length, as transformers' CLIPOutput. ``image_features`` /
    ``text_features`` give the projected vectors before normalisation (transformers'
    ``get_image_features`` / ``get_text_features``)."""

    def __init__(self, config: CLIPConfig):
        super().__init__()
        self.config = c = config
        self.text_model = CLIPTextTower(c)
        self.vision_model = CLIPVisionTower(c)
        self.visual_projection = nn.Linear(c.vision_d_model, c.projection_dim, bias=False)
        self.text_projection = nn.Linear(c.text_d_model, c.projection_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(float(c.logit_scale_init)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Matrices, embeddings and the class token ~ N(0, 0.02), biases 0, norms at identity; the
        temperature at ``logit_scale_init``."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2 or name.endswith("_token"):
                    nn.init.normal_(p, std=0.02)
                elif name.endswith("bias"):
                    p.zero_()
                elif name.endswith("weight"):
                    p.fill_(1.0)
            self.logit_scale.fill_(float(self.config.logit_scale_init))

    def no_weight_decay(self) -> tuple[str, ...]:
        """The class token, the position tables and the temperature: learned inputs and a scalar
        that decay would pull towards zero."""
        return ("vision_model.cls_token", "vision_model.position.weight", "text_model.position_embedding.weight",
                "logit_scale")

    def image_features(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> Tensor:
        return self.visual_projection(self.vision_model(pixel_values, interpolate_pos_encoding)[1])

    def text_features(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.text_projection(self.text_model(input_ids, attention_mask)[1])

    def forward(self, input_ids: Tensor, pixel_values: Tensor, attention_mask: Tensor | None = None,
                interpolate_pos_encoding: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        image = F.normalize(self.image_features(pixel_values, interpolate_pos_encoding), dim=-1)
        text = F.normalize(self.text_features(input_ids, attention_mask), dim=-1)
        logits_per_text = text @ image.t() * self.logit_scale.exp()
        return logits_per_text.t(), logits_per_text, text, image

    def loss(self, batch: dict, forward=None):
        """The symmetric contrastive loss of a batch (:func:`contrastive_loss`), with the number of
        images whose own caption scores highest as its metric. Row i of ``input_ids`` describes
        image i, or, with ``text_index`` (B_i,), image i is described by text ``text_index[i]``
        (several images may share one caption, a class name's)."""
        from .objective import Objective
        forward = forward or self
        logits_per_image = forward(batch["input_ids"], batch["pixel_values"], batch.get("attention_mask"))[0]
        loss, correct = contrastive_loss(logits_per_image, batch.get("text_index"))
        n = logits_per_image.size(0)
        return Objective(loss * n, n, {"correct": correct})


def contrastive_loss(logits_per_image: Tensor, text_index: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(the mean of the image->text and text->image cross-entropies, the number of images whose
    own caption scores highest) for (B_i, B_t) logits. Image i's caption is text ``text_index[i]``
    (default: i, the diagonal, B_i == B_t); a text that describes several images takes them all as
    its targets, each with an equal share (the text->image cross-entropy against that distribution)."""
    B, n_texts = logits_per_image.shape
    if text_index is None:
        text_index = torch.arange(B, device=logits_per_image.device)
    share = F.one_hot(text_index, n_texts).t().to(logits_per_image.dtype)          # (B_t, B_i)
    share = share / share.sum(-1, keepdim=True)
    loss = (F.cross_entropy(logits_per_image, text_index) + F.cross_entropy(logits_per_image.t(), share)) / 2
    return loss, (logits_per_image.argmax(-1) == text_index).sum().detach()


# ----------------------------------------------------------------------------- Hugging Face
class Unsqueeze(Op):
    """Ours carries ``lead`` leading dimensions of size 1 that the checkpoint's tensor has not
    (a class token (1, 1, E) against (E,), a position table (1, N, E) against (N, E))."""
    name = "unsqueeze"

    def __init__(self, lead: int):
        self.lead = lead

    def to_hf(self, tensors, config):
        return [t.reshape(t.shape[self.lead:]) for t in tensors]

    def from_hf(self, tensors, config):
        return [t.reshape((1,) * self.lead + tuple(t.shape)) for t in tensors]


def _tower_rules(ours: str, theirs: str) -> list[Rule]:
    layer = f"{theirs}.encoder.layers.{{i}}"
    return [Rule(f"{ours}.layers.{{i}}.{o}.{{p}}", f"{layer}.{t}.{{p}}") for o, t in [
        ("self_attn.q_proj", "self_attn.q_proj"), ("self_attn.k_proj", "self_attn.k_proj"),
        ("self_attn.v_proj", "self_attn.v_proj"), ("self_attn.out_proj", "self_attn.out_proj"),
        ("self_attn_norm", "layer_norm1"), ("ff.linear1", "mlp.fc1"), ("ff.linear2", "mlp.fc2"),
        ("ff_norm", "layer_norm2")]]


def clip_rules() -> list[Rule]:
    """Our keys <-> transformers' CLIPModel names."""
    return [
        Rule("text_model.token_embedding.weight", "text_model.embeddings.token_embedding.weight"),
        Rule("text_model.position_embedding.weight", "text_model.embeddings.position_embedding.weight"),
        *_tower_rules("text_model", "text_model"),
        Rule("text_model.final_norm.{p}", "text_model.final_layer_norm.{p}"),
        Rule("vision_model.patch_embed.proj.weight", "vision_model.embeddings.patch_embedding.weight"),
        Rule("vision_model.cls_token", "vision_model.embeddings.class_embedding", Unsqueeze(2)),
        Rule("vision_model.position.weight", "vision_model.embeddings.position_embedding.weight", Unsqueeze(1)),
        Rule("vision_model.pre_norm.{p}", "vision_model.pre_layrnorm.{p}"),
        *_tower_rules("vision_model", "vision_model"),
        Rule("vision_model.post_norm.{p}", "vision_model.post_layernorm.{p}"),
        Rule("visual_projection.weight", "visual_projection.weight"),
        Rule("text_projection.weight", "text_projection.weight"),
        Rule("logit_scale", "logit_scale"),
    ]


TEXT_HF = {"vocab_size": "vocab_size", "context": "max_position_embeddings", "text_d_model": "hidden_size",
           "text_num_heads": "num_attention_heads", "text_num_layers": "num_hidden_layers",
           "text_d_ff": "intermediate_size", "pad_token_id": "pad_token_id", "bos_token_id": "bos_token_id",
           "eos_token_id": "eos_token_id"}
VISION_HF = {"image_size": "image_size", "patch_size": "patch_size", "in_channels": "num_channels",
             "vision_d_model": "hidden_size", "vision_num_heads": "num_attention_heads",
             "vision_num_layers": "num_hidden_layers", "vision_d_ff": "intermediate_size"}


def clip_config_from_hf(c: dict) -> CLIPConfig:
    """Our config from transformers' CLIPConfig dict (text_config, vision_config, projection_dim);
    ValueError for towers that differ in activation or norm epsilon."""
    text, vision = c.get("text_config") or {}, c.get("vision_config") or {}
    acts = {text.get("hidden_act", "quick_gelu"), vision.get("hidden_act", "quick_gelu")}
    eps = {text.get("layer_norm_eps", 1e-5), vision.get("layer_norm_eps", 1e-5)}
    if len(acts) != 1 or len(eps) != 1:
        raise ValueError(f"CLIPConfig: the towers must share hidden_act and layer_norm_eps, got {acts} and {eps}")
    act = acts.pop()
    if act not in ACT_FROM_HF:
        raise ValueError(f"CLIPConfig: hidden_act {act!r} is not supported ({', '.join(ACT_FROM_HF)})")
    for f in ("image_size", "patch_size"):
        if isinstance(vision.get(f), (list, tuple)):
            if len(set(vision[f])) != 1:
                raise ValueError(f"CLIPConfig: a non-square {f} {vision[f]} is not supported")
            vision = {**vision, f: vision[f][0]}
    eos = text.get("eos_token_id", 49407)
    if isinstance(eos, list):
        eos = eos[0]
    kwargs = {ours: text[hf] for ours, hf in TEXT_HF.items() if text.get(hf) is not None}
    kwargs.update({ours: vision[hf] for ours, hf in VISION_HF.items() if hf in vision})
    return CLIPConfig(**{**kwargs, "eos_token_id": eos}, projection_dim=c.get("projection_dim", 512),
                      activation=ACT_FROM_HF[act], layer_norm_eps=eps.pop(),
                      attention_dropout=text.get("attention_dropout", 0.0),
                      logit_scale_init=c.get("logit_scale_init_value", 2.6592))


def clip_config_to_hf(cfg: CLIPConfig) -> dict:
    shared = {"hidden_act": ACT_TO_HF[cfg.activation], "layer_norm_eps": cfg.layer_norm_eps,
              "attention_dropout": cfg.attention_dropout, "projection_dim": cfg.projection_dim}
    return {"text_config": {**{hf: getattr(cfg, o) for o, hf in TEXT_HF.items()}, **shared},
            "vision_config": {**{hf: getattr(cfg, o) for o, hf in VISION_HF.items()}, **shared},
            "projection_dim": cfg.projection_dim, "logit_scale_init_value": cfg.logit_scale_init}


# ----------------------------------------------------------------------------- registration
def _pairs(config, limits, B, T, seed) -> dict:
    """Captions that end in the end-of-text token, and as many images."""
    g = torch.Generator().manual_seed(seed)
    size, ch = limits["image_size"], limits["in_channels"]
    ids = torch.randint(0, limits["vocab_size"], (B, min(T, limits["context"])), generator=g)
    ids[:, -1] = config.eos_token_id
    return {"input_ids": ids, "pixel_values": torch.randn(B, ch, size, size, generator=g)}


def _shapes(c, x) -> tuple:
    Bt, Bi = x["input_ids"].size(0), x["pixel_values"].size(0)
    return (Bi, Bt), (Bt, Bi), (Bt, c.projection_dim), (Bi, c.projection_dim)


if "contrastive" not in KINDS:
    register_kind("contrastive", modality="image-text", example=_pairs, shapes=_shapes, command="attnlab classify",
                  outputs=("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"),
                  does="forward(input_ids (B_t, T), pixel_values (B_i, C, H, W)) -> (logits_per_image (B_i, B_t), "
                       "logits_per_text, text_embeds (B_t, P), image_embeds (B_i, P)): images and texts in one "
                       "space, scored by scaled cosine; zero-shot classification scores an image against one "
                       "caption per label")


def build_config(*, image_size: int, patch_size: int, in_channels: int, vocab_size: int, context: int, d_model: int,
                 num_heads: int, num_layers: int, d_ff: int | None = None, dropout: float = 0.0,
                 projection_dim: int | None = None, eos_token_id: int = 2, pad_token_id: int = 0,
                 bos_token_id: int = 1) -> CLIPConfig:
    """Two towers of the same size, projected to ``projection_dim`` (default d_model)."""
    d_ff = d_ff or 4 * d_model
    return CLIPConfig(vocab_size=vocab_size, context=context, text_d_model=d_model, text_num_heads=num_heads,
                      text_num_layers=num_layers, text_d_ff=d_ff, image_size=image_size, patch_size=patch_size,
                      in_channels=in_channels, vision_d_model=d_model, vision_num_heads=num_heads,
                      vision_num_layers=num_layers, vision_d_ff=d_ff, projection_dim=projection_dim or d_model,
                      attention_dropout=dropout, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                      bos_token_id=bos_token_id)


PRESETS = {
    "tiny": dict(vocab_size=99, context=20, text_d_model=32, text_num_heads=4, text_num_layers=2, text_d_ff=37,
                 pad_token_id=0, bos_token_id=1, eos_token_id=98, image_size=16, patch_size=4, vision_d_model=32,
                 vision_num_heads=4, vision_num_layers=2, vision_d_ff=48, projection_dim=24),
    "clip-vit-base-patch32": {},                                                           # 151.3M parameters
}

CLIP = register_family("clip", CLIPConfig, base_rules=clip_rules(), config_from_hf=clip_config_from_hf,
                       config_to_hf=clip_config_to_hf, presets=PRESETS, build_config=build_config,
                       modality="image-text", token_ids={"eos_token_id": "eos", "pad_token_id": "pad",
                                                         "bos_token_id": "bos"},
                       limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                         "in_channels": c.in_channels, "vocab_size": c.vocab_size,
                                         "context": c.context})
CLIP.register("CLIPModel", CLIPModel, kind="contrastive", default=True)
