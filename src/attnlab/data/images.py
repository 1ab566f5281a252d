"""Labelled images on disk, in the image-folder layout torchvision made familiar::

    DIR/cat/001.png  DIR/cat/002.jpg  DIR/dog/001.png  ...        one sub-folder per class

or the same split into ``DIR/train/``, ``DIR/val/`` (or ``valid/``, ``validation/``) and
``DIR/test/``, each with one sub-folder per class. Files with an image suffix
(:data:`attnlab.processors.IMAGE_SUFFIXES`, any case) are examples; other files (a README, a
.DS_Store) are ignored, and hidden files and folders too. Labels are the class folders' names,
sorted. Reading the pixels is the image processor's job (:mod:`attnlab.processors`); this module
only finds the files and says clearly what is wrong with a folder.

Augmentations (:data:`AUGMENTATIONS`) work on a batch of the resized bytes a task keeps, (B, C,
H, W) uint8, and return bytes of the same shape, drawn from a ``torch.Generator`` so that a
batch's seed decides them: ``shift`` moves each image by a few pixels (handwriting: a flipped
digit is another digit or none), ``crop-flip`` takes a random resized crop and mirrors half of
the images left to right (photos: a mirrored bee is a bee).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..processors import IMAGE_SUFFIXES

__all__ = ["ImageFolderError", "ImageFolder", "read_image_folder", "image_splits", "SPLIT_NAMES", "FolderSurvey",
           "survey_images", "random_shift",
           "random_resized_crop", "random_affine", "augment", "AUGMENTATIONS"]

# the split sub-folders of a split layout, by role, in the order they are looked for
SPLIT_NAMES = {"train": ("train",), "valid": ("val", "valid", "validation"), "test": ("test",)}


class ImageFolderError(ValueError):
    """A folder that is not an image folder; the message names it and says why."""


@dataclass
class ImageFolder:
    """The examples of one folder: ``paths[i]`` has label ``labels[i]`` (a class folder's name)."""
    root: Path
    paths: list[Path]
    labels: list[str]

    @property
    def classes(self) -> list[str]:
        return sorted(set(self.labels))

    def __len__(self) -> int:
        return len(self.paths)


def _visible(p: Path) -> bool:
    return not p.name.startswith(".")


def read_image_folder(root: str | Path) -> ImageFolder:
    """The images under ``root``'s class sub-folders (recursively within each class); a
    ImageFolderError naming the folder if it is missing, has no class folders, or a class folder
    holds no image."""
    root = Path(root)
    if not root.is_dir():
        raise ImageFolderError(f"{root}: not a directory (an image folder has one sub-folder per class)"
                              if root.exists() else f"{root}: no such directory")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and _visible(p))
    if not classes:
        loose = [p.name for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES]
        hint = f" (it holds {len(loose)} images directly: put each class's images in a folder named after it)" \
            if loose else ""
        raise ImageFolderError(f"{root}: no class folders; an image folder has one sub-folder per class{hint}")
    paths, labels = [], []
    for folder in classes:
        files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        if not files:
            raise ImageFolderError(f"{folder}: a class folder with no image files ({', '.join(IMAGE_SUFFIXES)})")
        paths += files
        labels += [folder.name] * len(files)
    return ImageFolder(root, paths, labels)


def image_splits(root: str | Path) -> dict[str, Path] | None:
    """The split folders of a split layout (role -> folder: "train", and "valid" / "test" where
    present), or None when ``root`` is a plain image folder."""
    root = Path(root)
    found = {}
    for role, names in SPLIT_NAMES.items():
        folder = next((root / n for n in names if (root / n).is_dir()), None)
        if folder is not None:
            found[role] = folder
    if not found:
        return None
    if "train" not in found:
        raise ImageFolderError(f"{root}: has {', '.join(p.name for p in found.values())}/ but no train/ folder")
    return found


# ----------------------------------------------------------------------------- what a folder holds
@dataclass(frozen=True)
class FolderSurvey:
    """What a task's defaults follow in an image folder: its ``images`` and ``classes``, the median
    ``side`` (shorter side, pixels) of a sample of them, and whether every sampled image is ``grey``
    (one channel, or three equal ones)."""
    images: int
    classes: int
    side: int
    grey: bool

    def describe(self) -> str:
        return (f"{self.images:,} images of {self.classes} classes, {self.side} px (median shorter side), "
                f"{'grey' if self.grey else 'colour'}")


def survey_images(folder: ImageFolder, sample: int = 64) -> FolderSurvey:
    """:class:`FolderSurvey` of ``folder`` from ``sample`` of its images spread evenly over it (a
    header read for the size and mode; the pixels only of a three-channel image, to see whether its
    channels differ). An unreadable image is passed over: the reader that loads the images names it."""
    from PIL import Image, UnidentifiedImageError
    import numpy as np
    step = max(1, len(folder) // sample)
    sides, grey = [], True
    for path in folder.paths[::step][:sample]:
        try:
            with Image.open(path) as im:
                sides.append(min(im.size))
                if grey and im.mode not in ("L", "LA", "1", "I", "I;16", "F"):
                    x = np.asarray(im.convert("RGB"), dtype=np.int16)
                    grey = bool((x[..., 0] == x[..., 1]).all() and (x[..., 1] == x[..., 2]).all())
        except (OSError, UnidentifiedImageError, ValueError):
            continue
    sides.sort()
    return FolderSurvey(len(folder), len(folder.classes), sides[len(sides) // 2] if sides else 0, grey)


# ----------------------------------------------------------------------------- augmentations
def random_shift(x: Tensor, max_shift: int, generator: torch.Generator) -> Tensor:
    """Each image of the (B, C, H, W) batch moved by a whole number of pixels in [-max_shift,
    max_shift] down and right (each image its own), the uncovered border filled with zeros."""
    B, C, H, W = x.shape
    s = max_shift
    padded = F.pad(x, (s, s, s, s))
    dy, dx = (torch.randint(0, 2 * s + 1, (B,), generator=generator) for _ in range(2))
    rows = (dy[:, None] + torch.arange(H))[:, None, :, None]            # (B, 1, H, 1)
    cols = (dx[:, None] + torch.arange(W))[:, None, None, :]            # (B, 1, 1, W)
    return padded[torch.arange(B)[:, None, None, None], torch.arange(C)[None, :, None, None], rows, cols]


def random_resized_crop(x: Tensor, generator: torch.Generator, scale: tuple[float, float] = (0.35, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True) -> Tensor:
    """Each image of the (B, C, H, W) uint8 batch replaced by a crop of it, resized back to H x W
    (bilinear): the crop covers a share of the area drawn from ``scale``, its width / height from
    ``ratio`` (log-uniform), and lies inside the image; with ``flip`` half of the images, drawn at
    random, are mirrored left to right. As torchvision's RandomResizedCrop, sampled in one draw."""
    B, C, H, W = x.shape
    u = torch.rand(B, 5, generator=generator, dtype=torch.float64)
    area = scale[0] + (scale[1] - scale[0]) * u[:, 0]
    aspect = torch.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * u[:, 1])
    w = torch.sqrt(area * aspect).clamp(max=1.0)                  # as shares of the width and height
    h = torch.sqrt(area / aspect).clamp(max=1.0)
    cx = (1 - w) * (2 * u[:, 2] - 1)                              # the centre, the crop inside [-1, 1]
    cy = (1 - h) * (2 * u[:, 3] - 1)
    mirror = torch.where(u[:, 4] < 0.5, -1.0, 1.0).double() if flip else torch.ones(B, dtype=torch.float64)
    theta = torch.zeros(B, 2, 3, dtype=torch.float64)
    theta[:, 0, 0], theta[:, 0, 2], theta[:, 1, 1], theta[:, 1, 2] = w * mirror, cx, h, cy
    grid = F.affine_grid(theta.float(), [B, C, H, W], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


def random_affine(x: Tensor, generator: torch.Generator, degrees: float = 10.0, translate: float = 0.1,
                  scale: tuple[float, float] = (0.9, 1.1)) -> Tensor:
    """Each image of the (B, C, H, W) uint8 batch turned by an angle drawn from [-degrees,
    degrees], zoomed by a factor from ``scale`` and moved by up to ``translate`` of its side in
    each direction (uniform draws, each image its own), resampled bilinearly, the uncovered border
    zeros (the dark ground of a digit). Never mirrored: a handwritten digit changes identity under
    a flip, not under a slight slant, size or place."""
    B, C, H, W = x.shape
    u = torch.rand(B, 4, generator=generator, dtype=torch.float64)
    angle = math.radians(degrees) * (2 * u[:, 0] - 1)
    zoom = scale[0] + (scale[1] - scale[0]) * u[:, 1]
    theta = torch.zeros(B, 2, 3, dtype=torch.float64)
    # the grid maps output coordinates to input ones (both in [-1, 1]): the inverse of the motion
    theta[:, 0, 0], theta[:, 0, 1] = torch.cos(angle) / zoom, -torch.sin(angle) / zoom
    theta[:, 1, 0], theta[:, 1, 1] = torch.sin(angle) / zoom, torch.cos(angle) / zoom
    theta[:, :, 2] = 2 * translate * (2 * u[:, 2:] - 1)
    grid = F.affine_grid(theta.float(), [B, C, H, W], align_corners=False)
    out = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    return out.round().clamp(0, 255).to(torch.uint8)


AUGMENTATIONS = ("affine", "shift", "crop-flip", "none")


def augment(x: Tensor, kind: str, seed: int) -> Tensor:
    """The batch ``x`` (B, C, H, W) uint8 augmented as ``kind`` says (:data:`AUGMENTATIONS`),
    decided by ``seed`` alone: the same seed gives the same bytes. ``shift`` moves by up to a
    sixteenth of the image side, at least one pixel (an 8x8 digit resized to 16 moves by half of
    one of its own pixels)."""
    if kind not in AUGMENTATIONS:
        raise ValueError(f"augment: {kind!r} is not one of {', '.join(AUGMENTATIONS)}")
    if kind == "none":
        return x
    generator = torch.Generator().manual_seed(seed)
    if kind == "shift":
        return random_shift(x, max(1, min(x.shape[-2:]) // 16), generator)
    if kind == "affine":
        return random_affine(x, generator)
    return random_resized_crop(x, generator)
