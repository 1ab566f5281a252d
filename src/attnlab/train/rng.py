"""The global random number generators (python, numpy, torch, CUDA): seeding them, and running a
block with them set aside (the Trainer plans and evaluates without perturbing the training stream)."""
from __future__ import annotations

import random
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import torch

from .checkpoint import capture_rng_state, restore_rng_state

__all__ = ["isolated_rng", "seed_everything"]


@contextmanager
def isolated_rng(seed: int | None = None) -> Iterator[None]:
    """Run a block with the global RNGs (python, numpy, torch, CUDA) set aside, optionally
    seeded; afterwards they are exactly as before."""
    saved = capture_rng_state()
    try:
        if seed is not None:
            seed_everything(seed)
        yield
    finally:
        restore_rng_state(saved)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
