"""Image classification: a folder of labelled images + an image processor + any registered
image-classifier family, for the Trainer.

    attnlab train image --data photos/ --model vit --time-budget 10
    attnlab classify runs/image cat.png dog.jpg
    attnlab eval runs/image --data photos-test/

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
accuracy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.images import ImageFolder, image_splits, read_image_folder
from ..processors import ImageProcessor
from .base import Option, Setup, TaskDefinition, describe_training, fraction, positive, register_task, training_schedule
from .run import RunError, RunInfo, build_model, load_model, load_processors, resume_point, write_run

__all__ = ["ImageClassification", "ImageClassificationTask", "LoadedImageClassifier"]

_M, _D = "model", "data and evaluation"
KIND = "image-classifier"


def _labelled(folder: ImageFolder, processor: ImageProcessor, labels: list[str], name: str) -> tuple[Tensor, Tensor]:
    """(bytes (N, C, H, W) uint8, label indices (N,)) of a folder's images."""
    index = {label: i for i, label in enumerate(labels)}
    unknown = sorted(set(folder.labels) - index.keys())
    if unknown:
        raise ValueError(f"{folder.root}: the {name} images have class(es) {', '.join(unknown)} that the training "
                         f"data lacks ({', '.join(labels)})")
    data = (torch.stack([processor.resized(p) for p in folder.paths]) if len(folder)
            else torch.empty(0, dtype=torch.uint8))
    return data, torch.tensor([index[y] for y in folder.labels], dtype=torch.long)


class ImageClassificationTask:
    """The Trainer's view of image classification (see :class:`attnlab.train.Task`)."""

    def __init__(self, model: nn.Module, processor: ImageProcessor, labels: list[str], train: ImageFolder,
                 valid: ImageFolder, *, batch_size: int):
        self.model, self.processor, self.labels, self.batch_size = model, processor, labels, batch_size
        self.train_x, self.train_y = _labelled(train, processor, labels, "training")
        self.valid_x, self.valid_y = _labelled(valid, processor, labels, "validation")

    def plan(self, epoch: int, seed: int) -> list[Tensor]:
        order = torch.randperm(len(self.train_y), generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        return list(order.split(self.batch_size))

    def loss(self, model: nn.Module, batch: Tensor) -> tuple[Tensor, int, dict]:
        device = batch.device
        pixels = self.processor.finish(self.train_x[batch.cpu()]).to(device)
        y = self.train_y[batch.cpu()].to(device)
        logits = model(pixels)
        loss = F.cross_entropy(logits.float(), y, reduction="sum")
        with torch.no_grad():
            correct = (logits.argmax(-1) == y).sum()
        return loss, int(y.numel()), {"accuracy": correct}

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


class ImageClassification(TaskDefinition):
    name = "image"
    kind = KIND
    help = "an image classifier (any registered image-classifier family) on a folder of labelled images"
    example = ("attnlab train image --data photos/ --model vit --time-budget 10\n"
               "  attnlab train image --data photos/train --valid photos/val --image-size 64 --patch-size 8")
    options = [
        Option("model", str, None, "a registered image-classifier family (default: vit where registered, else the "
               "only one)", group=_M),
        Option("image_size", int, 32, "images are resized to this many pixels square", check=positive, group=_M),
        Option("patch_size", int, 4, "pixels per patch side (the image size must be a multiple)", check=positive,
               group=_M),
        Option("channels", int, 3, "colour channels: 3 (RGB) or 1 (grey)", choices=(1, 3), group=_M),
        Option("d_model", int, 64, "model width", check=positive, group=_M),
        Option("heads", int, 4, "attention heads", check=positive, group=_M),
        Option("layers", int, 4, "layers", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's)", check=positive, group=_M),
        Option("dropout", float, 0.1, "dropout", check=fraction, group=_M),
        Option("batch_size", int, 64, "images per micro-batch", check=positive, group=_D),
        Option("init", str, None, "start the encoder from an attnlab mae or image run or a Hugging Face ViTMAE or "
               "ViT directory (a new head; the model sizes and processor are the checkpoint's)",
               metavar="RUN_OR_HF_DIR", group=_M),
    ]
    data_paths = ("directory",)
    data_help = "an image folder: one sub-folder of images per class"
    eval_options = [
        Option("limit", int, None, "score only the first N items", check=positive),
        Option("plot", str, None, "write the confusion matrix to this PNG file", metavar="FILE.png"),
    ]

    def check(self, s: dict) -> None:
        known = _image_families()
        if s["model"] is None:
            if not known:
                raise ValueError("attnlab train image: no image-classifier family is registered")
            s["model"] = "vit" if "vit" in known else known[0] if len(known) == 1 else None
            if s["model"] is None:
                raise ValueError(f"--model: give one of the image-classifier families ({', '.join(known)})")
        elif s["model"] not in known:
            raise ValueError(f"--model: {s['model']!r} is not a registered image-classifier family "
                             f"({', '.join(known) or 'none registered'})")
        if s["image_size"] % s["patch_size"]:
            raise ValueError(f"--image-size {s['image_size']} is not a multiple of --patch-size {s['patch_size']}")
        if s["data"] is None:
            raise ValueError("attnlab train image: give --data DIR, a folder with one sub-folder of images per class")

    # ------------------------------------------------------------------ data and model
    def _folders(self, s: dict) -> tuple[ImageFolder, ImageFolder, ImageFolder | None]:
        splits = image_splits(s["data"]) if s["valid"] is None else None
        if splits is not None:
            train = read_image_folder(splits["train"])
            valid = read_image_folder(splits["valid"]) if "valid" in splits else None
            test = read_image_folder(splits["test"]) if "test" in splits else None
        else:
            train, test = read_image_folder(s["data"]), None
            valid = read_image_folder(s["valid"]) if s["valid"] is not None else None
        if valid is None:                    # hold out a tenth, at most 2,000
            order = list(range(len(train)))
            random.Random(s["seed"]).shuffle(order)
            held = set(order[:min(2000, max(1, len(train) // 10))])
            def pick(keep: bool) -> ImageFolder:
                return ImageFolder(train.root, [p for i, p in enumerate(train.paths) if (i in held) != keep],
                                   [y for i, y in enumerate(train.labels) if (i in held) != keep])
            train, valid = pick(True), pick(False)
        if len(train.classes) < 2:
            raise ValueError(f"{train.root}: the training images have {len(train.classes)} class "
                             f"({', '.join(train.classes)}); a classifier needs at least two")
        return train, valid, test

    def _model(self, s: dict, labels: list[str]) -> nn.Module:
        from ..models.registry import family
        fam = family(s["model"])
        config = fam.build_config(image_size=s["image_size"], patch_size=s["patch_size"], in_channels=s["channels"],
                                  d_model=s["d_model"], num_heads=s["heads"], num_layers=s["layers"], d_ff=s["d_ff"],
                                  dropout=s["dropout"], num_labels=len(labels), **self.family_sizes(s))
        torch.manual_seed(s["seed"])
        return fam.for_kind(self.kind).build(config)

    def _schedule(self, s: dict, n_images: int) -> dict:
        epochs = max(100, min(5000, 10 * -(-n_images // s["batch_size"])))      # about ten epochs
        d = dict(steps=epochs, lr=1e-3)
        return training_schedule(s, d, lambda steps, budget: 50 if budget else max(1, steps // 10),
                                 lambda steps, budget: max(steps // 5, 20), 4)

    def prepare(self, s: dict, resume_from: Path | None) -> Setup:
        self.check(s)
        train, valid, test = self._folders(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:            # the run's own labels, processor and model (the Trainer loads the weights)
            labels = list(saved.task_options["labels"])
            processor = load_processors(saved)["image"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        elif s["init"] is not None:      # a pre-trained encoder, a new head (attnlab.tasks.mae)
            from .mae import fine_tuning_start
            labels = train.classes
            model, processor = fine_tuning_start(s, labels, self._model)
        else:
            labels = train.classes
            grey = [0.5] * s["channels"]
            processor = ImageProcessor(size=s["image_size"], image_mean=grey, image_std=grey)
            model = self._model(s, labels)
        t = self._schedule(s, len(train))
        s["lr"] = t["lr"]
        if not t["budget_schedule"]:
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        task = ImageClassificationTask(model, processor, labels, train, valid, batch_size=s["batch_size"])
        n = sum(p.numel() for p in model.parameters()) / 1e6
        lines = [f"data: {train.root}: {len(train):,} training images, {len(valid):,} validation"
                 + (f", {len(test):,} test" if test else "") + f"; {len(labels)} classes: {', '.join(labels)}",
                 f"model: {type(model).__name__} ({s['model']}), {n:.2f}M parameters"
                 + (", from the checkpoint" if saved is not None else "")
                 + f"; images {s['image_size']}x{s['image_size']}, {s['channels']} channel(s), patches of "
                   f"{s['patch_size']}",
                 describe_training(s, t)]
        return Setup(task, lines, {"test": test})

    def train_config(self, s: dict, setup: Setup) -> dict:
        beta2 = s["beta2"] if s["beta2"] is not None else 0.999
        return dict(self._schedule(s, len(setup.task.train_y)), betas=(0.9, beta2), best_metric="accuracy",
                    best_mode="max")

    def report(self, run_dir: Path, setup: Setup, s: dict) -> None:
        from .run import open_run
        test = setup.extra["test"]
        if test is not None and len(test):
            clf = self.load(open_run(run_dir))
            print(f"test: {self._score(clf, test)}")

    # ------------------------------------------------------------------ inference
    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedImageClassifier:
        from ..nn.linear import prepare_for_inference
        from .run import resolve_device
        processors = load_processors(run)
        if "image" not in processors:
            raise RunError(f"{run.path}: the run records no image processor")
        model, _ = prepare_for_inference(load_model(run).to(resolve_device(device)).eval(), dtype)
        return LoadedImageClassifier(model, processors["image"], list(run.task_options["labels"]), run.path)

    @staticmethod
    def _score(clf: LoadedImageClassifier, folder: ImageFolder, limit: int | None = None, plot: str | None = None):
        from .classify import classification_scores, format_scores
        paths, labels = folder.paths[:limit], folder.labels[:limit]
        known = set(clf.labels)
        strange = sorted(set(labels) - known)
        if strange:
            raise ValueError(f"{folder.root}: class folder(s) {', '.join(strange)} are not among the run's labels "
                             f"({', '.join(clf.labels)})")
        pred = clf.probabilities(paths).argmax(-1).tolist()
        scores = classification_scores([clf.labels.index(y) for y in labels], pred, len(clf.labels))
        if plot:
            from ..viz.confusion import plot_confusion
            plot_confusion(scores["confusion"], clf.labels, plot)
        return f"{len(paths)} images\n" + format_scores(scores, clf.labels)

    def evaluate_file(self, path: str, info, data: str, settings: dict, device: str | None = None,
                      dtype: str = "fp32") -> None:
        if info.kind != "run":
            raise RunError(f"{path}: {info.describe()}; 'attnlab eval' scores an image run, which knows its label "
                           "names and image processor")
        clf = self.load(info.run, device, dtype)
        print(f"{data}: {self._score(clf, read_image_folder(data), settings['limit'], settings['plot'])}")
        if settings["plot"]:
            print(f"confusion matrix: {settings['plot']}")


IMAGE = register_task(ImageClassification())
