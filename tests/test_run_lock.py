"""One training per run directory: a second `attnlab train` into a busy directory is refused with
one line naming the holder, and a killed holder leaves no lock behind.

The source under test is the one this process imports (attnlab's own, or an older checkout on
PYTHONPATH), and the subprocesses are given the same."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import attnlab
from attnlab.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

SRC = Path(attnlab.__file__).resolve().parents[1]
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
TINY_LM = ["--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
           "--sample-tokens", "0", "--no-progress"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(SRC))


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the first run ended early: {proc.stderr.read()}")
        assert time.monotonic() < deadline, f"the first run did not start within {seconds} s"
        time.sleep(0.2)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)


def test_a_second_run_into_a_busy_directory_is_refused_naming_the_holder(tmp_path, capsys):
    (tmp_path / "text.txt").write_text(TEXT)
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "attnlab.cli", "train", "lm", "--data", str(tmp_path / "text.txt"),
                              "--out", str(run), "--steps", "1000000", "--eval-every", "0", *TINY_LM],
                             env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        _wait_for(run / "metrics.jsonl", first)               # the Trainer of the first run is set up
        code = main(["train", "lm", "--data", str(tmp_path / "text.txt"), "--out", str(run), "--steps", "2",
                     *TINY_LM])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if ": error: " in line]
        assert code == 2 and len(lines) == 1, err
        assert f"{run}: another run is training into it (pid {first.pid} on {socket.gethostname()}, started " in lines[0]
        assert f"attnlab train lm --data {tmp_path / 'text.txt'} --out {run} --steps 1000000" in lines[0]
        assert first.poll() is None                         # the first run goes on, undisturbed
    finally:
        _kill(first)
    # SIGKILL leaves the lock file but no lock: the next run trains at once
    assert main(["train", "lm", "--data", str(tmp_path / "text.txt"), "--out", str(run), "--steps", "2",
                 *TINY_LM]) == 0


HOLD = ("import sys, time\nfrom attnlab.train.lock import lock_run\nheld = lock_run(sys.argv[1])\n"
        "print('held', flush=True)\ntime.sleep(600)\n")


def test_the_lock_belongs_to_the_holding_process_and_goes_with_it(tmp_path):
    from attnlab.train import TrainConfig, Trainer
    from attnlab.train.lock import LOCK_FILE, RunDirectoryBusy, lock_run
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryBusy, match=rf"another run is training into it \(pid {holder.pid} on "):
            lock_run(run)
        cfg = TrainConfig(out_dir=run, steps=1, progress=False, device="cpu", precision="fp32")
        with pytest.raises(RunDirectoryBusy):
            Trainer(ReverseTask(n_examples=16, micro=8), cfg)
        assert not (run / "metrics.jsonl").exists()         # refused before writing anything
    finally:
        _kill(holder)
    assert (run / LOCK_FILE).is_file()                      # the file stays; the lock died with its process
    cfg = TrainConfig(out_dir=run, steps=1, progress=False, device="cpu", precision="fp32")
    trainer = Trainer(ReverseTask(n_examples=16, micro=8), cfg)
    again = Trainer(ReverseTask(n_examples=16, micro=8), cfg)   # the same process: re-entrant
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(run)], env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and "RunDirectoryBusy" in probe.stderr and str(os.getpid()) in probe.stderr
    trainer.fit()
    trainer.close()
    again.close()                                           # the last holder in this process lets go
    probe = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""), str(run)], env=_env(),
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0 and probe.stdout.strip() == "held", probe.stderr
