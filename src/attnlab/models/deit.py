"""DeiT: the Vision Transformer with a distillation token that learns from a teacher (Touvron et al.
2021, "Training data-efficient image transformers & distillation through attention", section 4).

    [class token; distillation token; patches] + learned positions (B, 2 + P, E)
        -> the ViT encoder (:mod:`attnlab.models.vit`) -> hidden (B, 2 + P, E)
    cls_logits  = hidden[:, 0] W_c + b_c          trained on the labels
    dist_logits = hidden[:, 1] W_d + b_d          trained on the teacher's predictions
    logits      = (cls_logits + dist_logits) / 2  at inference (section 5.2, "Classification with our approach")

The two losses of section 4, for (cls_logits, dist_logits) of :meth:`DeiTForImageClassificationWithTeacher.heads`
and the teacher's logits Z_t, with ψ the softmax and y_t = argmax Z_t:

    hard:  ½ CE(ψ(Z_cls), y) + ½ CE(ψ(Z_dist), y_t)
    soft:  (1 - λ) CE(ψ(Z_cls), y) + λ τ² KL(ψ(Z_t / τ) ‖ ψ(Z_dist / τ))

Weights: transformers' DeiTModel and DeiTForImageClassificationWithTeacher names ("deit." before the
encoder's, as ViT's "vit."), which the Hub's facebook/deit-*-distilled checkpoints use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .convert import Rule
from .objective import Objective, classification
from .registry import FamilyOption, register_family
from .vit import (NORMS, BareImageEncoder, ViTConfig, ViTEncoder, hf_unsupported, sized_fields, vit_config_from_hf,
                  vit_config_to_hf, vit_rules)

__all__ = ["DeiTConfig", "DeiTModel", "DeiTForImageClassificationWithTeacher", "DEIT", "hard_distillation_loss",
           "soft_distillation_loss", "build_config"]


@dataclass
class DeiTConfig(ViTConfig):
    prefix_tokens = 2                     # the class and the distillation token
    prefix_names = ("[CLS]", "[DIST]")

    def __post_init__(self):
        super().__post_init__()
        if self.pooling != "cls":
            raise ValueError(f"DeiTConfig: pooling must be 'cls' (the heads read the class and distillation "
                             f"tokens), got {self.pooling!r}")


class _DeiTEncoder(ViTEncoder):
    """The ViT encoder with the distillation token after the class token."""

    def __init__(self, config: DeiTConfig):
        super().__init__(config)
        self.distillation_token = nn.Parameter(torch.zeros(1, 1, config.d_model))

    def prefix(self, batch: int) -> Tensor:
        return torch.cat([self.cls_token, self.distillation_token], dim=1).expand(batch, -1, -1)


class DeiTModel(BareImageEncoder, _DeiTEncoder):
    """The bare DeiT encoder: last hidden state (B, 2 + P, E), class and distillation tokens first
    (see :class:`attnlab.models.vit.BareImageEncoder`)."""


class DeiTForImageClassificationWithTeacher(_DeiTEncoder):
    """DeiT with its two heads (kind "image-classifier"): ``forward(pixel_values,
    interpolate_pos_encoding=False) -> logits (B, num_labels)``, the mean of the two heads' logits,
    as at inference; ``heads(...)`` (or ``forward(..., return_heads=True)``) -> (cls_logits,
    dist_logits), each (B, num_labels), for the distillation losses; :meth:`loss` the training
    objective, from the labels alone or with a teacher's logits."""

    learns_from_teacher = True            # what `attnlab train image --teacher` looks for

    def __init__(self, config: DeiTConfig):
        super().__init__(config)
        self.head = nn.Linear(config.d_model, config.num_labels)
        self.head_dist = nn.Linear(config.d_model, config.num_labels)
        self.reset_parameters()

    def heads(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False) -> tuple[Tensor, Tensor]:
        hidden = self.encode(pixel_values, interpolate_pos_encoding)
        return self.head(hidden[:, 0]), self.head_dist(hidden[:, 1])

    def forward(self, pixel_values: Tensor, interpolate_pos_encoding: bool = False,
                return_heads: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        cls_logits, dist_logits = self.heads(pixel_values, interpolate_pos_encoding)
        return (cls_logits, dist_logits) if return_heads else (cls_logits + dist_logits) / 2

    def loss(self, batch: dict, forward=None) -> Objective:
        """The training loss (:mod:`attnlab.models.objective`) summed over the batch's images:
        without ``batch["teacher_logits"]`` the cross-entropy of the averaged heads against
        ``labels`` (as any image classifier); with them, section 4's hard distillation or, with
        ``batch["distillation"] == "soft"``, the soft one (``alpha``, ``tau``). Metric ``correct``
        (of the averaged heads, as at inference)."""
        if "teacher_logits" not in batch:
            return classification(self, batch, forward)
        cls_logits, dist_logits = (forward or self)(batch["pixel_values"], return_heads=True)
        y, teacher = batch["labels"], batch["teacher_logits"]
        mode = batch.get("distillation", "hard")
        if mode == "hard":
            total = hard_distillation_loss(cls_logits, dist_logits, teacher, y, reduction="sum")
        elif mode == "soft":
            total = soft_distillation_loss(cls_logits, dist_logits, teacher, y, batch.get("alpha", 0.1),
                                           batch.get("tau", 3.0), "sum")
        else:
            raise ValueError(f"DeiT loss: distillation is 'hard' or 'soft', got {mode!r}")
        with torch.no_grad():
            correct = (((cls_logits + dist_logits) / 2).argmax(-1) == y).sum()
        return Objective(total, int(y.numel()), {"correct": correct})


# ----------------------------------------------------------------------------- distillation losses
def _reduce(per_image: Tensor, reduction: str) -> Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"distillation loss: reduction must be 'mean' or 'sum', got {reduction!r}")
    return per_image.mean() if reduction == "mean" else per_image.sum()


def hard_distillation_loss(cls_logits: Tensor, dist_logits: Tensor, teacher_logits: Tensor, labels: Tensor,
                           reduction: str = "mean") -> Tensor:
    """½ CE(cls_logits, labels) + ½ CE(dist_logits, argmax teacher_logits), per image, then the
    batch's mean or sum (``reduction``). Logits (B, C), labels (B,) class indices."""
    teacher_labels = teacher_logits.argmax(-1)
    per_image = 0.5 * F.cross_entropy(cls_logits.float(), labels, reduction="none") \
        + 0.5 * F.cross_entropy(dist_logits.float(), teacher_labels, reduction="none")
    return _reduce(per_image, reduction)


def soft_distillation_loss(cls_logits: Tensor, dist_logits: Tensor, teacher_logits: Tensor, labels: Tensor,
                           alpha: float = 0.1, tau: float = 3.0, reduction: str = "mean") -> Tensor:
    """(1 - alpha) CE(cls_logits, labels) + alpha tau² KL(softmax(teacher / tau) ‖ softmax(dist / tau)),
    per image, then the batch's mean or sum. The paper's λ = 0.1 and τ = 3.0 are the defaults; the
    τ² keeps the distillation gradient's size independent of τ (Hinton et al. 2015, section 2)."""
    if not 0.0 <= alpha <= 1.0 or tau <= 0:
        raise ValueError(f"soft_distillation_loss: need 0 <= alpha <= 1 and tau > 0, got alpha={alpha}, tau={tau}")
    log_student = F.log_softmax(dist_logits.float() / tau, dim=-1)
    log_teacher = F.log_softmax(teacher_logits.float() / tau, dim=-1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(-1)
    per_image = (1 - alpha) * F.cross_entropy(cls_logits.float(), labels, reduction="none") + alpha * tau ** 2 * kl
    return _reduce(per_image, reduction)


# ----------------------------------------------------------------------------- registration
def deit_config_from_hf(c: dict) -> DeiTConfig:
    return vit_config_from_hf(c, DeiTConfig)


def build_config(*, image_size: int, patch_size: int, in_channels: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_labels: int = 2,
                 norm: str = "layernorm", dyt_alpha: float = 0.5) -> DeiTConfig:
    """A DeiT sized for training (see :func:`attnlab.models.vit.sized_fields`)."""
    return DeiTConfig(**sized_fields(image_size=image_size, patch_size=patch_size, in_channels=in_channels,
                                     d_model=d_model, num_heads=num_heads, num_layers=num_layers, d_ff=d_ff,
                                     dropout=dropout, num_labels=num_labels, norm=norm, pooling="cls",
                                     dyt_alpha=dyt_alpha))


PRESETS = {
    "tiny": dict(image_size=16, patch_size=4, in_channels=3, d_model=32, num_heads=4, num_layers=2, d_ff=64,
                 num_labels=3),
    "deit-tiny-distilled-patch16-224": dict(d_model=192, num_heads=3, d_ff=768, num_labels=1000),
    "deit-small-distilled-patch16-224": dict(d_model=384, num_heads=6, d_ff=1536, num_labels=1000),
    "deit-base-distilled-patch16-224": dict(num_labels=1000),
}
_OPTIONS = (FamilyOption("norm", str, "the normalisation: layernorm, or dyt (dynamic tanh, no statistics)",
                         ("image",), choices=NORMS),)

DEIT = register_family("deit", DeiTConfig, base_rules=vit_rules() + [Rule("distillation_token",
                                                                          "embeddings.distillation_token")],
                       config_from_hf=deit_config_from_hf, config_to_hf=vit_config_to_hf, presets=PRESETS,
                       build_config=build_config, modality="image", options=_OPTIONS, hf_unsupported=hf_unsupported,
                       limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                         "in_channels": c.in_channels})
DEIT.register("DeiTForImageClassificationWithTeacher", DeiTForImageClassificationWithTeacher, kind="image-classifier",
              prefix="deit.", head_rules=[Rule("head.{p}", "cls_classifier.{p}"),
                                          Rule("head_dist.{p}", "distillation_classifier.{p}")])
DEIT.register("DeiTModel", DeiTModel, kind="image-base", head_rules=[Rule("pooler.{p}", "pooler.dense.{p}")])
