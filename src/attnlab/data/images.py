"""Labelled images on disk, in the image-folder layout torchvision made familiar::

    DIR/cat/001.png  DIR/cat/002.jpg  DIR/dog/001.png  ...        one sub-folder per class

or the same split into ``DIR/train/``, ``DIR/val/`` (or ``valid/``, ``validation/``) and
``DIR/test/``, each with one sub-folder per class. Files with an image suffix
(:data:`attnlab.processors.IMAGE_SUFFIXES`, any case) are examples; other files (a README, a
.DS_Store) are ignored, and hidden files and folders too. Labels are the class folders' names,
sorted. Reading the pixels is the image processor's job (:mod:`attnlab.processors`); this module
only finds the files and says clearly what is wrong with a folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..processors import IMAGE_SUFFIXES

__all__ = ["ImageFolderError", "ImageFolder", "read_image_folder", "image_splits", "SPLIT_NAMES"]

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
