"""Defaults sized to the data and the time budget.

- ``--time-budget`` without ``--steps``: the schedule's length is the number of steps the measured
  speed predicts fit in the budget, planned again when the prediction drifts, so the learning rate
  has decayed when the budget ends (a fake clock makes every step cost a known time; the drifts
  themselves are tests/test_budget.py's); the plans are kept in the checkpoints and a resumed run
  repeats them exactly.
- A file's model, vocabulary and batch follow its size; explicit settings always win, 0
  included; the chosen values are printed and saved in the run's config.yaml.
- The embedded corpora keep the main job's settings.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from attnlab.cli import main
from attnlab.tasks import get_task
from attnlab.train import TrainConfig, Trainer
from attnlab.train.budget import steps_for_budget
from attnlab.train.schedules import CosineFactor

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402


# ----------------------------------------------------------------------------- the schedule
def test_steps_for_budget_fills_the_budget_less_the_reserve():
    assert steps_for_budget(step=10, elapsed_s=10.0, seconds_per_step=1.0, budget_s=100.0) == 100
    assert steps_for_budget(step=10, elapsed_s=10.0, seconds_per_step=2.0, budget_s=100.0, reserve=0.1) == 50
    assert steps_for_budget(step=10, elapsed_s=200.0, seconds_per_step=1.0, budget_s=100.0) == 10  # already over
    with pytest.raises(ValueError):
        steps_for_budget(1, 1.0, 0.0, 100.0)


class _Clock:
    """perf_counter for the Trainer: every training loss computed costs ``step_s`` seconds."""

    def __init__(self, task, step_s: float):
        self.task, self.step_s = task, step_s

    def __call__(self) -> float:
        return 1000.0 + self.task.loss_calls * self.step_s


class _Crash(RuntimeError):
    pass


class _CrashingTask(ReverseTask):
    def __init__(self, crash_at: int, **kw):
        super().__init__(**kw)
        self.crash_at = crash_at

    def loss(self, model, batch):
        if self.loss_calls + 1 == self.crash_at:
            raise _Crash("killed")
        return super().loss(model, batch)


def _budget_cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=out, steps=1_000_000, lr=1e-2, schedule="cosine", warmup_steps=3, min_lr_ratio=0.1,
                time_budget_s=40.0, budget_schedule=True, budget_measure=5, budget_reserve=0.1, budget_evals=2,
                progress=False, device="cpu", precision="fp32", log_every=1)
    return TrainConfig(**{**base, **kw})


def _train(task, cfg, step_s: float, resume=False) -> Trainer:
    trainer = Trainer(task, cfg, resume=resume, clock=_Clock(task, step_s))
    trainer.fit()
    return trainer


def _lrs(out: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in records if r["kind"] == "train"}


def test_the_budget_schedule_ends_when_the_budget_does(tmp_path):
    out = tmp_path / "run"
    task = ReverseTask(n_examples=64, micro=8, dropout=0.0)
    trainer = _train(task, _budget_cfg(out), step_s=1.0)
    # 1 s per step: after step 6 (5 steps timed after the first) the target, 40 s less 1 %, less a
    # 10 % reserve for the evaluations, leaves 29 more steps; the evaluation halfway, at step 18,
    # is timed (free on this clock) and the plan grows to the whole 39.6 s
    assert trainer._planner.history == [[6, 35, 1.0], [18, 39, 1.0]]
    assert trainer.step == 39 and trainer.budget_plan["steps"] == 39 and trainer.budget_plan["eval_at"] == []
    lrs = _lrs(out)
    assert lrs[39] == pytest.approx(1e-2 * 0.1)                    # decayed to the floor at the last step
    assert lrs[2] == pytest.approx(1e-2 * 2 / 3) and lrs[3] == pytest.approx(1e-2)
    assert all(lrs[s] == pytest.approx(1e-2 * CosineFactor(6, 35, 0.1)(s - 1)) for s in range(7, 19))
    state = json.loads((out / "step-0000039" / "trainer_state.json").read_text())
    assert state["budget_plan"]["plan"]["steps"] == 39 and state["budget_plan"]["history"] == trainer._planner.history
    evals = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["kind"] == "eval"] == [18, 39]
    # a slower machine plans fewer steps, and still ends with a decayed rate
    slow = ReverseTask(n_examples=64, micro=8, dropout=0.0)
    trainer = _train(slow, _budget_cfg(tmp_path / "slow"), step_s=3.0)
    assert trainer.step == 13 and _lrs(tmp_path / "slow")[13] == pytest.approx(1e-3)   # 7 + (39.6 - 21) / 3


def test_a_resumed_budget_run_keeps_its_schedule_exactly(tmp_path):
    whole = _train(ReverseTask(n_examples=64, micro=8, dropout=0.1), _budget_cfg(tmp_path / "a"), 1.0)
    out = tmp_path / "b"
    with pytest.raises(_Crash):                                    # killed at step 25, after the save at 18
        _train(_CrashingTask(25, n_examples=64, micro=8, dropout=0.1), _budget_cfg(out), 1.0)
    # the checkpoint holds the plans and the timings they came from: on the same machine the resumed
    # session plans as the uninterrupted one did (a slower one: tests/test_budget.py)
    resumed = _train(ReverseTask(n_examples=64, micro=8, dropout=0.1), _budget_cfg(out), 1.0,
                     resume=True)
    assert resumed.step == whole.step == 39 and resumed.budget_plan == whole.budget_plan
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
    assert _lrs(out) == _lrs(tmp_path / "a")


def test_explicit_steps_turn_the_budget_schedule_off(tmp_path, monkeypatch):
    task = get_task("translate")
    s = task.settings(data="x.tsv", time_budget=30.0, steps=300)
    t = task._schedule(s, task._sizes(s, 29_000))
    assert (t["steps"], t["budget_schedule"], t["warmup_steps"]) == (300, False, 30)
    t = task._schedule(task.settings(data="x.tsv", time_budget=30.0), task._sizes(s, 29_000))
    assert t["budget_schedule"] and t["warmup_steps"] == 150 and t["budget_evals"] == 2


# ----------------------------------------------------------------------------- sizes
@pytest.mark.parametrize("pairs,expected", [
    (2_000, dict(vocab_size=4000, d_model=128, layers=2, d_ff=512, max_tokens=1024)),
    (29_000, dict(vocab_size=8000, d_model=256, heads=4, layers=3, d_ff=1024, dropout=0.1, max_tokens=2048,
                  pre_norm=True, tokenizer="bpe")),           # the Multi30k recipe's sizes
    (500_000, dict(vocab_size=16000, d_model=512, heads=8, layers=6, d_ff=2048, max_tokens=4096)),
    (5_000_000, dict(vocab_size=32000, d_model=512, max_tokens=8192)),
])
def test_translation_defaults_follow_the_corpus_size(pairs, expected):
    task = get_task("translate")
    d = task._sizes(task.settings(data="x.tsv"), pairs)
    assert {k: d[k] for k in expected} == expected
    assert d["pre_norm"] is True


@pytest.mark.parametrize("tokens,expected", [
    (50_000, dict(d_model=128, layers=4, context=128, batch_size=16)),
    (1_000_000, dict(d_model=384, heads=6, layers=6, context=256, batch_size=32)),   # nanoGPT's Shakespeare
    (10_000_000, dict(d_model=512, heads=8, layers=8, context=512)),
    (100_000_000, dict(d_model=768, heads=12, layers=12, context=1024)),
])
def test_lm_defaults_follow_the_corpus_size(tokens, expected):
    task = get_task("lm")
    d = task._sizes(task.settings(data="x.txt"), tokens)
    assert {k: d[k] for k in expected} == expected


def test_the_embedded_main_jobs_keep_their_settings():
    tr = get_task("translate")
    s = tr.settings()
    d = tr._sizes(s, 20_000)
    assert {k: d[k] for k in ("d_model", "heads", "layers", "d_ff", "dropout", "max_tokens", "tokenizer",
                              "pre_norm")} == dict(d_model=128, heads=4, layers=2, d_ff=256, dropout=0.1,
                                                   max_tokens=2048, tokenizer="word", pre_norm=False)
    t = tr._schedule(s, d)
    assert (t["steps"], t["lr"], t["warmup_steps"], t["eval_every"], t["budget_schedule"]) == (400, 2e-3, 40, 100,
                                                                                               False)
    lm = get_task("lm")
    s = lm.settings()
    d = lm._sizes(s, 500_000)
    assert {k: d[k] for k in ("d_model", "heads", "layers", "context", "batch_size", "dropout")} == \
        dict(d_model=128, heads=4, layers=4, context=128, batch_size=16, dropout=0.0)
    t = lm._schedule(s, d)
    assert (t["steps"], t["lr"], t["warmup_steps"], t["eval_every"]) == (2000, 1e-3, 80, 200)


def test_explicit_values_always_win_zero_included():
    task = get_task("translate")
    s = task.settings(data="x.tsv", time_budget=5.0, d_model=64, dropout=0.0, pre_norm=False, warmup=0,
                      eval_every=0, vocab_size=500, max_tokens=300, lr=3e-4)
    d = task._sizes(s, 29_000)
    assert (d["d_model"], d["d_ff"], d["dropout"], d["pre_norm"], d["vocab_size"], d["max_tokens"]) == \
        (64, 256, 0.0, False, 500, 300)                       # d_ff follows a given width
    t = task._schedule(s, d)
    assert (t["warmup_steps"], t["eval_every"], t["budget_evals"], t["lr"]) == (0, 0, 0, 3e-4)
    assert task._sizes(task.settings(data="x.tsv", tokenizer="word"), 29_000)["vocab_size"] is None
    lm = get_task("lm")
    s = lm.settings(data="x.txt", context=64, batch_size=2, layers=1, dropout=0.3)
    d = lm._sizes(s, 10_000_000)
    assert (d["context"], d["batch_size"], d["layers"], d["dropout"], d["d_model"]) == (64, 2, 1, 0.3, 512)


# ----------------------------------------------------------------------------- printed and saved
def _pairs_file(tmp_path: Path, n: int = 48) -> Path:
    words = ["one", "two", "three", "four", "cat", "dog", "red", "blue"]
    lines = [f"{words[i % 8]} {words[(i // 8) % 8]}\t{words[(i // 8) % 8]} {words[i % 8]}" for i in range(n)]
    path = tmp_path / "pairs.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_translate_prints_and_saves_the_chosen_values(tmp_path, capsys):
    data, out = _pairs_file(tmp_path), tmp_path / "run"
    assert main(["train", "translate", "--data", str(data), "--valid", str(data), "--out", str(out), "--steps", "2",
                 "--vocab-size", "40", "--eval-size", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "model (for 48 pairs): bpe vocabulary" in err and "d_model 128, 4 heads, 2+2 Pre-Norm layers" in err
    assert "batches: at most 1,024 padded tokens" in err
    assert "training: cosine schedule, lr 0.001, warmup 1 steps, 2 steps" in err
    saved = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert {k: saved[k] for k in ("d_model", "heads", "layers", "d_ff", "dropout", "pre_norm", "max_tokens",
                                  "tokenizer", "vocab_size", "lr", "steps", "warmup")} == dict(
        d_model=128, heads=4, layers=2, d_ff=512, dropout=0.1, pre_norm=True, max_tokens=1024, tokenizer="bpe",
        vocab_size=40, lr=1e-3, steps=2, warmup=1)


def test_a_budget_run_prints_its_plan_and_saves_its_sizes(tmp_path, capsys):
    data, out = _pairs_file(tmp_path), tmp_path / "run"
    assert main(["train", "translate", "--data", str(data), "--valid", str(data), "--out", str(out),
                 "--time-budget", "0.02", "--d-model", "16", "--heads", "2", "--layers", "1", "--tokenizer", "word",
                 "--eval-size", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert ("as many steps as fit in the 0.02-minute budget at the speed of the last 20 (planned again whenever "
            "it drifts), 2 evaluations") in err
    saved = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert saved["steps"] is None and saved["d_ff"] == 64 and saved["pre_norm"] is True   # planned in training
    assert saved["max_tokens"] == 1024 and saved["tokenizer"] == "word"


def test_lm_prints_and_saves_the_chosen_values(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text), "--out", str(out), "--steps", "1", "--d-model", "32",
                 "--layers", "1", "--heads", "2", "--context", "32", "--sample-tokens", "0", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "model (for " in err and "d_model 32, 2 heads, 1 layers, context 32" in err
    assert "batches: 16 windows of 32 tokens" in err
    saved = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert (saved["batch_size"], saved["context"], saved["tokenizer"], saved["steps"], saved["lr"]) == \
        (16, 32, "char", 1, 1e-3)
