"""The embedded image set: scikit-learn's bundled 8x8 handwritten digits (1,797 real images of
the digits 0-9, the test part of the UCI "Optical Recognition of Handwritten Digits" set, shipped
inside scikit-learn, so nothing is downloaded).

Each image counts the ink pixels in 4x4 blocks of a 32x32 bitmap, so its values are 0-16, light
digits on a dark ground. :func:`digit_images` gives them as grey bytes (value * 255 / 16,
rounded), the form a task keeps its training images in; a digit drawn light on dark in a PNG of
any size and reduced to 8x8 by averaging (a box filter) looks like them.

The split is fixed: :func:`digits_split` shuffles with its own seed (not the run's) and keeps
:data:`HELD_OUT` images per class as the test digits, which every run of every model is scored
on, and the next :data:`VALIDATION` per class as the validation digits, which choose a run's best
checkpoint, so that the accuracy reported is never the one a checkpoint was picked by.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["digit_images", "digits_split", "DIGIT_LABELS", "HELD_OUT", "VALIDATION", "SPLIT_SEED"]

DIGIT_LABELS = [str(d) for d in range(10)]
HELD_OUT = 20            # images per class in the held-out test split (200 of 1,797)
VALIDATION = 10          # images per class in the validation split (100 more)
SPLIT_SEED = 1797        # the split's own seed: the same held-out images whatever --seed a run has


def digit_images() -> tuple[Tensor, Tensor]:
    """(images (1797, 1, 8, 8) uint8, labels (1797,) int64 digits 0-9), in scikit-learn's order."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.from_numpy(digits.images).double().mul(255 / 16).round().to(torch.uint8).unsqueeze(1)
    return images.contiguous(), torch.from_numpy(digits.target).long()


def digits_split() -> dict[str, tuple[Tensor, Tensor]]:
    """{"train": (images, labels), "valid": ..., "test": ...}: of each digit, :data:`HELD_OUT`
    images for the test, the next :data:`VALIDATION` for validation, chosen by a shuffle under
    :data:`SPLIT_SEED`; each part in the shuffled order."""
    images, labels = digit_images()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    part = torch.zeros(len(labels), dtype=torch.long)           # 0 train, 1 valid, 2 test
    for digit in range(10):
        mine = order[labels[order] == digit]
        part[mine[:HELD_OUT]] = 2
        part[mine[HELD_OUT:HELD_OUT + VALIDATION]] = 1
    return {name: (images[order[part[order] == i]], labels[order[part[order] == i]])
            for i, name in enumerate(("train", "valid", "test"))}
