"""Output that suits a log: with stderr not a terminal (CI, ``nohup``, a job scheduler) training
prints a plain progress line every 30 seconds, never a carriage return; ``attnlab generate``
checks its options before it echoes the prompt, so an error never lands on the prompt's line."""
from __future__ import annotations

import io
import re
import sys
import time
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.train import TrainConfig, Trainer

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

LINE = re.compile(r"train: step (\d+)/12 \(\d+ %\), loss \d+\.\d{4}, lr \S+, tok_s \d+, elapsed (\d+:\d\d)"
                  r"(, eta (\d+:\d\d))?")


class _TenSecondSteps:
    """perf_counter on which every training loss costs 10 s."""

    def __init__(self, task):
        self.task = task

    def __call__(self) -> float:
        return 500.0 + 10.0 * self.task.loss_calls


def test_training_into_a_log_prints_plain_lines_every_30_seconds(tmp_path, capsys, monkeypatch):
    task = ReverseTask(n_examples=32, micro=8, dropout=0.0)
    monkeypatch.setattr(time, "perf_counter", _TenSecondSteps(task))
    cfg = TrainConfig(out_dir=tmp_path / "run", steps=12, lr=1e-3, progress=True, device="cpu", precision="fp32",
                      log_every=1)
    Trainer(task, cfg).fit()
    err = capsys.readouterr().err                  # pytest's capture: stderr is not a terminal
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("train:")]
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), lines
    assert [int(m.group(1)) for m in matches] == [3, 6, 9, 12]       # every 30 s of 10 s steps
    assert [m.group(2) for m in matches] == ["0:30", "1:00", "1:30", "2:00"]
    assert matches[0].group(4) == "1:30" and matches[-1].group(3) is None   # eta: 9 steps of 10 s; none at the end


def test_log_progress_writes_a_last_line_and_nothing_twice():
    from attnlab.train.progress import LogProgress, progress_bar
    now = [0.0]
    out = io.StringIO()
    bar = LogProgress(100, initial=40, desc="perplexity", unit="tok", every_s=30.0, clock=lambda: now[0], stream=out)
    for _ in range(5):
        now[0] += 20.0
        bar.update(10)
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == [
        "perplexity: tok 60/100 (60 %), elapsed 0:40, eta 1:20",       # resumed at 40: 20 done in 40 s
        "perplexity: tok 80/100 (80 %), elapsed 1:20, eta 0:40",
        "perplexity: tok 90/100 (90 %), elapsed 1:40, eta 0:20"]                # close: the last one, once

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert not isinstance(progress_bar(10, desc="x", stream=Terminal()), LogProgress)
    assert isinstance(progress_bar(10, desc="x", stream=io.StringIO()), LogProgress)


# ----------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lm")
    (d / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["train", "lm", "--data", str(d / "text.txt"), "--out", str(d / "run"), "--steps", "1",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
                 "--sample-tokens", "0", "--no-progress"]) == 0
    return d / "run"


@pytest.mark.parametrize("option,message", [
    (["--temperature", "-1"], "--temperature: must be a number >= 0, got -1.0"),
    (["--top-p", "0"], "--top-p: must be in (0, 1], got 0.0"),
    (["--top-k", "0"], "--top-k: must be at least 1, got 0"),
    (["--repetition-penalty", "0"], "--repetition-penalty: must be a number > 0, got 0.0"),
    (["--prompt", "the quick brown fox jumps"], "the prompt is 25 tokens long, but the model's context is 16"),
], ids=["temperature", "top-p", "top-k", "repetition-penalty", "prompt-too-long"])
def test_a_generation_option_error_comes_before_any_echo(lm_run, capsys, option, message):
    args = ["generate", str(lm_run), "--prompt", "the", "--max-new-tokens", "4"] + option
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == ""                                         # nothing echoed: the error has its own line
    assert err.count("\n") == 1 and message in err, err
