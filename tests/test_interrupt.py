"""SIGINT and SIGTERM during training end in a checkpoint at the next optimizer-step boundary,
say where it is, exit 130 / 143, and a later resume ends bit-identical to an uninterrupted run
(CPU), with metrics.jsonl kept."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).parent / "_train_worker.py"
REPO = Path(__file__).resolve().parents[1]
ARGS = ["--steps", "10", "--save-every", "3", "--accum", "2", "--micro", "4", "--n-examples", "36",
        "--eval-every", "5", "--dropout", "0.1"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))


def _worker(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(WORKER), "--out", str(out), *args]


def _curve(d: Path) -> list:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, (d / "metrics.jsonl").read_text()
                                                                        .splitlines())]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_mid_step_saves_that_step_and_resume_is_exact(tmp_path, signum):
    """The signal arrives inside step 8 (loss call 15; the last periodic checkpoint is step 6):
    step 8 completes, is saved, the process exits 128 + signal; resuming ends equal to the reference."""
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref = subprocess.Popen(_worker(ref_dir, *ARGS), env=_env(), stderr=subprocess.PIPE)
    victim = subprocess.Popen(_worker(run_dir, *ARGS, "--wait-for-signal-at-loss-call", "15"), env=_env(),
                              stderr=subprocess.PIPE, text=True)
    marker = tmp_path / "run.hanging"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert victim.poll() is None, victim.stderr.read()
        assert time.monotonic() < deadline, "worker never reached the signal point"
        time.sleep(0.02)
    victim.send_signal(signum)
    _, err = victim.communicate(timeout=120)
    assert victim.returncode == 128 + signum, err
    assert (run_dir / "latest").read_text().strip() == "step-0000008"
    assert f"checkpoint saved in {run_dir / 'step-0000008'}" in err, err
    assert signal.Signals(signum).name in err
    assert [r[0] for r in _curve(run_dir)][-1] == 8
    resumed = subprocess.run(_worker(run_dir, *ARGS, "--resume"), env=_env(), capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert ref.wait(timeout=300) == 0
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(ref_dir / "step-0000010" / name), load_file(run_dir / "step-0000010" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert _curve(ref_dir) == _curve(run_dir)          # metrics.jsonl kept, not emptied, nothing twice


def test_attnlab_train_on_sigint_saves_says_how_to_resume_and_exits_130(tmp_path, monkeypatch, capsys):
    """The command: a real SIGINT to this process during step 2; then --resume finishes the run
    with metrics.jsonl continued."""
    from attnlab.cli import main
    from _signals import sigint_during_step
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    args = ["train", "lm", "--data", str(tmp_path / "text.txt"), "--out", str(tmp_path / "run"), "--steps", "4",
            "--eval-every", "10", "--save-every", "10", "--d-model", "16", "--heads", "2", "--layers", "1",
            "--context", "16", "--batch-size", "4", "--sample-tokens", "0", "--no-progress"]
    sigint_during_step(monkeypatch, 2)
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "SIGINT: stopped after step 2; checkpoint saved in" in err and "--resume" in err
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-0000002"
    monkeypatch.undo()
    assert main(args + ["--resume"]) == 0
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]
    assert steps == [2, 4]                          # the record of step 2 kept, nothing twice
