"""Image classification: labelled images + an image processor + any registered image-classifier
family, for the Trainer.

    attnlab train image                                  # the embedded handwritten digits, 8,000 steps
    attnlab train image --data photos/ --model vit --time-budget 10
    attnlab train image --model deit --teacher runs/image --out runs/deit
    attnlab classify runs/image cat.png dog.jpg
    attnlab eval runs/image --data photos-test/

Without ``--data`` the task trains on scikit-learn's bundled 8x8 handwritten digits
(:mod:`attnlab.data.digits`: 1,797 images; by a fixed shuffle 1,497 to train on, 100 to validate
with, which choose the best checkpoint, and 200 to test it on, which choose nothing), sized for
them: 8x8 images in patches of 2 (16 patches), light digits on a dark ground, reduced from any
size by averaging (the box filter), so a PNG of a digit of any size classifies too. They are
kept as RGB, grey in each channel: transformers' image-classification pipeline hands a model RGB
images, so an exported run takes a grey PNG there as here.

Data (``--data DIR``, :mod:`attnlab.data.images`): one sub-folder per class, or ``train/`` with
``val/`` (or ``valid/``) and ``test/`` beside it; ``--valid DIR`` names a validation folder
explicitly; otherwise 10 % of the training images (at most 2,000) are held out. The label set is
the training folders' names, sorted, and is saved with the run.

Images go through the run's :class:`attnlab.processors.ImageProcessor` (resize to
``--image-size``, rescale to [0, 1], normalise by mean and std, ``--channels`` 1 or 3), which is
saved with every checkpoint as preprocessor_config.json and used again by ``classify``, ``eval``
and ``export``. The training set is kept resized, as bytes (a quarter of the memory of float
pixels), and each batch is finished (rescaled and normalised) when it is used.

The model comes from the registry: a family with an architecture of kind "image-classifier",
whose sizing builder takes the image sizes (``image_size``, ``patch_size``, ``in_channels``), the
model sizes and ``num_labels``. The loss is the cross-entropy summed over a batch's images, so the
Trainer's normalisation gives the mean per image; the best checkpoint has the highest validation
accuracy (the digits': the lowest validation loss). The digits train a fixed number of steps
(:data:`DIGIT_STEPS`), the same run on a busy machine as on an idle one, and evaluate, choose and
save an exponential moving average of the weights (``--ema``, decay 0.999: the Trainer's
``ema_decay``); ``--ema 0`` turns it off.

Augmentation (``--augment``, :func:`attnlab.data.images.augment`) is applied to each training
batch's bytes, as its seed says: the plan of an epoch (deterministic in the run's seed and the
epoch) gives every batch its own seed, so a resumed run sees the very batches an uninterrupted
one does. What suits the data: never a flip for handwriting (a mirrored digit is another digit
or none), but a slight turn, zoom and move (``--augment affine``, the digits' default; ``shift``
moves by whole pixels, an eighth of a digit at a time), a random resized crop with a horizontal
flip for a folder of photos (the default there).

Distillation (``--teacher RUN_OR_HF_DIR``, ``--model deit``): the teacher, an image run or a Hugging
Face image classifier with the same labels in the same order, is frozen and scores each training
batch (the augmented images, finished by its own image processor and resized to its image size);
the DeiT student learns its class head from the labels and its distillation head from the
teacher: hard distillation (the teacher's argmax; the DeiT paper's choice, the default) or soft
(``--distillation soft``: the teacher's distribution at ``--distillation-tau``, weight
``--distillation-alpha``), :mod:`attnlab.models.deit`'s losses.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.images import (AUGMENTATIONS, FolderSurvey, ImageFolder, augment, image_splits, read_image_folder,
                           survey_images)
from .image_defaults import folder_defaults
from ..processors import ImageProcessor
from .settings import EvalSettings, Settings
from .base import Option, Setup, TaskDefinition, describe_training, fraction, positive, register_task, training_schedule
from .run import RunError, RunInfo, build_model, inspect_path, load_model, load_processors, resume_point, write_run

__all__ = ["ImageClassification", "ImageClassificationTask", "LoadedImageClassifier", "Teacher", "load_teacher",
           "label_subset", "folder_defaults"]

_M, _D, _T = "model", "data and evaluation", "distillation (--model deit)"
KIND = "image-classifier"
# what each kind of data is trained with unless given: the digits at their own 8x8, photos at 32 px.
# Measured on the digits (3,000 steps, seed 0, on the 200 test digits): without augmentation the
# model learns its 1,497 training digits by heart (training loss 0.003, validation loss rising after
# step 1,200) and scored 96.0 %; the affine augmentation with dropout 0.2 under-fits (training loss
# 0.16 at the end), 97.0 %; with dropout 0.1, 97.5 %. One-pixel shifts are too coarse for an 8x8 digit.
# Then (docs/vision.md, "Results"): 3,000 steps gave 98.0, 94.0 and 97.0 % at seeds 0-2, still
# under-fitting the augmented digits (validation loss falling at the end); 6,000 steps evaluated with
# an average of the weights (decay 0.999) gave 99.0, 97.0 and 97.0 % (mean 97.7, short of 98), in 213-224 s.
# Dropout was then about a quarter of a step's time (torch.dropout's masks, and SDPA's slower path with dropout on
# the weights), and the affine augmentation regularises enough alone: without dropout, 8,000 steps take
# the time of 6,000 with it and gave 99.0, 99.5, 98.5, 99.5 and 99.0 % at seeds 0-4 (mean 99.1; the old
# default 97.5, 97.0, 98.5 on the same CPU); DyT on that budget 97.8 on average there, 1.3 points below, and
# level on another CPU (98.6 against 98.5; over the ten seeds 98.2 against 98.8; benchmarks/results/vision.md).
_SIZES = {"digits": dict(image_size=8, patch_size=2, channels=3, augment="affine", dropout=0.0, ema=0.999, d_model=64,
                         heads=4, layers=4, label_smoothing=0.0),
          "folder": dict(image_size=32, patch_size=4, channels=3, augment="crop-flip", dropout=0.1, ema=0.0, d_model=64,
                         heads=4, layers=4, label_smoothing=0.0)}
_LR = {"digits": 2e-3, "folder": 1e-3}
_WEIGHT_DECAY = {"digits": 0.1, "folder": None}     # None: the Trainer's default
DIGIT_STEPS = 8000
# DyT's alpha: the DyT paper's 0.5 suits a 224-pixel ViT, whose first norm sees activations of std 0.49 at
# initialisation (patches of 16x16x3 pixels); the digits' patches of 2x2x3 give 0.058, 8.4 times less, so
# tanh(0.5 x) passes on a 35th of what LayerNorm does (measured at init: std 0.029 against 1.0) and the
# stack starts with almost no signal. Scaling alpha by the same 8 puts tanh where the paper has it, in the
# first layer; but the residual stream grows with depth (a trained LayerNorm ViT's norms see std 0.2 in the
# first layer, 1.9 before the head), and a DyT run with alpha 4 everywhere grew it to std 5-9 while alpha
# stayed near 4: tanh saturated after the first layer, and a saturated tanh gives alpha no gradient
# (92.5 % at 3,000 steps, LayerNorm 98.0 %). Halving alpha with each layer (4, 2, 1, 0.5, the final norm as
# the last layer) gave 96.0 % (benchmarks/results/vision.md).
_DYT_ALPHA = {"digits": 4.0, "folder": 0.5}
# ... and how fast alpha trains, as a multiple of the learning rate (attnlab.train.optim.lr_scales): 1, the
# plain rate. AdamW moves a parameter by about the learning rate per step whatever its size, 2e-3 a step at the
# peak, which looked too slow for alphas that must move by factors; at 10 times the rate they did move (to
# 4.8/5.6 in the first layer's attention / feed-forward norms, 0.01 in the third layer's attention, the final
# norm's from 0.5 to 1.3), but the digits scored no better: 99.0, 97.5, 96.5, 98.0 % at seeds 0-3 against
# 98.5, 98.5 % at seeds 0-1 at the plain rate (benchmarks/results/vision.md).
_DYT_ALPHA_LR = {"digits": 1.0, "folder": 1.0}


def data_source(s: Settings) -> str:
    """"digits" when the settings train on the embedded digits (no --data), else "folder": the one
    place that decides which of the two the sizes, processor, data and schedule are for."""
    return "digits" if s.data is None else "folder"


def _digit_dyt_alphas(layers: int) -> str:
    """The digits' DyT alphas: 4 in the first layer, halved with each layer after, the final norm's as the last's."""
    alphas = [_DYT_ALPHA["digits"] * 0.5 ** i for i in range(layers)]
    return ",".join(f"{a:g}" for a in alphas + alphas[-1:])


def _alphas(value) -> float | list[float] | None:
    """``--dyt-alpha``'s value as the config's ``dyt_alpha`` (one number, or a list of them from
    "4,2,1"); None if it is neither, or not positive."""
    try:
        alphas = [float(a) for a in value.split(",")] if isinstance(value, str) else [float(value)]
    except ValueError:
        return None
    if not all(a > 0 for a in alphas):
        return None
    return alphas[0] if len(alphas) == 1 else alphas


def _bytes(images: Sequence, processor: ImageProcessor) -> Tensor:
    """(N, C, H, W) uint8: each image (a path or an (H, W[, C]) uint8 array) resized by ``processor``."""
    return (torch.stack([processor.resized(x) for x in images]) if len(images)
            else torch.empty(0, processor.channels, 0, 0, dtype=torch.uint8))


def _folder_labels(folder: ImageFolder, labels: list[str], name: str) -> Tensor:
    index = {label: i for i, label in enumerate(labels)}
    unknown = sorted(set(folder.labels) - index.keys())
    if unknown:
        raise ValueError(f"{folder.root}: the {name} images have class(es) {', '.join(unknown)} that the training "
                         f"data lacks ({', '.join(labels)})")
    return torch.tensor([index[y] for y in folder.labels], dtype=torch.long)


def label_subset(labels: Tensor, fraction: float, seed: int) -> Tensor:
    """The indices (ascending) of a class-stratified ``fraction`` of the images whose classes are
    ``labels``: of each class, round(fraction * its count) images (at least one), drawn by a shuffle
    under ``seed``, so that the same seed picks the same images and every class keeps its share."""
    g = torch.Generator().manual_seed(seed)
    keep = []
    for c in labels.unique().tolist():
        mine = (labels == c).nonzero().flatten()
        n = max(1, round(fraction * len(mine)))
        keep.append(mine[torch.randperm(len(mine), generator=g)[:n]])
    return torch.cat(keep).sort().values if keep else torch.empty(0, dtype=torch.long)


def _arrays(images: Tensor) -> list[np.ndarray]:
    """(N, C, H, W) uint8 -> N arrays (H, W, C), as an image processor reads them."""
    return list(images.permute(0, 2, 3, 1).contiguous().numpy())


# ----------------------------------------------------------------------------- the teacher
@dataclass
class Teacher:
    """A frozen image classifier that scores the student's training batches."""
    model: nn.Module
    processor: ImageProcessor
    where: str

    @torch.no_grad()
    def logits(self, images: Tensor, device: torch.device) -> Tensor:
        """(B, C) logits for a batch of the student's bytes (B, C, H, W), finished by the teacher's
        processor and resized (bilinear) to the teacher's image size where it has another."""
        if next(self.model.parameters()).device != device:
            self.model.to(device)
        pixels = self.processor.finish(images).to(device)
        size = self.processor.output_size
        if size is not None and tuple(pixels.shape[-2:]) != size:
            pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False, antialias=True)
        return self.model(pixels).float()


def load_teacher(path: str, labels: list[str], channels: int) -> Teacher:
    """The teacher at ``path`` (an attnlab image run or a Hugging Face image-classification
    directory with preprocessor_config.json), frozen, in eval mode; ValueError in one line naming
    ``--teacher`` when it is not one, or predicts other labels than ``labels`` (in that order)."""
    from ..models.registry import architecture_of
    flag = f"--teacher {path}"
    try:
        info = inspect_path(path)
    except FileNotFoundError:
        raise ValueError(f"{flag}: no such run or directory") from None
    if info.kind == "run":
        if info.run.task != "image":
            raise ValueError(f"{flag}: {info.describe()}; a teacher is an image run or a Hugging Face image "
                             "classifier")
        model, processor = load_model(info.run), load_processors(info.run)["image"]
        theirs = list(info.run.task_options["labels"])
    else:
        from ..models.pretrained import from_pretrained
        try:
            model = from_pretrained(path)
            processor = ImageProcessor.load(path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"{flag}: {e}") from None
        names = getattr(model.config, "id2label", None) or {}
        theirs = [names[i] for i in sorted(names)]
    kind = architecture_of(model).kind
    if kind != KIND:
        raise ValueError(f"{flag}: its model is of kind {kind!r}; a teacher is an image classifier")
    if theirs != labels:
        raise ValueError(f"{flag}: its labels ({', '.join(theirs[:12])}) are not the data's "
                         f"({', '.join(labels[:12])}); a teacher must predict the same classes in the same order")
    if processor.channels != channels:
        raise ValueError(f"{flag}: it takes {processor.channels}-channel images, the student {channels}")
    model.eval().requires_grad_(False)
    return Teacher(model, processor, path)


# ----------------------------------------------------------------------------- the Trainer's task
class ImageClassificationTask:
    """The Trainer's view of image classification (see :class:`attnlab.train.Task`): training and
    validation images as resized bytes, with label indices; each planned batch is (image indices,
    the seed of its augmentation)."""

    def __init__(self, model: nn.Module, processor: ImageProcessor, labels: list[str], train: tuple[Tensor, Tensor],
                 valid: tuple[Tensor, Tensor], *, batch_size: int, augmentation: str = "none",
                 teacher: Teacher | None = None, distillation: str = "hard", alpha: float = 0.1, tau: float = 3.0,
                 label_smoothing: float = 0.0):
        self.model, self.processor, self.labels, self.batch_size = model, processor, labels, batch_size
        self.label_smoothing = label_smoothing
        (self.train_x, self.train_y), (self.valid_x, self.valid_y) = train, valid
        self.augmentation, self.teacher = augmentation, teacher
        self.distillation, self.alpha, self.tau = distillation, alpha, tau

    def plan(self, epoch: int, seed: int) -> list[tuple[Tensor, int]]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(len(self.train_y), generator=g).split(self.batch_size)
        seeds = torch.randint(0, 2 ** 62, (len(order),), generator=g).tolist()
        return list(zip(order, seeds))

    def batch_bytes(self, batch: tuple[Tensor, int]) -> tuple[Tensor, Tensor]:
        """(augmented bytes (B, C, H, W), labels (B,)) of a planned batch, on the CPU."""
        index, seed = batch
        index = index.cpu()
        return augment(self.train_x[index], self.augmentation, int(seed)), self.train_y[index]

    def loss(self, model: nn.Module, batch: tuple[Tensor, int]) -> tuple[Tensor, int, dict]:
        from ..models.registry import training_loss
        device = batch[0].device
        images, y = self.batch_bytes(batch)
        inputs = {"pixel_values": self.processor.finish(images).to(device), "labels": y.to(device),
                  "label_smoothing": self.label_smoothing}
        if self.teacher is not None:     # the student's own objective takes the teacher's logits
            inputs.update(teacher_logits=self.teacher.logits(images, device), distillation=self.distillation,
                          alpha=self.alpha, tau=self.tau)
        out = training_loss(self.model, inputs, forward=model)
        return out.loss, out.count, {"accuracy": out.metrics["correct"]}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        nll, correct = 0.0, 0
        for b in torch.arange(len(self.valid_y)).split(self.batch_size * 4):
            logits = model(self.processor.finish(self.valid_x[b]).to(device)).float()
            y = self.valid_y[b].to(device)
            nll += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
        n = max(len(self.valid_y), 1)
        return {"val_loss": nll / n, "accuracy": 100.0 * correct / n}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "image", self.model, {"image": self.processor}, {"labels": self.labels})


@dataclass
class LoadedImageClassifier:
    """An image classifier ready for inference: the model (eval mode), its processor and label names."""
    model: nn.Module
    processor: ImageProcessor
    labels: list[str]
    path: Path

    @torch.no_grad()
    def probabilities(self, images: Sequence, batch_size: int = 64) -> Tensor:
        """(N, C) class probabilities, row i for images[i] (paths, PIL images or uint8 arrays)."""
        device = next(self.model.parameters()).device
        out = torch.empty(len(images), len(self.labels))
        for start in range(0, len(images), batch_size):
            x = self.processor(images[start:start + batch_size]).to(device)
            out[start:start + len(x)] = torch.softmax(self.model(x).float(), -1).cpu()
        return out


def _image_families() -> list[str]:
    from ..models.registry import families
    return [f.model_type for f in families(kind=KIND)]


def _students() -> list[str]:
    """The image-classifier families whose classifier learns from a teacher (``learns_from_teacher``:
    its ``loss`` takes the teacher's logits): those ``--teacher`` can train."""
    from ..models.registry import families
    return [f.model_type for f in families(kind=KIND)
            if getattr(f.for_kind(KIND).model_cls, "learns_from_teacher", False)]


class ImageClassification(TaskDefinition):
    name = "image"
    kind = KIND
    help = ("an image classifier (any registered image-classifier family) on the embedded handwritten digits or "
            "a folder of labelled images")
    example = ("attnlab train image                                    # the embedded 8x8 digits\n"
               "  attnlab train image --data photos/ --model vit --time-budget 10\n"
               "  attnlab train image --data photos/train --valid photos/val --image-size 64 --patch-size 8\n"
               "  attnlab train image --model deit --teacher runs/image --out runs/deit")
    options = [
        Option("model", str, None, "a registered image-classifier family (default: vit where registered, else the "
               "only one)", group=_M),
        Option("image_size", int, None, "images are resized to this many pixels square (default: 8 for the "
               "digits; a folder's own size when its images are small, rounded to a multiple of 4, else 32)",
               check=positive, group=_M),
        Option("patch_size", int, None, "pixels per patch side, a divisor of the image size (default: 2 for the "
               "digits, 4 for a folder)", check=positive, group=_M),
        Option("channels", int, None, "colour channels: 3 (RGB) or 1 (grey) (default: 3 for the digits, as "
               "transformers' pipeline gives every model RGB images; a folder's: 1 when its images are grey)",
               choices=(1, 3), group=_M),
        Option("d_model", int, None, "model width (default: 64; a folder of 5,000 images or more with a budget of "
               "10 minutes or more: 128)", check=positive, group=_M),
        Option("heads", int, None, "attention heads (default: 4)", check=positive, group=_M),
        Option("layers", int, None, "layers (default: 4)", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's)", check=positive, group=_M),
        Option("dropout", float, None, "dropout on the embeddings, residual branches and attention weights "
               "(default: 0 for the digits and grey folders, whose augmentation regularises enough; 0.1 for "
               "colour photos)", check=fraction, group=_M),
        Option("label_smoothing", float, None, "label smoothing of the training loss (not with --teacher, "
               "whose losses are DeiT's) (default: 0.1 for a folder, 0 for the digits)", check=fraction, group=_D),
        Option("dyt_alpha", str, None, "DyT's initial alpha (--norm dyt), or --layers + 1 of them separated by commas "
               "(each layer's, then the final norm's) (default: 0.5, the DyT paper's for a ViT; for the digits, whose "
               f"small patches start about 8 times weaker, {_DYT_ALPHA['digits']:g} in the first layer, halved in each "
               "after it: 4,2,1,0.5,0.5 for 4 layers)",
               check=lambda v: None if _alphas(v) is not None else "give a positive number, or several separated "
               "by commas", metavar="A[,A...]", group=_M),
        Option("dyt_alpha_lr", float, None, "the multiple of the learning rate at which DyT's alphas train (--norm "
               "dyt) (default: 1; 10 moved the digits' alphas by factors but scored no better)", check=positive,
               metavar="X", group=_M),
        Option("batch_size", int, 64, "images per micro-batch", check=positive, group=_D),
        Option("ema", float, None, "evaluate, choose and save an exponential moving average of the weights with "
               "this decay per step (0 = off) (default: 0.999 for the digits, off for a folder)", check=lambda v: None if 0 <= v < 1 else
               "must be in [0, 1)", group=_D),
        Option("init", str, None, "start the encoder from a checkpoint whose encoder fits an image classifier: an "
               "attnlab mae or image run, a Hugging Face ViTMAE, ViT, DeiT or Swin directory (a new head; the family "
               "(--model's default), model sizes and processor are the checkpoint's)",
               metavar="RUN_OR_HF_DIR", group=_M),
        Option("label_fraction", float, 1.0, "train on this fraction of the training images, drawn by --seed "
               "within each class (the validation images unchanged): a few labels, as after pre-training",
               check=lambda v: None if 0 < v <= 1 else "must be in (0, 1]", group=_D),
        Option("augment", str, None, "augmentation of the training batches: affine (a slight turn, zoom and move, "
               "never a flip: for handwriting), shift (whole pixels), crop-flip (random resized crop and horizontal "
               "flip: for photos) or none (default: affine for the digits and grey folders, crop-flip for colour "
               "photos)",
               choices=AUGMENTATIONS, group=_D),
        Option("teacher", str, None, "an image run or a Hugging Face image-classification directory with the same "
               "labels: the frozen teacher of a DeiT student", metavar="RUN_OR_HF_DIR", group=_T),
        Option("distillation", str, None, "hard (the teacher's top class) or soft (its distribution) (default: "
               "hard, as the DeiT paper recommends)", choices=("hard", "soft"), group=_T),
        Option("distillation_tau", float, None, "soft distillation's temperature (default: 3.0)", check=positive,
               group=_T),
        Option("distillation_alpha", float, None, "soft distillation's weight of the teacher's term (default: 0.1)",
               check=lambda v: None if 0 <= v <= 1 else "must be in [0, 1]", group=_T),
    ]
    data_paths = ("directory",)
    data_help = "an image folder: one sub-folder of images per class"
    eval_options = [
        Option("limit", int, None, "score only the first N items", check=positive),
        Option("plot", str, None, "write the confusion matrix to this PNG file (an image run: default "
               "confusion.png in the run directory)", metavar="FILE.png"),
    ]

    def check(self, s: Settings) -> None:
        known = _image_families()
        if s.model is None and s.init is not None:     # the family whose classifier the encoder starts
            from .finetune import init_family
            s.model = init_family(s.init)
        if s.model is None:
            from ..models.registry import default_family
            if not known:
                raise ValueError("attnlab train image: no image-classifier family is registered")
            s.model = default_family(KIND)
            if s.model is None:
                raise ValueError(f"--model: give one of the image-classifier families ({', '.join(known)})")
        elif s.model not in known:
            raise ValueError(f"--model: {s.model!r} is not a registered image-classifier family "
                             f"({', '.join(known) or 'none registered'})")
        super().check(s)                 # a family's option (--norm, --pooling) given to another family
        if s.data is None and s.valid is not None:
            raise ValueError("--valid: give the training images too (--data DIR); the embedded digits have their "
                             "own held-out split")
        kind = data_source(s)
        if kind == "folder" and s.init is None and s.teacher is None and Path(s.data).is_dir():
            self._fill(s, folder_defaults(self.survey(s), s.time_budget, self._family_option_names(s)))
        if s.teacher is not None and s.label_smoothing is None:
            s.label_smoothing = 0.0          # DeiT's losses: the labels and the teacher's classes
        self._fill(s, _SIZES[kind])
        if s.norm == "dyt":
            if s.dyt_alpha is None:
                s.dyt_alpha = _digit_dyt_alphas(s.layers) if kind == "digits" else f"{_DYT_ALPHA[kind]:g}"
            alphas = _alphas(s.dyt_alpha)
            if isinstance(alphas, list) and len(alphas) != s.layers + 1:
                raise ValueError(f"--dyt-alpha: {len(alphas)} numbers; give one, or {s.layers + 1} (one per layer "
                                 "of --layers, then the final norm's)")
            if s.dyt_alpha_lr is None:
                s.dyt_alpha_lr = _DYT_ALPHA_LR[kind]
        elif s.dyt_alpha is not None:
            raise ValueError("--dyt-alpha: only with --norm dyt (it sets DyT's initial alpha)")
        elif s.dyt_alpha_lr is not None:
            raise ValueError("--dyt-alpha-lr: only with --norm dyt (it sets how fast DyT's alpha trains)")
        if s.image_size % s.patch_size:
            raise ValueError(f"--image-size {s.image_size} is not a multiple of --patch-size {s.patch_size}")
        self._check_distillation(s)

    @staticmethod
    def _fill(s: Settings, values: dict) -> None:
        for name, value in values.items():
            if s[name] is None:
                s[name] = value

    def _family_option_names(self, s: Settings) -> set[str]:
        from ..models.registry import family
        return {o.name for o in family(s.model).options_for(self.name)}

    def _choices(self, s: Settings) -> str:
        """The line that shows what the folder's defaults chose (the values in use, which a flag overrides)."""
        survey = self.survey(s)
        names = folder_defaults(survey, s.time_budget, self._family_option_names(s))
        budget = f", a {s.time_budget:g}-minute budget" if s.time_budget is not None else ""
        return (f"for {survey.describe()}{budget}: "
                + " ".join(f"--{n.replace('_', '-')} {s[n]:g}" if isinstance(s[n], float) else f"--{n.replace('_', '-')} {s[n]}"
                           for n in names) + " (each flag overrides its default; all saved in config.yaml)")

    def survey(self, s: Settings) -> FolderSurvey:
        """What the training images of ``s.data`` hold (:func:`attnlab.data.images.survey_images`)."""
        return survey_images(self._folders(s)[0])

    @staticmethod
    def _check_distillation(s: Settings) -> None:
        soft = [f"--{n.replace('_', '-')}" for n in ("distillation_tau", "distillation_alpha") if s[n] is not None]
        if s.teacher is None:
            given = (["--distillation"] if s.distillation is not None else []) + soft
            if given:
                raise ValueError(f"{', '.join(given)}: needs --teacher RUN_OR_HF_DIR (and --model deit)")
            return
        students = _students()
        if s.model not in students:
            # a student is a classifier with a distillation head beside its class head (heads())
            raise ValueError(f"--teacher: distillation trains a DeiT student (--model {' or '.join(students)}), "
                             f"not --model {s.model}")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("--teacher: distillation trains in one process; run it without torchrun")
        if s.label_smoothing:
            raise ValueError("--label-smoothing: not with --teacher (the losses are DeiT's: the labels and the "
                             "teacher's classes)")
        s.distillation = s.distillation or "hard"
        if s.distillation == "hard" and soft:
            raise ValueError(f"{', '.join(soft)}: only for --distillation soft")
        if s.distillation == "soft":
            s.distillation_tau = 3.0 if s.distillation_tau is None else s.distillation_tau
            s.distillation_alpha = 0.1 if s.distillation_alpha is None else s.distillation_alpha

    # ------------------------------------------------------------------ data and model
    def _folders(self, s: Settings) -> tuple[ImageFolder, ImageFolder, ImageFolder | None]:
        splits = image_splits(s.data) if s.valid is None else None
        if splits is not None:
            train = read_image_folder(splits["train"])
            valid = read_image_folder(splits["valid"]) if "valid" in splits else None
            test = read_image_folder(splits["test"]) if "test" in splits else None
        else:
            train, test = read_image_folder(s.data), None
            valid = read_image_folder(s.valid) if s.valid is not None else None
        if valid is None:                    # hold out a tenth, at most 2,000
            order = list(range(len(train)))
            random.Random(s.seed).shuffle(order)
            held = set(order[:min(2000, max(1, len(train) // 10))])
            def pick(keep: bool) -> ImageFolder:
                return ImageFolder(train.root, [p for i, p in enumerate(train.paths) if (i in held) != keep],
                                   [y for i, y in enumerate(train.labels) if (i in held) != keep])
            train, valid = pick(True), pick(False)
        if len(train.classes) < 2:
            raise ValueError(f"{train.root}: the training images have {len(train.classes)} class "
                             f"({', '.join(train.classes)}); a classifier needs at least two")
        return train, valid, test

    @staticmethod
    def _processor(s: Settings) -> ImageProcessor:
        grey = [0.5] * s.channels
        # the digits were made by counting ink in blocks: averaging (box) reduces a larger digit the same way
        resample = "box" if data_source(s) == "digits" else "bilinear"
        return ImageProcessor(size=s.image_size, resample=resample, image_mean=grey, image_std=grey)

    def _labels(self, s: Settings) -> list[str]:
        """The class names the data holds, before any image is read."""
        if data_source(s) == "digits":
            from ..data.digits import DIGIT_LABELS
            return list(DIGIT_LABELS)
        return self._folders(s)[0].classes

    def _data(self, s: Settings, processor: ImageProcessor, labels: list[str] | None) -> dict:
        """The training, validation (and test) images as bytes with label indices, the labels and what they are."""
        if data_source(s) == "digits":
            from ..data.digits import DIGIT_LABELS, digits_split
            split = digits_split()
            sets = {k: (_bytes(_arrays(x.expand(-1, 3, -1, -1)), processor), y) for k, (x, y) in split.items()}
            return dict(sets, labels=DIGIT_LABELS, root="the embedded 8x8 handwritten digits")
        train, valid, test = self._folders(s)
        labels = labels or train.classes
        sets = {k: (_bytes(f.paths, processor), _folder_labels(f, labels, name))
                for k, f, name in (("train", train, "training"), ("valid", valid, "validation"))}
        return dict(sets, labels=labels, test=test, root=str(train.root))

    def _model(self, s: Settings, labels: list[str]) -> nn.Module:
        from ..models.registry import family
        fam = family(s.model)
        dyt = {"dyt_alpha": _alphas(s.dyt_alpha)} if s.norm == "dyt" else {}    # the config's, used as built
        config = fam.build_config(image_size=s.image_size, patch_size=s.patch_size, in_channels=s.channels,
                                  d_model=s.d_model, num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                  dropout=s.dropout, num_labels=len(labels), **self.family_sizes(s), **dyt)
        if hasattr(config, "id2label"):       # the label names travel with the weights (export's config.json)
            config.id2label = dict(enumerate(labels))
        torch.manual_seed(s.seed)
        return fam.for_kind(self.kind).build(config)

    def _schedule(self, s: Settings, n_images: int) -> dict:
        kind = data_source(s)
        epochs = max(100, min(5000, 10 * -(-n_images // s.batch_size)))      # about ten epochs
        d = dict(steps=DIGIT_STEPS if kind == "digits" else epochs, lr=_LR[kind], weight_decay=_WEIGHT_DECAY[kind])
        return training_schedule(s, d, lambda steps, budget: 50 if budget else max(1, steps // 10),
                                 lambda steps, budget: max(steps // 5, 20), 4)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:            # the run's own labels, processor and model (the Trainer loads the weights)
            labels = list(saved.task_options["labels"])
            processor = load_processors(saved)["image"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        elif s.init is not None:      # a pre-trained encoder, a new head (attnlab.tasks.finetune)
            from .finetune import fine_tuning_start
            labels = self._labels(s)
            model, processor = fine_tuning_start(s, labels, self._model)
        else:
            labels, processor, model = None, self._processor(s), None
        data = self._data(s, processor, labels)
        labels = data["labels"]
        if s.label_fraction < 1:
            x, y = data["train"]
            keep = label_subset(y, s.label_fraction, s.seed)
            data["train"] = (x[keep], y[keep])
        model = model if model is not None else self._model(s, labels)
        if s.norm == "dyt":       # a fresh, resumed or fine-tuned model alike (the optimizer's groups)
            from ..nn.norm import DyT
            for module in model.modules():
                if isinstance(module, DyT):
                    module.alpha_lr_scale = s.dyt_alpha_lr
        teacher = None if s.teacher is None else load_teacher(s.teacher, labels, processor.channels)
        t = self._schedule(s, len(data["train"][1]))
        s.lr = t["lr"]
        if not t["budget_schedule"]:
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        task = ImageClassificationTask(model, processor, labels, data["train"], data["valid"],
                                       batch_size=s.batch_size, augmentation=s.augment, teacher=teacher,
                                       distillation=s.distillation or "hard", alpha=s.distillation_alpha or 0.1,
                                       tau=s.distillation_tau or 3.0, label_smoothing=s.label_smoothing)
        n = sum(p.numel() for p in model.parameters()) / 1e6
        test = data.get("test")
        few = f" (--label-fraction {s.label_fraction:g}, stratified)" if s.label_fraction < 1 else ""
        lines = [f"data: {data['root']}: {len(data['train'][1]):,} training images{few}, {len(data['valid'][1]):,} "
                 "validation" + (f", {len(test[1] if isinstance(test, tuple) else test):,} test" if test else "")
                 + f"; {len(labels)} classes: "
                 + ", ".join(labels),
                 f"model: {type(model).__name__} ({s.model}), {n:.2f}M parameters"
                 + (", from the checkpoint" if saved is not None else "")
                 + f"; images {s.image_size}x{s.image_size}, {s.channels} channel(s), patches of "
                   f"{s.patch_size}; augmentation: {s.augment}",
                 describe_training(s, t)]
        if data_source(s) == "folder" and saved is None and s.init is None and s.teacher is None:
            lines.insert(2, self._choices(s))
        if teacher is not None:
            lines.append(f"teacher: {type(teacher.model).__name__} from {teacher.where}, frozen; {s.distillation} "
                         "distillation" + (f" (tau {s.distillation_tau:g}, alpha {s.distillation_alpha:g})"
                                           if s.distillation == "soft" else ""))
        return Setup(task, lines, {"test": test}, schedule=t)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        beta2 = s.beta2 if s.beta2 is not None else 0.999
        # the digits' 100 validation images move accuracy in whole points, and a tie keeps the earlier
        # checkpoint: their loss tells two checkpoints apart, so it picks the best one there
        best = ("val_loss", "min") if data_source(s) == "digits" else ("accuracy", "max")
        return dict(setup.schedule, betas=(0.9, beta2), best_metric=best[0],
                    best_mode=best[1], ema_decay=s.ema or None)

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        from .run import open_run
        test = setup.extra["test"]
        if isinstance(test, tuple):          # the fixed test digits, scored by the checkpoint validation chose
            clf = self.load(open_run(run_dir))
            print(f"held-out test digits: {self._score(clf, _arrays(test[0]), test[1].tolist())}")
        elif test is not None and len(test):
            clf = self.load(open_run(run_dir))
            print(f"test: {self._score_folder(clf, test)}")

    # ------------------------------------------------------------------ inference
    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedImageClassifier:
        from ..nn.linear import prepare_for_inference
        from .run import resolve_device
        processors = load_processors(run, {"image": "image processor"})
        model, _ = prepare_for_inference(load_model(run).to(resolve_device(device)).eval(), dtype)
        return LoadedImageClassifier(model, processors["image"], list(run.task_options["labels"]), run.path)

    @staticmethod
    def _score(clf: LoadedImageClassifier, images: Sequence, gold: list[int], plot: str | Path | None = None) -> str:
        """The scores of ``clf`` on ``images`` (paths or arrays) whose classes are ``gold`` (indices)."""
        from ..train.metrics import classification_scores, format_scores
        pred = clf.probabilities(images).argmax(-1).tolist()
        scores = classification_scores(gold, pred, len(clf.labels))
        if plot:
            from ..viz.confusion import plot_confusion
            plot_confusion(scores["confusion"], clf.labels, plot, title=f"confusion matrix ({len(gold)} images)")
        return f"{len(gold)} images\n" + format_scores(scores, clf.labels)

    def _score_folder(self, clf: LoadedImageClassifier, folder: ImageFolder, limit: int | None = None,
                      plot: str | Path | None = None) -> str:
        paths, labels = folder.paths[:limit], folder.labels[:limit]
        strange = sorted(set(labels) - set(clf.labels))
        if strange:
            raise ValueError(f"{folder.root}: class folder(s) {', '.join(strange)} are not among the run's labels "
                             f"({', '.join(clf.labels)})")
        return self._score(clf, paths, [clf.labels.index(y) for y in labels], plot)

    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "fp32") -> None:
        if info.kind != "run":
            raise RunError(f"{path}: {info.describe()}; 'attnlab eval' scores an image run, which knows its label "
                           "names and image processor")
        clf = self.load(info.run, device, dtype)
        plot = settings.plot
        if plot is None:                   # the run directory (a checkpoint's parent), never inside a checkpoint
            given = Path(path)
            plot = (given.parent if given.resolve() == info.run.path.resolve() else given) / "confusion.png"
        print(f"{data}: {self._score_folder(clf, read_image_folder(data), settings.limit, plot)}")
        print(f"confusion matrix: {plot}")


IMAGE = register_task(ImageClassification())
