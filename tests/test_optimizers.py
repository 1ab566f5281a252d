"""The optimizer choice: AdamW (the default) or Adafactor (T5's), through TrainConfig, the Trainer
(exact resume, a changed optimizer refused) and `attnlab train` (T5's family default, the flag)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from torch import nn

from attnlab.train import TrainConfig, Trainer, build_optimizer

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _cfg(out: Path, **kw) -> TrainConfig:
    base = dict(out_dir=out, steps=4, lr=0.05, schedule="constant", progress=False, device="cpu", precision="fp32",
                log_every=1, optimizer="adafactor")
    return TrainConfig(**{**base, **kw})


def test_adafactor_steps_follow_each_weights_scale(tmp_path):
    """The reason T5 trains with it: a weight of scale 1 (T5's embedding) and one of scale 0.01 with
    the same gradient move by amounts in the ratio of their scales; AdamW moves both alike."""
    torch.manual_seed(0)
    big, small = nn.Parameter(torch.randn(64, 32)), nn.Parameter(torch.randn(64, 32) * 0.01)
    model = nn.ParameterList([big, small])
    for name, ratio in (("adafactor", (90, 110)), ("adamw", (0.9, 1.1))):
        opt = build_optimizer(model, _cfg(tmp_path, optimizer=name, weight_decay=0.0))
        assert isinstance(opt, torch.optim.Adafactor if name == "adafactor" else torch.optim.AdamW)
        before = [p.detach().clone() for p in (big, small)]
        g = torch.randn(64, 32)
        big.grad, small.grad = g.clone(), g.clone()
        opt.step()
        moved = [float((p.detach() - b).norm()) for p, b in zip((big, small), before)]
        assert ratio[0] < moved[0] / moved[1] < ratio[1], (name, moved)


def test_config_refuses_an_unknown_optimizer(tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of adamw, adafactor"):
        _cfg(tmp_path, optimizer="sgd")


def test_adafactor_resumes_bit_identically_and_a_changed_optimizer_is_refused(tmp_path):
    torch.set_num_threads(1)
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "full", steps=6, save_every=3)).fit()
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=3, save_every=3)).fit()
    Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=6, save_every=3), resume=True).fit()
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = (load_file(tmp_path / d / "step-0000006" / name) for d in ("full", "part"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    with pytest.raises(ValueError, match="adafactor optimizer, this run asks for adamw"):
        Trainer(ReverseTask(16, 4), _cfg(tmp_path / "part", steps=9, optimizer="adamw"), resume=True)


def _train(*args: str) -> subprocess.CompletedProcess:
    import os
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    return subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "translate", *args, "--no-progress",
                           "--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32", "--eval-size", "4",
                           "--corpus-size", "200"], capture_output=True, text=True, env=env, timeout=300)


def test_t5_trains_with_adafactor_by_default_and_the_flag_wins(tmp_path):
    r = _train("--model", "t5", "--steps", "2", "--out", str(tmp_path / "t5"))
    assert r.returncode == 0, r.stderr
    assert "training: Adafactor (lr relative to each weight's RMS), cosine schedule, lr 0.05," in r.stderr
    # another optimizer: the task's own defaults for it, not T5's Adafactor lr and decay
    r = _train("--model", "t5", "--steps", "2", "--optimizer", "adamw", "--out", str(tmp_path / "a"))
    assert r.returncode == 0 and "training: cosine schedule, lr 0.002" in r.stderr, r.stderr
    assert yaml.safe_load((tmp_path / "a" / "config.yaml").read_text())["settings"]["weight_decay"] == 0.01
    r = _train("--steps", "2", "--out", str(tmp_path / "tr"))            # the chapter's Transformer: AdamW
    assert r.returncode == 0 and "Adafactor" not in r.stderr and "training: cosine" in r.stderr, r.stderr
    # asked for on a task sized for AdamW: said, and the task's AdamW lr 2e-3 made relative (x 15)
    r = _train("--steps", "1", "--optimizer", "adafactor", "--out", str(tmp_path / "tr-ada"))
    assert r.returncode == 0 and "training: Adafactor (lr relative to each weight's RMS), cosine schedule, lr 0.03," \
        in r.stderr, r.stderr
    saved = {run: yaml.safe_load((tmp_path / run / "config.yaml").read_text())["settings"] for run in ("t5", "tr")}
    assert (saved["t5"]["optimizer"], saved["t5"]["weight_decay"]) == ("adafactor", 0.0)      # as T5 was trained
    assert (saved["tr"]["optimizer"], saved["tr"]["weight_decay"]) == ("adamw", 0.01)
    # the resolved choice is saved with the run: resuming keeps it, another one is refused by name
    r = _train("--model", "t5", "--steps", "3", "--out", str(tmp_path / "t5"), "--resume")
    assert r.returncode == 0 and "Adafactor" in r.stderr, r.stderr
    r = _train("--model", "t5", "--steps", "4", "--out", str(tmp_path / "t5"), "--resume", "--optimizer", "adamw")
    assert r.returncode == 2 and "--optimizer adamw differs from the run's adafactor" in r.stderr, r.stderr


def test_adafactor_on_a_task_sized_for_adamw_takes_a_relative_lr():
    from attnlab.tasks.base import ADAFACTOR_LR_SCALE, training_schedule
    s = dict(time_budget=None, steps=10, warmup=None, eval_every=None, save_every=None, lr=None, optimizer=None)
    d = dict(lr=2e-3, steps=10)

    def lr(**given):
        return training_schedule({**s, **given}, d, lambda n, b: 1, lambda n, b: 5, 0)["lr"]
    assert lr() == 2e-3 and lr(optimizer="adamw") == 2e-3                   # AdamW: the task's lr
    assert lr(optimizer="adafactor") == pytest.approx(2e-3 * ADAFACTOR_LR_SCALE)
    assert lr(optimizer="adafactor", lr=1e-2) == 1e-2                       # --lr wins
    d = dict(lr=5e-2, steps=10, optimizer="adafactor")                      # a family's own Adafactor recipe
    assert lr() == 5e-2 and lr(optimizer="adafactor") == 5e-2
