"""An exponential moving average of the weights (EMA, Polyak averaging), for the Trainer.

After every optimizer step each floating parameter's average moves towards it:

    average <- decay * average + (1 - decay) * weight        (the average starts at the first weights)

so the average weighs the last ~1 / (1 - decay) steps most (decay 0.999: about a thousand). It
smooths the noise of the last steps of a small-batch run, and a model evaluated with it often
scores higher than the raw weights it averages. Buffers (none in attnlab's models but a few
tables) are not averaged: the model's own are used.

In a checkpoint the averaged weights are what ``model.safetensors`` holds, so that everything
reading a run (inference, evaluation, export, the best checkpoint's choice) sees the average,
and the weights that training continues from are in ``training_weights.safetensors`` beside it;
:meth:`ExponentialMovingAverage.swap` exchanges the two in place, exactly, so a resumed run goes
on bit for bit.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

__all__ = ["ExponentialMovingAverage", "TRAINING_WEIGHTS_FILE", "applied", "resume_average",
           "with_training_weights"]

TRAINING_WEIGHTS_FILE = "training_weights.safetensors"


def _averaged(model: nn.Module) -> list[tuple[str, Tensor]]:
    """The floating parameters of ``model`` (tied ones once), by name."""
    return [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]


class ExponentialMovingAverage:
    """The average of ``model``'s floating parameters, in fp32, updated by :meth:`update`."""

    def __init__(self, model: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ExponentialMovingAverage: decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.average = {name: p.detach().float().clone() for name, p in _averaged(model)}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One step: average <- decay * average + (1 - decay) * weight, for each averaged parameter."""
        for name, p in _averaged(model):
            self.average[name].mul_(self.decay).add_(p.detach().float(), alpha=1.0 - self.decay)

    @torch.no_grad()
    def swap(self, model: nn.Module) -> None:
        """Exchange the model's weights and the average in place (twice is the identity, bit for bit)."""
        for name, p in _averaged(model):
            kept = p.detach().clone()
            p.copy_(self.average[name])
            self.average[name].copy_(kept)

    def save(self, file: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.average.items()}, str(file))

    def load(self, file: str | Path) -> None:
        """Read the held tensors back (strict: the same names); ValueError in one line otherwise."""
        tensors = load_file(str(file))
        if tensors.keys() != self.average.keys():
            missing, extra = sorted(self.average.keys() - tensors.keys()), sorted(tensors.keys() - self.average.keys())
            raise ValueError(f"{file}: its tensors do not match the model's parameters (missing {missing[:5]}, "
                             f"unexpected {extra[:5]})")
        for k, v in tensors.items():
            self.average[k].copy_(v)


def applied(ema: ExponentialMovingAverage | None, model: nn.Module):
    """A context in which ``model`` holds the averaged weights (none without an average)."""
    return nullcontext() if ema is None else _swapped(ema, model)


@contextmanager
def _swapped(ema: ExponentialMovingAverage, model: nn.Module):
    ema.swap(model)
    try:
        yield
    finally:
        ema.swap(model)


def resume_average(ckpt: Path, model: nn.Module, decay: float | None) -> tuple[ExponentialMovingAverage | None,
                                                                               str | None]:
    """After ``model`` has read ``ckpt``'s model.safetensors: put the training weights back into it
    and return (the average to go on with, or None without ``decay``; a warning, or None). A
    checkpoint written without an average starts one from its weights."""
    raw = Path(ckpt) / TRAINING_WEIGHTS_FILE
    if not raw.is_file():
        if decay is None:
            return None, None
        return (ExponentialMovingAverage(model, decay),
                f"resume: {ckpt.name} holds no average of the weights; the average starts from its weights")
    ema = ExponentialMovingAverage(model, decay or 0.5)     # shaped like the model
    ema.load(raw)                                           # the training weights ...
    ema.swap(model)                                         # ... into the model, the average into ema
    if decay is None:
        return None, (f"resume: {ckpt.name} was trained with an average of the weights (ema_decay), this run "
                      "without: it trains on from the training weights, and its checkpoints hold them")
    return ema, None


def with_training_weights(ema: ExponentialMovingAverage, assets: Callable[[Path], None] | None) -> Callable[[Path], None]:
    """A checkpoint's ``assets`` writer that also writes the training weights, which ``ema`` holds
    while the checkpoint is written from the model (see :func:`applied`)."""
    def write(directory: Path) -> None:
        if assets is not None:
            assets(directory)
        ema.save(Path(directory) / TRAINING_WEIGHTS_FILE)
    return write
