"""A budget-sized schedule re-planned as the speed drifts (attnlab.train.budget).

A fake clock makes every training loss and every evaluation cost a known time, which may change
during the run: a first minute at a third of the later speed, a machine that slows to half its
speed midway, evaluations that cost as much as 20 steps. In each the run ends within 5 % of its
budget with the learning rate decayed to its floor, the lr moving smoothly at every re-plan; every
plan is recorded in the checkpoints, and a run killed and resumed on the same machine ends
bit-identical to the uninterrupted one.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from attnlab.train import TrainConfig, Trainer
from attnlab.train.budget import BudgetPlanner, stops_between
from attnlab.train.schedules import BudgetFactor, CosineFactor

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

BUDGET = 300.0
LR, FLOOR = 1e-2, 0.1


class _Clock:
    """Seconds of a machine whose step time is ``cost(seconds of training so far)``."""

    def __init__(self, cost, start: float = 0.0):
        self.t, self.cost = 1000.0 + start, cost

    def __call__(self) -> float:
        return self.t


class _Crash(RuntimeError):
    pass


class _TimedTask(ReverseTask):
    """ReverseTask on the fake clock: each loss costs ``clock.cost(t)``, each evaluation ``eval_s``."""

    def __init__(self, clock: _Clock, eval_s: float = 0.0, crash_at: int | None = None):
        super().__init__(n_examples=64, micro=8, dropout=0.1)
        self.clock, self.eval_s, self.crash_at = clock, eval_s, crash_at

    def loss(self, model, batch):
        if self.crash_at is not None and self.loss_calls + 1 == self.crash_at:
            raise _Crash("killed")
        self.clock.t += self.clock.cost(self.clock.t - 1000.0)
        return super().loss(model, batch)

    def evaluate(self, model):
        self.clock.t += self.eval_s
        return super().evaluate(model)


def _cfg(out: Path) -> TrainConfig:
    return TrainConfig(out_dir=out, steps=1_000_000, lr=LR, schedule="cosine", warmup_steps=10, min_lr_ratio=FLOOR,
                       time_budget_s=BUDGET, budget_schedule=True, budget_measure=5, budget_reserve=0.1,
                       budget_evals=2, progress=False, device="cpu", precision="fp32", log_every=1)


def _train(out: Path, cost, eval_s: float = 0.0, crash_at: int | None = None, resume=False,
           start: float = 0.0) -> tuple[Trainer, float]:
    """(the trainer, the seconds its fit took on the fake clock)."""
    clock = _Clock(cost, start)
    task = _TimedTask(clock, eval_s, crash_at)
    trainer = Trainer(task, _cfg(out), resume=resume, clock=clock)
    begin = clock()
    trainer.fit()
    return trainer, clock() - begin


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _lrs(out: Path) -> list[float]:
    return [r["lr"] for r in _records(out) if r["kind"] == "train"]


def _slow_first_minute(t: float) -> float:
    return 6.0 if t < 60.0 else 2.0


def _slower_midway(t: float) -> float:
    return 2.0 if t < BUDGET / 2 else 4.0


@pytest.mark.parametrize("cost,eval_s", [(_slow_first_minute, 0.0), (_slower_midway, 0.0), (lambda t: 2.0, 40.0)],
                         ids=["slow-first-minute", "slower-midway", "costly-evaluations"])
def test_a_budget_run_ends_within_5_percent_of_its_budget(tmp_path, cost, eval_s):
    trainer, wall = _train(tmp_path / "run", cost, eval_s)
    assert 0.95 * BUDGET <= wall <= BUDGET, (wall, trainer._planner.history)
    assert len(trainer._planner.history) >= 2
    if not eval_s:                                             # the first plan alone would have missed it
        assert abs(trainer._planner.history[0][1] - trainer.step) > 0.05 * trainer.step
    lrs = _lrs(tmp_path / "run")
    assert len(lrs) == trainer.step == trainer.budget_plan["steps"]
    assert lrs[-1] == pytest.approx(LR * FLOOR)               # the decay ends with the budget
    warm = trainer.scheduler.lr_lambdas[0].warmup
    decay = lrs[warm:]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(decay, decay[1:]))   # decreasing after the warmup
    # no jump at a re-plan: the largest step-to-step change stays of the size of the cosine's own
    steepest = math.pi / 2 * (1 - FLOOR) / (trainer.step - warm) * LR
    assert max(a - b for a, b in zip(decay, decay[1:])) < 4 * steepest
    evals = [r["step"] for r in _records(tmp_path / "run") if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1] == trainer.step and trainer.step / 4 < evals[0] < trainer.step * 3 / 4


def test_each_plan_is_checkpointed_and_a_resumed_run_repeats_them(tmp_path):
    whole, _ = _train(tmp_path / "a", _slow_first_minute)
    out = tmp_path / "b"
    mid = whole._planner.history[-1][0]                        # killed after the midway evaluation's save
    with pytest.raises(_Crash):
        _train(out, _slow_first_minute, crash_at=mid + 10)
    saved = json.loads((out / f"step-{mid:07d}" / "trainer_state.json").read_text())
    assert saved["budget_plan"]["history"] == whole._planner.history
    # the same machine (its speed a function of the training time so far): the same run, bit for bit
    resumed, _ = _train(out, _slow_first_minute, resume=True, start=saved["elapsed_s"])
    assert resumed._planner.history == whole._planner.history and resumed.step == whole.step
    assert _lrs(out) == _lrs(tmp_path / "a")
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    # a machine twice as slow after the resume: the checkpoint's plans stay, the rest is planned again
    slow_out = tmp_path / "c"
    with pytest.raises(_Crash):
        _train(slow_out, _slow_first_minute, crash_at=mid + 10)
    slow, wall = _train(slow_out, lambda t: 4.0, resume=True, start=saved["elapsed_s"])
    history = slow._planner.history
    assert history[:len(saved["budget_plan"]["history"])] == saved["budget_plan"]["history"]
    assert len(history) > len(saved["budget_plan"]["history"]) and slow.step < whole.step
    assert 0.95 * BUDGET <= saved["elapsed_s"] + wall <= BUDGET
    assert _lrs(slow_out)[-1] == pytest.approx(LR * FLOOR)


def test_a_plan_refits_the_decay_from_the_current_step():
    f = BudgetFactor("cosine", warmup=10, min_lr_ratio=FLOOR)
    assert [f(k) for k in range(12)] == [(k + 1) / 10 for k in range(10)] + [1.0, 1.0]   # before a plan
    f.plan(100, at_step=6)
    cosine = CosineFactor(10, 100, FLOOR)
    assert [f(k) for k in range(100)] == [cosine(k) for k in range(100)]   # one plan: the plain schedule
    before = [f(k) for k in range(60)]
    f.plan(200, at_step=50)                                     # slower decay from step 50 on
    assert f(50) == pytest.approx(before[50], rel=0.02)         # the next step's lr moves by a fraction of a step's
    assert f(199) == pytest.approx(FLOOR) and f(300) == pytest.approx(FLOOR)
    assert f.progress(125) == pytest.approx((f.progress(50) + 1) / 2)   # linear from the knot to the new end
    g = BudgetFactor("cosine", warmup=10, min_lr_ratio=FLOOR)
    g.plan(100, at_step=6)
    g.plan(40, at_step=8)                                       # within the warmup, long enough: only the end moves
    assert [g(k) for k in range(40)] == [CosineFactor(10, 40, FLOOR)(k) for k in range(40)]
    g.load_state(json.loads(json.dumps(f.state())))             # a checkpoint's state gives the same factor
    assert [g(k) for k in range(50, 300)] == [f(k) for k in range(50, 300)]


def test_a_short_budget_shortens_the_warmup_without_a_jump():
    f = BudgetFactor("cosine", warmup=150, min_lr_ratio=0.0)
    taken = [f(k) for k in range(21)]
    f.plan(300, at_step=21)                                     # a tenth of 300 steps, not below twice the 21 taken
    assert f.warmup == 42
    ramp = [f(k) for k in range(20, 42)]              # steps 21 (taken) to 42, the new end of the warmup
    assert ramp[0] == taken[20] and ramp[-1] == pytest.approx(1.0)
    assert all(b > a for a, b in zip(ramp, ramp[1:])) and max(b - a for a, b in zip(ramp, ramp[1:])) < 2 / 21
    assert f(299) == pytest.approx(0.0, abs=1e-12)
    const = BudgetFactor("constant", warmup=4)
    const.plan(100, at_step=2)
    assert [const(k) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_the_planner_replans_only_when_the_projection_drifts():
    planner = BudgetPlanner(100.0, measure=4, reserve=0.0, evals=0, intervals=(0, 0))
    for step in range(1, 6):
        planner.observe(step, 5.0 if step == 1 else 1.0)    # the first step is not timed
    plan = planner.decide(5, 9.0)
    assert plan["steps"] == 5 + math.floor(100 * 0.99 - 9.0)   # the target: the budget less half the tolerance
    for step in range(6, 30):
        planner.observe(step, 1.01)                            # a 1 % drift: within the tolerance
        assert planner.decide(step, 9.0 + (step - 5) * 1.01) is None
    for step in range(30, 40):
        planner.observe(step, 1.5)
    plan = planner.decide(39, 9.0 + 24 * 1.01 + 10 * 1.5)
    assert plan is not None and plan["measured_s_per_step"] == pytest.approx(1.5)
    state = json.loads(json.dumps(planner.state()))
    again = BudgetPlanner(100.0, measure=4, reserve=0.0)
    again.load_state(state)
    assert again.state() == planner.state()


def test_stops_between_counts_evaluations_and_saves_once():
    assert stops_between(0, 100, 10, 25) == 12                 # 10 + 4 - 2 (every 50: both), the end included
    assert stops_between(0, 37, 18, 18) == 3                   # 18, 36 and the last step
    assert stops_between(10, 100, 0, 0) == 1
    assert stops_between(100, 100, 10, 0) == 0


def test_a_budget_checkpoint_of_the_one_plan_layout_is_refused_in_one_line(tmp_path):
    """A --time-budget checkpoint whose plan is the older single plan (steps, at_step,
    measured_s_per_step, no history) cannot be continued: one line naming it, not a KeyError."""
    out = tmp_path / "old"
    _train(out, _slow_first_minute)
    ckpt = sorted(out.glob("step-*"))[-1]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state["budget_plan"] = {"steps": 120, "at_step": 20, "measured_s_per_step": 1.5}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "manifest.json").unlink()                   # the edit is on purpose: accept it unchecked
    with pytest.raises(ValueError, match=r"step-\d+: a --time-budget run saved by an attnlab that planned its "
                                         r"schedule once, which this one cannot continue; train it again"):
        _train(out, _slow_first_minute, resume=True)
