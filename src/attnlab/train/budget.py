"""A schedule sized by a time budget, and re-sized while it runs.

The Trainer tells :class:`BudgetPlanner` how long each optimizer step took and how long each
evaluation and checkpoint took; once ``measure`` steps have been timed (the run's first step,
which warms allocators and kernels up, is not counted) the planner fixes the schedule's length
to the steps that fit in the budget, and from then on it projects when the run would end:

    end = elapsed + (steps left) x (mean step time over the last ``measure`` steps)
          + (evaluations and checkpoints left) x (their mean time so far)

Whenever that projection misses the target (the budget less half the ``tolerance``) by more than
``tolerance`` of the budget, and ``measure`` steps have passed since the last plan (or an
evaluation or checkpoint has been timed since), it plans again from the current step. A machine that is slow for the first minute (another process, cold
caches) or slows down midway therefore still ends with the budget. Until an evaluation or a
checkpoint has been timed, a ``reserve`` share of the budget stands in for all of them.

A plan only says how many steps there are in all; the lr schedule
(:class:`attnlab.train.schedules.BudgetFactor`) re-fits its decay from the current step so that
the learning rate stays continuous. The planner's whole state (the timings it has seen, the
plan in force and the plans so far) goes into every checkpoint: a resumed run makes the plans the
uninterrupted run made up to the checkpoint, and from there on decides from its own timings.
"""
from __future__ import annotations

import math
from collections import deque

from torch.optim.lr_scheduler import LambdaLR

from .schedules import BudgetFactor

__all__ = ["steps_for_budget", "stops_between", "BudgetPlanner", "fit_schedule"]

HISTORY = 100   # plans kept in the record (the plan in force alone decides what happens next)


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


def stops_between(step: int, total: int, eval_every: int, save_every: int) -> int:
    """How many steps after ``step`` up to ``total`` evaluate or save (intervals of 0 are off);
    the last step always does both."""
    def multiples(every: int) -> int:
        return total // every - step // every if every else 0

    both = math.lcm(eval_every, save_every) if eval_every and save_every else 0
    n = multiples(eval_every) + multiples(save_every) - multiples(both)
    on_interval = any(every and total % every == 0 for every in (eval_every, save_every))
    return n + (0 if on_interval or total <= step else 1)


class BudgetPlanner:
    """Plans (and re-plans) how many optimizer steps fit in ``budget_s`` seconds.

    Per step call :meth:`observe` (that step's seconds; with ``stop_s`` the seconds of its
    evaluation, the step's checkpoint being added later by :meth:`add_stop_seconds`), then
    :meth:`decide`, which returns a new plan or None. A plan is a dict: ``steps`` (in all, at most
    ``cap``), ``at_step``, ``measured_s_per_step`` and, with ``evals`` > 0, ``eval_at``: the steps
    before the last that evaluate and save, so that ``evals`` evaluations (the last step's
    included) are spread evenly over the run; without
    ``evals`` the fixed ``intervals`` (eval_every, save_every) are counted in the projection.
    """

    def __init__(self, budget_s: float, measure: int, reserve: float = 0.1, evals: int = 0, cap: int | None = None,
                 intervals: tuple[int, int] = (0, 0), tolerance: float = 0.02):
        if budget_s <= 0 or measure < 1 or not 0.0 <= reserve < 1.0 or evals < 0 or not 0.0 < tolerance < 0.5:
            raise ValueError(f"BudgetPlanner: need budget_s > 0, measure >= 1, 0 <= reserve < 1, evals >= 0 and "
                             f"0 < tolerance < 0.5; got {budget_s}, {measure}, {reserve}, {evals}, {tolerance}")
        self.budget_s, self.measure, self.reserve, self.evals, self.cap = budget_s, measure, reserve, evals, cap
        self.intervals, self.tolerance = intervals, tolerance
        # aim a little short, as a run that would overshoot is cut by the hard stop before its decay
        # ends; but only a little, as the last evaluation's time (after the last plan) is a guess
        self.target_s = budget_s * (1.0 - tolerance / 2)
        self.window: deque[float] = deque(maxlen=measure)
        self.stops, self.stop_s = 0, 0.0
        self.plan: dict | None = None
        self.history: list[list] = []        # [at_step, steps, seconds per step] of each plan
        self.replans = 0

    # ------------------------------------------------------------------ what the Trainer reports
    def observe(self, step: int, step_s: float, stop_s: float | None = None) -> None:
        if step > 1:
            self.window.append(step_s)
        if stop_s is not None:
            self.stops, self.stop_s = self.stops + 1, self.stop_s + stop_s

    def add_stop_seconds(self, seconds: float) -> None:
        self.stop_s += seconds

    def seconds_per_step(self) -> float | None:
        """The mean over the last ``measure`` timed steps (None until that many)."""
        return sum(self.window) / len(self.window) if len(self.window) == self.measure else None

    # ------------------------------------------------------------------ the plan
    def _evals_ahead(self, step: int, total: int) -> list[int]:
        """With ``evals``: the steps after ``step`` and before ``total`` that evaluate (and save):
        the k-th of those not yet done at k / evals of the run, or at once if the run has grown past it."""
        at = {max(step + 1, round(total * k / self.evals)) for k in range(self.stops + 1, self.evals)}
        return sorted(at - {total})

    def _overhead(self, step: int, total: int) -> float:
        """Seconds the evaluations and checkpoints after ``step`` will take, up to ``total``."""
        if total <= step:
            return 0.0
        if self.stops == 0:
            return self.reserve * self.budget_s
        n = len(self._evals_ahead(step, total)) + 1 if self.evals else stops_between(step, total, *self.intervals)
        return n * self.stop_s / self.stops

    def projected_end(self, step: int, elapsed_s: float, seconds_per_step: float, total: int) -> float:
        return elapsed_s + (total - step) * seconds_per_step + self._overhead(step, total)

    def _fit(self, step: int, elapsed_s: float, per_step: float) -> int:
        total = step + 1
        for _ in range(4):      # the overhead depends on the length (evaluations spread over it): settle it
            left = self.target_s - elapsed_s - self._overhead(step, total)
            total = step + max(1, math.floor(left / per_step))
        return min(total, self.cap) if self.cap else total

    def decide(self, step: int, elapsed_s: float) -> dict | None:
        """A new plan at ``step`` (``elapsed_s`` seconds of training so far), or None: too few steps
        timed, too soon after the last plan, or the plan in force still ends close enough."""
        per_step = self.seconds_per_step()
        if per_step is None:
            return None
        per_step = max(per_step, 1e-9)
        if self.plan is not None:
            # a window of step times not yet renewed since the last plan is mostly the same news;
            # a newly timed evaluation or checkpoint is not
            if step - self.plan["at_step"] < self.measure and self.stops == self.plan["stops"]:
                return None
            miss = self.projected_end(step, elapsed_s, per_step, self.plan["steps"]) - self.target_s
            if abs(miss) <= self.tolerance * self.budget_s:
                return None
        total = max(self._fit(step, elapsed_s, per_step), step + 1)
        if self.plan is not None and total == self.plan["steps"]:
            return None
        plan = {"steps": total, "at_step": step, "measured_s_per_step": per_step, "stops": self.stops}
        if self.evals:
            plan["eval_at"] = self._evals_ahead(step, total)
        self.replans += self.plan is not None
        self.plan = plan
        self.history = (self.history + [[step, total, per_step]])[-HISTORY:]
        return plan

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        return {"plan": self.plan, "history": self.history, "replans": self.replans, "window": list(self.window),
                "stops": self.stops, "stop_s": self.stop_s}

    def load_state(self, state: dict, where="the checkpoint") -> None:
        if not {"plan", "history", "replans", "window", "stops", "stop_s"} <= set(state):
            raise ValueError(f"{where}: a --time-budget run saved by an attnlab that planned its schedule once, "
                             "which this one cannot continue; train it again")
        self.plan, self.history, self.replans = state["plan"], state["history"], state["replans"]
        self.window = deque(state["window"], maxlen=self.measure)
        self.stops, self.stop_s = state["stops"], state["stop_s"]


def fit_schedule(plan: dict, scheduler: LambdaLR, step: int, resumed: bool = False) -> None:
    """Fit a budget-sized lr schedule (a LambdaLR of one :class:`BudgetFactor`; any other is
    left alone) to ``plan``, made after ``step`` steps, and record the factor's state in
    ``plan["schedule"]``; a fresh plan sets the optimizer's lr for the next step. ``resumed``: the
    factor takes the state saved in the plan, and the optimizer restored from the same checkpoint
    already holds its lr."""
    factor = scheduler.lr_lambdas[0]
    if not isinstance(factor, BudgetFactor):
        return
    if resumed:
        factor.load_state(plan["schedule"])
        return
    factor.plan(plan["steps"], step)
    plan["schedule"] = factor.state()
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs):
        group["lr"] = base * factor(scheduler.last_epoch)
