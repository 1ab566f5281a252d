"""A kill at any instant of a checkpoint save leaves one loadable copy (best and latest).

The kill is an exception raised from the k-th file operation of a save (every os/shutil call
that changes the run directory, and the weight and JSON writes), for every k from the first
operation to the last. After each kill every loader must find a complete checkpoint, and a
restart (a new CheckpointManager, as the Trainer makes) must clean up without losing it.
"""
from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import attnlab.train.checkpoint as ckpt_mod
from attnlab.tasks.run import find_checkpoint, open_run
from attnlab.train import CheckpointManager, TrainConfig, Trainer, load_checkpoint
from attnlab.train.checkpoint import resolve_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from _train_worker import ReverseTask  # noqa: E402

_OS_OPS = ("rename", "replace", "symlink", "unlink", "remove", "link", "mkdir", "rmdir", "chmod")
_SHUTIL_OPS = ("rmtree", "copytree", "copy2")
_MODULE_OPS = ("save_model", "save_file", "open")


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs (BaseException: no `except Exception` catches it)."""


class FileOps:
    """Counts the file operations of a block, and raises Killed at operation ``kill_at``."""

    def __init__(self, monkeypatch, kill_at: int | None = None):
        self.count, self.kill_at, self.names = 0, kill_at, []
        for mod, names in ((os, _OS_OPS), (shutil, _SHUTIL_OPS), (ckpt_mod, _MODULE_OPS)):
            for name in names:
                original = builtins.open if mod is ckpt_mod and name == "open" else getattr(mod, name)
                monkeypatch.setattr(mod, name, self._wrap(name, original), raising=False)

    def _wrap(self, name, original):
        def op(*args, **kwargs):
            self.count += 1
            self.names.append(name)
            if self.count == self.kill_at:
                raise Killed(f"killed before {name} #{self.count}")
            return original(*args, **kwargs)
        return op


def _model_and_optimizer(seed: int):
    task = ReverseTask(n_examples=16, micro=8, dropout=0.0, model_seed=seed)
    opt = torch.optim.AdamW(task.model.parameters(), lr=1e-3)
    task.model(*task.data[:2]).sum().backward()
    opt.step()
    return task.model, opt


def _run_json(directory: Path) -> None:
    meta = {"format": 2, "task": "translate", "model_type": "transformer", "architecture": "Transformer",
            "config": {}, "tokenizers": {}, "task_options": {}}
    (directory / "run.json").write_text(json.dumps(meta))


def _check_loadable(run: Path, steps_latest: set[int], steps_best: set[int]) -> None:
    """Every loader finds a complete checkpoint of one of the allowed steps."""
    fresh, fresh_opt = _model_and_optimizer(99)
    latest = resolve_checkpoint(run)                                   # Trainer resume, attnlab train --resume
    assert latest is not None and load_checkpoint(latest, fresh, fresh_opt)["step"] in steps_latest
    best = find_checkpoint(run)                                        # translate / generate / eval
    assert best is not None and best.name.startswith("best")
    assert load_checkpoint(best, fresh)["step"] in steps_best
    assert open_run(run).path == best


def _base(tmp: Path, legacy: bool) -> Path:
    """A run with best = step 1 and latest = step 2 (best/ a real directory for an older attnlab's run)."""
    run = tmp / "base"
    manager = CheckpointManager(run, keep_last=2)
    for step in (1, 2):
        model, opt = _model_and_optimizer(step)
        manager.save(step, model, opt, {"step": step}, _run_json, is_best=step == 1)
    if legacy:
        target = os.readlink(run / "best")
        (run / "best").unlink()
        shutil.copytree(run / target, run / "best")
        shutil.rmtree(run / target)
    return run


def _no_symlinks(*args, **kwargs):
    raise OSError(errno.EPERM, "Operation not permitted (a file system without symbolic links)")


@pytest.mark.parametrize("legacy,symlinks", [(False, True), (True, True), (False, False)],
                         ids=["best-link", "older-best-directory", "best-pointer-file"])
def test_a_kill_between_any_two_file_operations_of_a_save_loses_nothing(tmp_path, monkeypatch, legacy, symlinks):
    if not symlinks:
        monkeypatch.setattr(os, "symlink", _no_symlinks)
    base = _base(tmp_path, legacy)
    model, opt = _model_and_optimizer(3)
    probe = shutil.copytree(base, tmp_path / "probe", symlinks=True)
    manager = CheckpointManager(probe, keep_last=2)
    with monkeypatch.context() as m:
        ops = FileOps(m)
        manager.save(3, model, opt, {"step": 3}, _run_json, is_best=True)
    total = ops.count
    assert total > 20 and {"rename", "replace", "symlink", "rmtree"} <= set(ops.names), ops.names
    assert (probe / "best").is_symlink() == symlinks
    _check_loadable(probe, {3}, {3})
    for k in range(1, total + 1):
        run = shutil.copytree(base, tmp_path / f"kill-{k}", symlinks=True)
        manager = CheckpointManager(run, keep_last=2)
        with monkeypatch.context() as m:
            FileOps(m, kill_at=k)
            with pytest.raises(Killed):
                manager.save(3, model, opt, {"step": 3}, _run_json, is_best=True)
        _check_loadable(run, {2, 3}, {1, 3})
        CheckpointManager(run, keep_last=2)                            # the restart cleans up ...
        _check_loadable(run, {2, 3}, {1, 3})                           # ... without losing anything
        leftovers = [p.name for p in run.iterdir() if p.name.startswith(".")]
        assert not leftovers, (k, leftovers)
        older = (run / "best").is_dir() and not (run / "best").is_symlink()
        copies = 0 if older else 1                                     # an older best/ directory: none yet
        assert len(list(run.glob("best-*"))) == copies, (k, sorted(p.name for p in run.iterdir()))
        shutil.rmtree(run)


def test_a_kill_mid_save_then_trainer_resume_continues(tmp_path, monkeypatch):
    """The Trainer's own save, killed at every operation of its final checkpoint, resumes from a
    complete one and finishes."""
    cfg = dict(out_dir=tmp_path / "run", lr=1e-3, schedule="constant", progress=False, device="cpu",
               precision="fp32", log_every=1, eval_every=1, save_every=1)
    Trainer(ReverseTask(n_examples=16, micro=8, dropout=0.0), TrainConfig(steps=1, **cfg)).fit()
    base = shutil.copytree(tmp_path / "run", tmp_path / "base", symlinks=True)
    for k in range(1, 40, 3):
        shutil.rmtree(tmp_path / "run")
        shutil.copytree(base, tmp_path / "run", symlinks=True)
        trainer = Trainer(ReverseTask(n_examples=16, micro=8, dropout=0.0), TrainConfig(steps=2, **cfg), resume=True)
        with monkeypatch.context() as m:
            FileOps(m, kill_at=k)
            try:
                trainer.fit()
            except Killed:
                pass
        again = Trainer(ReverseTask(n_examples=16, micro=8, dropout=0.0), TrainConfig(steps=2, **cfg), resume=True)
        assert again.step in (1, 2)
        assert again.fit()["step"] == 2
        assert load_checkpoint(tmp_path / "run" / "best", _model_and_optimizer(0)[0])["step"] in (1, 2)


def test_weights_and_json_get_the_same_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        model, opt = _model_and_optimizer(0)
        CheckpointManager(tmp_path / "run").save(1, model, opt, {"step": 1}, _run_json, is_best=True)
    finally:
        os.umask(old)
    ckpt = tmp_path / "run" / "step-0000001"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir()}
    assert modes["model.safetensors"] == modes["optimizer.safetensors"] == modes["trainer_state.json"] == 0o644, modes
    assert stat.S_IMODE((tmp_path / "run" / "best" / "model.safetensors").stat().st_mode) == 0o644
    from attnlab.hub import save_pretrained
    from attnlab.models import GPT, GPTConfig
    old = os.umask(0o022)
    try:
        hf = save_pretrained(GPT(GPTConfig(vocab_size=20, n_positions=8, d_model=8, num_heads=2, num_layers=1)),
                             tmp_path / "hf")
    finally:
        os.umask(old)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in hf.iterdir()} == {"model.safetensors": 0o644,
                                                                              "config.json": 0o644}


def test_an_empty_or_dangling_latest_is_one_line_naming_it(tmp_path):
    model, opt = _model_and_optimizer(0)
    CheckpointManager(tmp_path).save(1, model, opt, {"step": 1})
    (tmp_path / "latest").write_text("\n")
    with pytest.raises(FileNotFoundError, match=r"latest: empty"):
        resolve_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step-0000009\n")
    with pytest.raises(FileNotFoundError, match=r"latest names step-0000009, which is not a complete checkpoint"):
        resolve_checkpoint(tmp_path)


def test_a_truncated_safetensors_file_is_one_line_naming_it(tmp_path):
    model, opt = _model_and_optimizer(0)
    path = CheckpointManager(tmp_path).save(1, model, opt, {"step": 1})
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    damaged = r"model.safetensors: truncated or damaged since it was written \(100 bytes, \d+ then\)"
    with pytest.raises(ValueError, match=damaged) as e:
        load_checkpoint(tmp_path, _model_and_optimizer(1)[0])
    assert "\n" not in str(e.value)
    (path / "manifest.json").unlink()                 # as an older attnlab wrote it: safetensors finds it out
    with pytest.raises(ValueError, match="model.safetensors: cannot be loaded") as e:
        load_checkpoint(tmp_path, _model_and_optimizer(1)[0])
    assert "\n" not in str(e.value)


def _disk_full_after(monkeypatch, name: str, calls: int) -> None:
    """Make the ``calls``-th call of checkpoint.py's ``name`` (the optimizer's safetensors writer, or
    ``open``) run out of space, as the real ones do: safetensors raises its own error naming the OS
    error in its text, a JSON write an OSError without a file name."""
    original = builtins.open if name == "open" else getattr(ckpt_mod, name)
    writes = [0]

    def full(*args, **kwargs):
        target = args[1] if name == "save_file" else args[0]
        if name == "open" and "w" not in (args[1] if len(args) > 1 else kwargs.get("mode", "r")):
            return original(*args, **kwargs)                 # reading (checksums) needs no space
        writes[0] += 1
        if writes[0] != calls:
            return original(*args, **kwargs)
        Path(target).write_bytes(b"\0" * 64)                 # what fitted
        if name == "save_file":
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt_mod, name, full, raising=False)


@pytest.mark.parametrize("writer,calls", [("save_file", 2), ("open", 5)], ids=["optimizer-safetensors", "state-json"])
def test_a_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_resumes(tmp_path, monkeypatch, capsys, writer,
                                                                                calls):
    from attnlab.cli import main
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "run"
    args = ["train", "lm", "--data", str(tmp_path / "text.txt"), "--out", str(run), "--d-model", "16", "--heads", "2",
            "--layers", "1", "--context", "16", "--batch-size", "4", "--sample-tokens", "0", "--no-progress",
            "--eval-every", "3", "--save-every", "1"]
    with monkeypatch.context() as m:
        _disk_full_after(m, writer, calls)   # the save of step 2 runs out of space (config.yaml and step 1's
                                             # trainer_state.json, manifest and latest are the first 4 writes)
        assert main([*args, "--steps", "3"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0] == (f"attnlab train: error: {run}: no space left on the device while saving the checkpoint of "
                        f"step 2; nothing is lost: {run}/step-0000001 is intact, and --resume (resume=True) "
                        "continues from it once there is room")
    assert not [p.name for p in run.iterdir() if p.name.startswith(".tmp")]    # the half-written save is gone
    assert main([*args, "--steps", "3", "--resume"]) == 0
    assert load_checkpoint(run, _model_for(run))["step"] == 3


def _model_for(run: Path):
    from attnlab.tasks.run import build_model, read_run
    info = read_run(resolve_checkpoint(run))
    return build_model(info.model_type, info.config, info.architecture)
