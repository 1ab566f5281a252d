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
           "cosine_schedule", "constant_schedule", "make_schedule", "steps_for_budget", "BudgetPlanner", "SCHEDULES"]

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
    """A schedule whose length is fixed by a time budget: the steps the first ones predict.

    Until :meth:`plan` is called (after the first ``measure`` steps, whose speed predicts how
    many steps fit in the budget), the factor is the warmup ramp ``s / warmup``. ``plan(total)``
    fixes the total; from then on the factor is ``inner``'s ("cosine": warmup then cosine decay
    to ``min_lr_ratio`` at ``total``; "constant": warmup then 1), with the warmup shortened to
    a tenth of the total when the budget is too short for the asked one (never below ``measure``,
    so the steps already taken keep their place on the ramp). Once planned, the factor is a
    function of the step alone: a resumed run that restores ``state()`` repeats it exactly.
    """

    def __init__(self, inner: str, warmup: int, measure: int, min_lr_ratio: float = 0.0):
        if inner not in ("cosine", "constant") or warmup < 0 or measure < 1 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"BudgetFactor: need a cosine or constant inner schedule, warmup >= 0, measure >= 1, "
                             f"0 <= min_lr_ratio <= 1; got {inner!r}, {warmup}, {measure}, {min_lr_ratio}")
        self.inner, self.asked_warmup, self.measure, self.min_lr_ratio = inner, warmup, measure, min_lr_ratio
        self.warmup, self.total_steps = warmup, None

    def plan(self, total_steps: int) -> None:
        """Fix the schedule's length (at the step that measured the speed, >= ``measure``)."""
        total_steps = max(int(total_steps), self.measure + 1)
        self.total_steps = total_steps
        self.warmup = min(self.asked_warmup, max(self.measure, total_steps // 10))

    def replan(self, total_steps: int) -> None:
        """Change the length once more, at the end of the warmup (a longer measurement of the
        speed): the warmup stays, so every step taken keeps its lr; only the decay moves."""
        self.total_steps = max(int(total_steps), self.warmup + 1)

    def state(self) -> dict:
        return {"total_steps": self.total_steps, "warmup": self.warmup}

    def load_state(self, state: dict) -> None:
        self.total_steps, self.warmup = state["total_steps"], state["warmup"]

    def __call__(self, k: int) -> float:
        s = k + 1
        if self.total_steps is None or s <= self.measure:       # the measured steps: the asked warmup's ramp
            return 1.0 if s >= self.asked_warmup else s / self.asked_warmup
        if self.inner == "constant":
            return ConstantFactor(self.warmup)(k)
        return CosineFactor(self.warmup, self.total_steps, self.min_lr_ratio)(k)


def steps_for_budget(step: int, elapsed_s: float, seconds_per_step: float, budget_s: float,
                     reserve: float = 0.0) -> int:
    """The total number of optimizer steps that ends training with the budget: ``step`` done
    after ``elapsed_s`` seconds, then ``seconds_per_step`` each, keeping a ``reserve`` share of
    the budget for evaluations and checkpoints."""
    if seconds_per_step <= 0 or budget_s <= 0 or not 0.0 <= reserve < 1.0:
        raise ValueError(f"steps_for_budget: need positive speed and budget and 0 <= reserve < 1, got "
                         f"{seconds_per_step}, {budget_s}, {reserve}")
    left = budget_s * (1.0 - reserve) - elapsed_s
    return step + max(0, math.floor(left / seconds_per_step))


class BudgetPlanner:
    """Decides how many steps fit in a time budget from the speed of the first ones.

    Call :meth:`speed` after every optimizer step with the seconds since training (re)started:
    the first call marks the start of the measurement (the first step warms allocators and
    kernels up and is not counted), and after ``measure`` more steps it returns the seconds per
    step (None before). :meth:`plan` turns that into the schedule's length (at most ``cap``)
    and, with ``evals`` > 0, the interval that spreads that many evaluations and checkpoints.
    """

    def __init__(self, budget_s: float, measure: int, reserve: float = 0.0, evals: int = 0, cap: int | None = None):
        self.budget_s, self.measure, self.reserve, self.evals, self.cap = budget_s, measure, reserve, evals, cap
        self._mark: tuple[int, float] | None = None

    def speed(self, step: int, elapsed_s: float) -> float | None:
        if self._mark is None:
            self._mark = (step, elapsed_s)
            return None
        done = step - self._mark[0]
        return (elapsed_s - self._mark[1]) / done if done >= self.measure else None

    def plan(self, step: int, elapsed_s: float, seconds_per_step: float) -> dict:
        total = steps_for_budget(step, elapsed_s, max(seconds_per_step, 1e-9), self.budget_s, self.reserve)
        total = max(min(total, self.cap or total), step + 1)
        plan = {"steps": total, "measured_s_per_step": seconds_per_step, "at_step": step}
        if self.evals:
            plan["eval_every"] = plan["save_every"] = max(1, math.ceil(total / self.evals))
        return plan


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
                  d_model: int | None = None, measure: int = 20) -> LambdaLR:
    """Build a schedule by name: "noam" (needs ``d_model``) | "cosine" | "constant".

    ``total_steps=None``: the length comes from a time budget later; a cosine or constant
    schedule is then a :class:`BudgetFactor` measuring the first ``measure`` steps (noam does
    not depend on the total)."""
    if total_steps is None and name in ("cosine", "constant"):
        return LambdaLR(optimizer, BudgetFactor(name, warmup, measure, min_lr_ratio))
    if name == "noam":
        if d_model is None:
            raise ValueError("make_schedule: the noam schedule needs d_model")
        return noam_schedule(optimizer, d_model, warmup)
    if name == "cosine":
        return cosine_schedule(optimizer, warmup, total_steps, min_lr_ratio)
    if name == "constant":
        return constant_schedule(optimizer, warmup)
    raise ValueError(f"make_schedule: unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
