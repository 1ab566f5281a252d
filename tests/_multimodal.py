"""What the tests of the tasks on images and texts (clip, vlm) share: the command line run in-process,
tiny model sizes, a small image folder, and short trained runs."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from attnlab.cli import main

# a model small enough that a few steps take a second, evaluated only at the end
TINY = ["--d-model", "16", "--heads", "2", "--d-ff", "32", "--no-progress", "--eval-every", "0"]
# the vision-language runs: two layers, small batches, a flat learning rate from the first step
VLM_TINY = TINY + ["--layers", "2", "--batch-size", "16", "--schedule", "constant", "--warmup", "0"]


def cli(capsys, *args) -> tuple[int, str, str]:
    """``attnlab ARGS`` in this process: (exit code, stdout, stderr)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def train(task: str, out: Path, steps: int, *flags) -> Path:
    """A run of ``attnlab train TASK`` for ``steps`` steps in ``out`` (AssertionError if it fails)."""
    code = main(["train", task, "--out", str(out), "--steps", str(steps), *map(str, flags)])
    assert code == 0, f"attnlab train {task} exited with {code}"
    return out


def photos(root: Path, per_class: int = 6, classes=("blue", "red", "green")) -> Path:
    """An image folder of 12x12 noise images, one sub-folder per class, each class brighter in its own channel."""
    rng = np.random.default_rng(0)
    for c, label in enumerate(classes):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            x = rng.integers(0, 90, (12, 12, 3))
            x[..., c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / label / f"{i:02d}.png")
    return root


def digit_files(directory: Path, n: int, split: str = "test") -> tuple[list[Path], list[int]]:
    """The first ``n`` digits of the embedded ``split`` saved as PNG files, with their labels."""
    from attnlab.data.digits import digits_split
    x, y = digits_split()[split]
    files = []
    for i in range(n):
        files.append(directory / f"{split}-{i}.png")
        Image.fromarray(x[i, 0].numpy()).save(files[-1])
    return files, y[:n].tolist()
