"""Fine-tuning an image classifier from a pre-trained ViT encoder: what ``attnlab train image
--init RUN_OR_HF_DIR`` calls (an ``attnlab train mae`` run, an image run, or a Hugging Face ViTMAE
or ViT directory). A module of its own, below both tasks: the image task calls it and the MAE task
reads the image task's data, so neither imports the other both ways."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from ..processors import IMAGE_CONFIG, ImageProcessor
from .run import RunError, inspect_path, load_model, load_processors

__all__ = ["fine_tuning_start"]


def _pretrained_vit(path: str, flag: str) -> tuple[object, dict[str, Tensor], ImageProcessor | None]:
    """(the checkpoint's encoder configuration, the encoder's tensors under ViT's checkpoint names
    without a prefix, the checkpoint's image processor or None) of a run or a Hugging Face directory."""
    from ..hub import from_pretrained
    from ..models.pretrained import to_hf_state_dict
    from ..models.registry import architecture_of
    from ..models.vit import ViTConfig
    info = inspect_path(path)
    if info.kind == "run":
        model, processor = load_model(info.run), load_processors(info.run).get("image")
    else:
        model = from_pretrained(path)
        processor = ImageProcessor.load(path) if (Path(path) / IMAGE_CONFIG).is_file() else None
    arch = architecture_of(model)
    if not isinstance(model.config, ViTConfig) or model.config.prefix_tokens != 1:
        raise RunError(f"{flag} {path}: {info.describe()}, not a ViT encoder (an attnlab mae or image run, a "
                       f"ViTMAE or ViT directory)")
    tensors = to_hf_state_dict(model)
    if arch.prefix:
        tensors = {k[len(arch.prefix):]: v for k, v in tensors.items() if k.startswith(arch.prefix)}
    # a bare ViT checkpoint's pooler belongs to no classifier of transformers' layout
    return model.config, {k: v for k, v in tensors.items() if not k.startswith("pooler.")}, processor


_SIZES = {"image_size": "image_size", "patch_size": "patch_size", "channels": "in_channels", "d_model": "d_model",
          "heads": "num_heads", "layers": "num_layers", "d_ff": "d_ff"}


def fine_tuning_start(s: dict, labels: list[str], build, flag: str = "--init") -> tuple[nn.Module, ImageProcessor]:
    """(an image classifier whose encoder holds the weights of the checkpoint ``s[flag]`` names and
    whose head is new, the image processor to train it with) for ``attnlab train image``.

    The encoder's sizes are the checkpoint's: they are written into ``s`` (so that the run's
    config.yaml records what was built) and ``build(s, labels)`` makes the classifier. The weights
    move by their checkpoint names (the encoder's keys under the classifier's prefix), so every
    encoder weight must find its place and every one the classifier's encoder has must be given.
    The processor is the checkpoint's where it has one, else the image task's own default."""
    from ..models.pretrained import from_hf_state_dict, to_hf_state_dict
    from ..models.registry import architecture_of
    path = s[flag.removeprefix("--").replace("-", "_")]
    config, tensors, processor = _pretrained_vit(path, flag)
    if s.get("model") != "vit":
        raise RunError(f"{flag} fine-tunes a ViT classifier (--model vit), not --model {s.get('model')}")
    s.update({ours: getattr(config, theirs) for ours, theirs in _SIZES.items()})
    model = build(s, labels)
    same = replace(model.config, layer_norm_eps=config.layer_norm_eps, activation=config.activation,
                   qkv_bias=config.qkv_bias)
    if same.norm != config.norm:
        raise RunError(f"{flag} {path}: the encoder uses {config.norm}, not --norm {same.norm}")
    arch = architecture_of(model)
    if same != model.config:             # the checkpoint's own epsilon, activation and biases
        torch.manual_seed(s["seed"])
        model = arch.build(same)
    fresh = to_hf_state_dict(model)
    given = {arch.prefix + k: v for k, v in tensors.items()}
    unplaced = sorted(set(given) - set(fresh))
    lacking = sorted(k for k in fresh if k.startswith(arch.prefix) and k not in given)
    if unplaced or lacking:
        raise RunError(f"{flag} {path}: its encoder does not fit a {arch.name} (no place for {unplaced[:3]}, not "
                       f"supplied {lacking[:3]})")
    model.load_state_dict(from_hf_state_dict(model, {**fresh, **given}))
    if processor is None or processor.channels != config.in_channels:
        grey = [0.5] * config.in_channels
        processor = ImageProcessor(size=config.image_size, image_mean=grey, image_std=grey)
    return model, processor
