"""Masked auto-encoder pre-training on images, and fine-tuning a classifier from it.

    attnlab train mae --time-budget 4 --out runs/mae-digits   # the embedded digits, labels unused
    attnlab train image --label-fraction 0.1 --init runs/mae-digits
    attnlab train mae --data photos/ --time-budget 10 --mask-ratio 0.75 --norm-pix-loss
    attnlab train image --data photos/ --init runs/mae          # its encoder, a new head

Data: without ``--data``, the embedded 8x8 digits of ``attnlab train image``, the same 1,497
training images (their labels unused) and the same 100 validation digits, at that task's
sizes (8x8 in patches of 2, three grey channels, the box filter). ``--data DIR``: the image-folder
layout of ``attnlab train image`` (:mod:`attnlab.data.images`: one sub-folder per class, or
``train/`` and ``val/``); the labels are not read. Without a validation folder 10 % of the images
(at most 2,000) are held out. Images go through the image task's
:class:`attnlab.processors.ImageProcessor` for the same data (resize, rescale, normalise by mean
and std 0.5), saved with every checkpoint as preprocessor_config.json, so ``--init`` fine-tunes
on exactly the pixels the encoder was pre-trained on.

The model is the ``vit_mae`` family's ViTMAEForPreTraining (kind "masked-image-model"), its
options (``--mask-ratio``, ``--norm-pix-loss``, the decoder's sizes) stated by the family. The loss
is summed over the masked patches of a batch and the Trainer divides by their number, so a step
minimises the mean squared error per masked patch, as MAE's loss. Training masks at random; the
validation loss masks each held-out image by a fixed seed, so that two evaluations compare the
same reconstructions.

Fine-tuning (:mod:`attnlab.tasks.finetune`): :func:`fine_tuning_start` is what ``attnlab train image --init`` calls. It reads an
attnlab run or a Hugging Face directory whose model is a ViT encoder (ViTMAEForPreTraining,
ViTMAEModel, ViTForImageClassification, ViTModel), sizes the classifier as that encoder, copies the
encoder's weights by their checkpoint names and leaves the new classifier head as initialised.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..data.images import ImageFolder, image_splits, read_image_folder
from ..processors import ImageProcessor
from .base import Option, Setup, TaskDefinition, describe_training, fraction, positive, register_task, training_schedule
from .finetune import fine_tuning_start
from .image import _SIZES as _IMAGE_SIZES
from .image import IMAGE, data_source
from .run import RunInfo, build_model, load_model, load_processors, resume_point, write_run
from .settings import Settings

__all__ = ["MAEPretraining", "MAETask", "LoadedMAE", "mae_images", "fine_tuning_start"]

_M, _D = "model", "data and evaluation"
KIND = "masked-image-model"
_VALID_SEED = 1234            # the masking of the held-out images, the same at every evaluation


def mae_images(s: Settings, processor: ImageProcessor) -> tuple[Tensor, Tensor, str]:
    """(training images, validation images, what they are): the images as bytes (N, C, H, W) uint8,
    resized by ``processor``. Without ``--data``, the embedded digits of ``attnlab train image``: its
    1,497 training images and its 100 validation digits (never its 200 test digits), read by that
    task's own data function so that the two tasks see the very same bytes."""
    if s.data is None:
        data = IMAGE._data(s, processor, None)
        return data["train"][0], data["valid"][0], data["root"]
    splits = image_splits(s.data) if s.valid is None else None
    if splits is not None:
        train = read_image_folder(splits["train"])
        valid = read_image_folder(splits["valid"]) if "valid" in splits else None
    else:
        train = read_image_folder(s.data)
        valid = read_image_folder(s.valid) if s.valid is not None else None
    if valid is None:
        order = list(range(len(train)))
        random.Random(s.seed).shuffle(order)
        held = set(order[:min(2000, max(1, len(train) // 10))])
        if len(held) == len(train):
            raise ValueError(f"{train.root}: one image; pre-training needs some to train on and one to hold out")
        valid = ImageFolder(train.root, [p for i, p in enumerate(train.paths) if i in held],
                            [y for i, y in enumerate(train.labels) if i in held])
        train = ImageFolder(train.root, [p for i, p in enumerate(train.paths) if i not in held],
                            [y for i, y in enumerate(train.labels) if i not in held])
    return _pixels(train, processor), _pixels(valid, processor), str(train.root)


def _pixels(folder: ImageFolder, processor: ImageProcessor) -> Tensor:
    """The folder's images resized, as bytes (N, C, H, W) uint8."""
    return torch.stack([processor.resized(p) for p in folder.paths])


class MAETask:
    """The Trainer's view of MAE pre-training (see :class:`attnlab.train.Task`)."""

    def __init__(self, model: nn.Module, processor: ImageProcessor, train: Tensor, valid: Tensor, *, batch_size: int):
        self.model, self.processor, self.batch_size = model, processor, batch_size
        self.train_x, self.valid_x = train, valid

    def plan(self, epoch: int, seed: int) -> list[Tensor]:
        order = torch.randperm(len(self.train_x), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        return list(order.split(self.batch_size))

    def _loss_sum(self, model: nn.Module, pixels: Tensor, seed: int | None = None) -> tuple[Tensor, int]:
        from ..models.registry import training_loss
        out = training_loss(self.model, {"pixel_values": pixels} if seed is None else
                            {"pixel_values": pixels, "seed": seed}, forward=model)
        return out.loss, out.count

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, int, dict]:
        device = batch.device
        pixels = self.processor.finish(self.train_x[batch.cpu()]).to(device)
        total, n = self._loss_sum(model, pixels)
        return total, n, {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        total, n = 0.0, 0
        for i, b in enumerate(torch.arange(len(self.valid_x)).split(self.batch_size * 4)):
            s, k = self._loss_sum(model, self.processor.finish(self.valid_x[b]).to(device), seed=_VALID_SEED + i)
            total, n = total + float(s), n + k
        return {"val_loss": total / max(n, 1)}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "mae", self.model, {"image": self.processor})


@dataclass
class LoadedMAE:
    """A pre-trained MAE ready for inference: the model (eval mode) and its image processor."""
    model: nn.Module
    processor: ImageProcessor
    path: Path

    @torch.no_grad()
    def reconstruct(self, images, seed: int = 0) -> tuple[Tensor, Tensor]:
        """(the reconstructed images (N, C, H, W) in the processor's normalised values, the mask (N, P))
        for paths, PIL images or uint8 arrays, masked by ``seed``."""
        x = self.processor(images).to(next(self.model.parameters()).device)
        out = self.model(x, seed=seed)
        return self.model.reconstruction(x, out).cpu(), out.mask.cpu()


def _mae_families() -> list[str]:
    from ..models.registry import families
    return [f.model_type for f in families(kind=KIND)]


class MAEPretraining(TaskDefinition):
    name = "mae"
    kind = KIND
    help = ("masked auto-encoder pre-training (MAE) on the embedded digits or a folder of images; fine-tune with "
            "train image --init")
    example = ("attnlab train mae --time-budget 4                 # the embedded digits, labels unused\n"
               "  attnlab train mae --data photos/ --time-budget 10\n"
               "  attnlab train mae --data photos/ --mask-ratio 0.75 --norm-pix-loss --decoder-layers 2")
    options = [
        Option("model", str, None, "a registered masked-image-model family (default: vit_mae)", group=_M),
        Option("image_size", int, None, "images are resized to this many pixels square (default: 8 for the digits, "
               "32 for a folder, as train image)", check=positive, group=_M),
        Option("patch_size", int, None, "pixels per patch side, a divisor of the image size (default: 2 for the "
               "digits, 4 for a folder)", check=positive, group=_M),
        Option("channels", int, None, "colour channels: 3 (RGB) or 1 (grey) (default: 3)", choices=(1, 3), group=_M),
        Option("d_model", int, 64, "encoder width", check=positive, group=_M),
        Option("heads", int, 4, "encoder attention heads", check=positive, group=_M),
        Option("layers", int, 4, "encoder layers", check=positive, group=_M),
        Option("d_ff", int, None, "encoder feed-forward width (default: the family's)", check=positive, group=_M),
        Option("dropout", float, 0.0, "dropout", check=fraction, group=_M),
        Option("batch_size", int, 64, "images per micro-batch", check=positive, group=_D),
    ]
    data_paths = ("directory",)
    data_help = ("an image folder (one sub-folder of images per class; the classes are not read); default: the "
                 "embedded 8x8 digits")

    def check(self, s: Settings) -> None:
        known = _mae_families()
        if s.model is None:
            from ..models.registry import default_family
            s.model = default_family(KIND) if known else None
            if s.model is None:
                raise ValueError("attnlab train mae: no masked-image-model family is registered")
        elif s.model not in known:
            raise ValueError(f"--model: {s.model!r} is not a registered masked-image-model family "
                             f"({', '.join(known) or 'none registered'})")
        super().check(s)
        if s.data is None and s.valid is not None:
            raise ValueError("--valid: give the training images too (--data DIR); the embedded digits have their "
                             "own held-out split")
        # the image task's sizes for the same data, so that train image --init fits the encoder as it was trained
        for name in ("image_size", "patch_size", "channels"):
            if s[name] is None:
                s[name] = _IMAGE_SIZES[data_source(s)][name]
        if s.image_size % s.patch_size:
            raise ValueError(f"--image-size {s.image_size} is not a multiple of --patch-size {s.patch_size}")

    def _model(self, s: Settings) -> nn.Module:
        from ..models.registry import family
        fam = family(s.model)
        config = fam.build_config(image_size=s.image_size, patch_size=s.patch_size, in_channels=s.channels,
                                  d_model=s.d_model, num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                  dropout=s.dropout, **self.family_sizes(s))
        torch.manual_seed(s.seed)
        return fam.for_kind(self.kind).build(config)

    def _schedule(self, s: Settings, n_images: int) -> dict:
        steps = max(100, min(5000, 10 * -(-n_images // s.batch_size)))      # about ten epochs
        return training_schedule(s, dict(steps=steps, lr=1e-3, weight_decay=0.05),
                                 lambda steps, budget: 50 if budget else max(1, steps // 10),
                                 lambda steps, budget: max(steps // 5, 20), 4)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:            # the run's own processor and model (the Trainer loads the weights)
            processor = load_processors(saved)["image"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        else:
            processor = IMAGE._processor(s)       # the box filter for the digits, as the image task's
            model = self._model(s)
        train, valid, root = mae_images(s, processor)
        t = self._schedule(s, len(train))
        s.lr = t["lr"]
        if not t["budget_schedule"]:
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        task = MAETask(model, processor, train, valid, batch_size=s.batch_size)
        c = model.config
        n = sum(p.numel() for p in model.parameters()) / 1e6
        lines = [f"data: {root}: {len(train):,} training images, {len(valid):,} validation (labels not read)",
                 f"model: {type(model).__name__} ({s.model}), {n:.2f}M parameters"
                 + (", from the checkpoint" if saved is not None else "")
                 + f"; images {c.image_size}x{c.image_size}, {c.in_channels} channel(s), {c.num_patches} patches "
                   f"of {c.patch_size}, {c.num_patches - c.visible} masked (ratio {c.mask_ratio:g}), "
                   f"{'normalised' if c.norm_pix_loss else 'raw'} pixel targets",
                 describe_training(s, t)]
        return Setup(task, lines, schedule=t)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        beta2 = s.beta2 if s.beta2 is not None else 0.95          # MAE's AdamW (section A.1)
        return dict(setup.schedule, betas=(0.9, beta2), best_metric="val_loss",
                    best_mode="min")

    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedMAE:
        from .run import resolve_device
        processors = load_processors(run, {"image": "image processor"})
        return LoadedMAE(load_model(run).to(resolve_device(device)).eval(), processors["image"], run.path)


MAE = register_task(MAEPretraining())
