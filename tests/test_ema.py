"""The Trainer's exponential moving average of the weights (``TrainConfig.ema_decay``,
attnlab.train.ema): the averaged weights a checkpoint holds equal the average computed by hand
from the weights of every step (fp32 against float64, rtol 1e-6 of the weights' scale); the
training weights beside them are those of a run without the average, bit for bit; a run stopped
and resumed ends bit for bit where an uninterrupted one does, average included.

The task is tests/_train_worker.py's ReverseTask (a tiny Transformer, dropout on).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, load_model

from attnlab.train import TrainConfig, Trainer
from attnlab.train.ema import TRAINING_WEIGHTS_FILE, ExponentialMovingAverage

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402

DECAY, STEPS = 0.7, 5        # a fast average: every step's weights count visibly


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=out, steps=STEPS, lr=3e-3, schedule="constant", progress=False, device="cpu",
                precision="fp32", log_every=1, save_every=1, eval_every=1, keep_last=STEPS + 1, seed=3)
    return TrainConfig(**{**base, **kw})


def _weights(file: Path) -> dict[str, torch.Tensor]:
    """The named parameters of a ReverseTask model that reads ``file`` (tied tensors stored once)."""
    model = ReverseTask(n_examples=32, micro=8, dropout=0.1).model
    load_model(model, str(file), strict=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(out: Path, **kw) -> Trainer:
    task = ReverseTask(n_examples=32, micro=8, dropout=0.1)
    trainer = Trainer(task, _cfg(out, **kw))
    trainer.fit()
    return trainer


def test_averaged_weights_equal_a_hand_computed_average_and_training_is_unchanged(tmp_path):
    start = {n: p.detach().clone() for n, p in ReverseTask(n_examples=32, micro=8, dropout=0.1).model.named_parameters()}
    _train(tmp_path / "plain")
    steps = [_weights(tmp_path / "plain" / f"step-{k:07d}" / "model.safetensors") for k in range(1, STEPS + 1)]
    trainer = _train(tmp_path / "ema", ema_decay=DECAY)
    # by hand, in float64: the average starts at the initial weights and moves after every step
    want = {n: t.double() for n, t in start.items()}
    for k, w in enumerate(steps, 1):
        want = {n: DECAY * want[n] + (1 - DECAY) * w[n].double() for n in want}
        got = _weights(tmp_path / "ema" / f"step-{k:07d}" / "model.safetensors")
        for n in want:
            assert_close_scaled(got[n].double(), want[n], FP32_OP, f"the average of {n} at step {k}")
        # the weights training goes on with are the plain run's, bit for bit: the average changes nothing
        raw = _weights(tmp_path / "ema" / f"step-{k:07d}" / TRAINING_WEIGHTS_FILE)
        assert all(torch.equal(raw[n], w[n]) for n in w), f"training weights at step {k}"
    # the model in memory holds the training weights after fit, and differs from the average
    assert all(torch.equal(p, steps[-1][n]) for n, p in trainer.model.named_parameters())
    assert max((want[n].float() - steps[-1][n]).abs().max() for n in want) > 1e-3
    # evaluation saw the average: another validation loss than the plain run's at the same step
    evals = lambda d: [r["val_loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())  # noqa: E731
                       if r["kind"] == "eval"]
    assert len(evals(tmp_path / "ema")) == STEPS and evals(tmp_path / "ema") != evals(tmp_path / "plain")


def test_resume_with_an_average_is_bit_identical(tmp_path):
    _train(tmp_path / "whole", ema_decay=DECAY)
    _train(tmp_path / "cut", ema_decay=DECAY, steps=2)
    task = ReverseTask(n_examples=32, micro=8, dropout=0.1)
    resumed = Trainer(task, _cfg(tmp_path / "cut", ema_decay=DECAY), resume=True)
    assert resumed.step == 2
    resumed.fit()
    for name in ("model.safetensors", TRAINING_WEIGHTS_FILE, "optimizer.safetensors"):
        a = load_file(tmp_path / "whole" / f"step-{STEPS:07d}" / name)
        b = load_file(tmp_path / "cut" / f"step-{STEPS:07d}" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_a_run_without_the_average_resumes_from_the_training_weights(tmp_path, caplog):
    _train(tmp_path / "run", ema_decay=DECAY, steps=2)
    task = ReverseTask(n_examples=32, micro=8, dropout=0.1)
    with caplog.at_level("WARNING", logger="attnlab.train"):
        trainer = Trainer(task, _cfg(tmp_path / "run"), resume=True)
    raw = _weights(tmp_path / "run" / "step-0000002" / TRAINING_WEIGHTS_FILE)
    assert trainer.ema is None and all(torch.equal(p, raw[n]) for n, p in task.model.named_parameters())
    assert "trains on from the training weights" in caplog.text


def test_the_average_swaps_exactly_and_refuses_a_bad_decay(tmp_path):
    model = ReverseTask(n_examples=8, micro=8, dropout=0.0).model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ema = ExponentialMovingAverage(model, 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)                       # 0.5 * w + 0.5 * (w + 1) = w + 0.5
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    average = {n: t.clone() for n, t in ema.average.items()}
    ema.swap(model)
    for n, p in model.named_parameters():
        assert_close_scaled(p, before[n] + 0.5, FP32_OP, n)
        assert torch.equal(ema.average[n], trained[n])
    ema.swap(model)                         # twice: back where it started, bit for bit
    assert all(torch.equal(p, trained[n]) and torch.equal(ema.average[n], average[n])
               for n, p in model.named_parameters())
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="decay"):
            ExponentialMovingAverage(model, bad)
    with pytest.raises(ValueError, match="ema_decay"):
        _cfg(tmp_path, ema_decay=1.0)
