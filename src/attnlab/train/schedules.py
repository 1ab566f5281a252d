"""Learning-rate schedules as ``torch.optim.lr_scheduler.LambdaLR`` factories.

Step numbering: optimizer steps are counted from **1**, as in the paper. LambdaLR calls
its factor with its internal counter k = 0 for the first optimizer step (set up at
construction), 1 for the second, ...; every factor below maps k to step s = k + 1, so
the lr used by the s-th optimizer step is ``lr * factor(s)``.

How the factor combines with ``lr``: the factor **multiplies** the optimizer's base lr.
For the cosine and constant schedules the factor peaks at 1, so ``lr`` is the peak lr.
For Noam the factor is the paper's absolute rate (section 5.3),

    lrate(s) = d_model^-0.5 * min(s^-0.5, s * warmup^-1.5),

so ``lr`` is a scale factor on it: lr = 1.0 reproduces the paper exactly (its peak, at
s = warmup, is (d_model * warmup)^-0.5, about 7e-4 for d_model 512 and warmup 4000).

The factors are small callable classes, not closures, so LambdaLR can save their
settings in its state dict.
"""
from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["noam", "NoamFactor", "CosineFactor", "ConstantFactor", "BudgetFactor", "noam_schedule",
           "cosine_schedule", "constant_schedule", "make_schedule", "SCHEDULES"]

SCHEDULES = ("noam", "cosine", "constant")


def noam(step: int, d_model: int, warmup: int) -> float:
    """The paper's learning rate at optimizer step ``step`` (>= 1): linear warmup for
    ``warmup`` steps, then decay proportional to step^-0.5."""
    if step < 1:
        raise ValueError(f"noam: steps are numbered from 1, got {step}")
    if d_model <= 0 or warmup <= 0:
        raise ValueError(f"noam: d_model and warmup must be positive, got {d_model}, {warmup}")
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class NoamFactor:
    """LambdaLR factor: ``noam(k + 1, d_model, warmup)``."""

    def __init__(self, d_model: int, warmup: int):
        noam(1, d_model, warmup)  # validates
        self.d_model, self.warmup = d_model, warmup

    def __call__(self, k: int) -> float:
        return noam(k + 1, self.d_model, self.warmup)


class CosineFactor:
    """Linear warmup from 1/warmup to 1 over ``warmup`` steps, then half a cosine from 1 down to
    ``min_lr_ratio`` at step ``total_steps``, constant after that."""

    def __init__(self, warmup: int, total_steps: int, min_lr_ratio: float = 0.0):
        if warmup < 0 or total_steps < 1 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"CosineFactor: need warmup >= 0, total_steps >= 1, 0 <= min_lr_ratio <= 1; "
                             f"got {warmup}, {total_steps}, {min_lr_ratio}")
        self.warmup, self.total_steps, self.min_lr_ratio = warmup, total_steps, min_lr_ratio

    def __call__(self, k: int) -> float:
        s = k + 1
        if s <= self.warmup:
            return s / self.warmup
        span = max(1, self.total_steps - self.warmup)
        progress = min(1.0, (s - self.warmup) / span)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ConstantFactor:
    """Linear warmup to 1 over ``warmup`` steps (none if 0), then constant 1."""

    def __init__(self, warmup: int = 0):
        if warmup < 0:
            raise ValueError(f"ConstantFactor: warmup must be >= 0, got {warmup}")
        self.warmup = warmup

    def __call__(self, k: int) -> float:
        s = k + 1
        return 1.0 if s >= self.warmup else s / self.warmup


class BudgetFactor:
    """A schedule whose length a time budget fixes while it runs
    (:class:`attnlab.train.budget.BudgetPlanner` decides the lengths).

    Until the first :meth:`plan` the factor is the asked warmup's ramp ``s / warmup`` (then 1).
    ``plan(total, at_step)``, after ``at_step`` steps, makes the schedule end at ``total``:
    ``inner``'s shape ("cosine": warmup then half a cosine down to ``min_lr_ratio`` at ``total``;
    "constant": warmup then 1), re-fitted from ``at_step`` on so that the lr stays continuous:

    - the cosine's progress p (0 at the start of the decay, 1 at its end) is piecewise linear in
      the step: a plan starts a new piece at ``at_step`` from the progress reached there, running
      to 1 at the new total;
    - within the warmup, a total too short for the asked warmup shortens it to a tenth of the
      total (but never to less than twice the steps taken: the ramp ahead climbs at most twice
      as fast as the ramp behind), and the ramp goes on from the lr reached to 1 at its new end.

    The factor is a function of the step and :meth:`state` alone: a resumed run that restores the
    state repeats it exactly.
    """

    def __init__(self, inner: str, warmup: int, min_lr_ratio: float = 0.0):
        if inner not in ("cosine", "constant") or warmup < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"BudgetFactor: need a cosine or constant inner schedule, warmup >= 0 and "
                             f"0 <= min_lr_ratio <= 1; got {inner!r}, {warmup}, {min_lr_ratio}")
        self.inner, self.asked_warmup, self.min_lr_ratio = inner, warmup, min_lr_ratio
        self.warmup, self.total_steps = warmup, None
        self.ramp = (0, 0.0)          # (step, factor there): the warmup rises linearly from here to 1
        self.knot = (warmup, 0.0)     # (step, decay progress there): the decay's current piece starts here

    def plan(self, total_steps: int, at_step: int) -> None:
        """End the schedule at ``total_steps`` (``at_step`` steps taken)."""
        if at_step < self.warmup:
            warmup = min(self.asked_warmup, max(int(total_steps) // 10, 2 * at_step))
            if warmup != self.warmup:
                self.ramp, self.warmup = (at_step, self(at_step - 1)), warmup
            self.knot = (self.warmup, 0.0)
        elif at_step > self.knot[0]:
            self.knot = (at_step, 0.0 if self.total_steps is None else self.progress(at_step))
        self.total_steps = max(int(total_steps), self.knot[0] + 1)

    def progress(self, s: int) -> float:
        """Where step ``s`` (after the warmup) is on the decay: 0 at its start, 1 at its end."""
        start, p = self.knot
        return p + (1.0 - p) * min(1.0, (s - start) / (self.total_steps - start))

    def state(self) -> dict:
        return {"total_steps": self.total_steps, "warmup": self.warmup, "ramp": list(self.ramp),
                "knot": list(self.knot)}

    def load_state(self, state: dict) -> None:
        self.total_steps, self.warmup = state["total_steps"], state["warmup"]
        self.ramp, self.knot = tuple(state["ramp"]), tuple(state["knot"])

    def __call__(self, k: int) -> float:
        s = k + 1
        if s <= self.warmup:
            start, v = self.ramp
            return v + (1.0 - v) * (s - start) / (self.warmup - start)
        if self.inner == "constant" or self.total_steps is None:
            return 1.0
        m = self.min_lr_ratio
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * self.progress(s)))


def noam_schedule(optimizer: Optimizer, d_model: int, warmup: int) -> LambdaLR:
    """The paper's schedule; the optimizer's lr scales it (1.0 = the paper)."""
    return LambdaLR(optimizer, NoamFactor(d_model, warmup))


def cosine_schedule(optimizer: Optimizer, warmup: int, total_steps: int, min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
    return LambdaLR(optimizer, CosineFactor(warmup, total_steps, min_lr_ratio))


def constant_schedule(optimizer: Optimizer, warmup: int = 0) -> LambdaLR:
    """Linear warmup then the constant base lr."""
    return LambdaLR(optimizer, ConstantFactor(warmup))


def make_schedule(name: str, optimizer: Optimizer, *, warmup: int, total_steps: int | None, min_lr_ratio: float = 0.0,
                  d_model: int | None = None) -> LambdaLR:
    """Build a schedule by name: "noam" (needs ``d_model``) | "cosine" | "constant".

    ``total_steps=None``: the length comes from a time budget later; a cosine or constant
    schedule is then a :class:`BudgetFactor` (noam does not depend on the total)."""
    if total_steps is None and name in ("cosine", "constant"):
        return LambdaLR(optimizer, BudgetFactor(name, warmup, min_lr_ratio))
    if name == "noam":
        if d_model is None:
            raise ValueError("make_schedule: the noam schedule needs d_model")
        return noam_schedule(optimizer, d_model, warmup)
    if name == "cosine":
        return cosine_schedule(optimizer, warmup, total_steps, min_lr_ratio)
    if name == "constant":
        return constant_schedule(optimizer, warmup)
    raise ValueError(f"make_schedule: unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
