"""Damaged weights are caught: every checkpoint records the SHA-256 of each of its files, and every
loader (inference, eval, export, load_checkpoint, --resume) checks the files it reads. A run whose
best is damaged or missing is used through its next intact checkpoint, saying which; --resume
past a damaged newest checkpoint continues from the newest intact one, saying which it skipped."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.tasks import open_run
from attnlab.train.checkpoint import load_checkpoint, resolve_best, resolve_checkpoint

TEXT = "the quick brown fox jumps over the lazy dog. " * 40
TINY_LM = ["--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
           "--sample-tokens", "0", "--no-progress"]


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    d = tmp_path_factory.mktemp("integrity")
    (d / "text.txt").write_text(TEXT)
    assert main(["train", "lm", "--data", str(d / "text.txt"), "--out", str(d / "lm"), "--steps", "4",
                 "--eval-every", "2", "--save-every", "1", *TINY_LM]) == 0
    return d


@pytest.fixture
def run(home, tmp_path) -> Path:
    """A fresh copy of the run (copied files: no hard link between best and its step)."""
    return shutil.copytree(home / "lm", tmp_path / "lm", symlinks=True)


def _flip(file: Path) -> None:
    """Flip one bit of the last byte of ``file`` (tensor data, for weights), in a file of its own:
    a hard-linked copy elsewhere in the run keeps the original."""
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x01
    file.unlink()
    file.write_bytes(bytes(data))


def _lines(err: str, kind: str) -> list[str]:
    return [line for line in err.splitlines() if f": {kind}: " in line]


def test_the_manifest_records_every_file_of_a_checkpoint(home):
    ckpt = resolve_checkpoint(home / "lm")
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    files = {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    assert set(manifest) == files and {"model.safetensors", "optimizer.safetensors", "trainer_state.json",
                                       "run.json", "tokenizer.json"} <= files
    for name, entry in manifest.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_flipped_byte_in_the_best_weights_is_caught_and_inference_says_what_it_uses(run, home, capsys):
    best, latest = resolve_best(run), resolve_checkpoint(run)
    _flip(best / "model.safetensors")
    data = ["--data", str(home / "text.txt")]
    assert main(["eval", str(run), *data]) == 0
    warned = _lines(capsys.readouterr().err, "warning")
    assert len(warned) == 1, warned                           # once, however often the command looks
    assert f"{best}/model.safetensors: damaged or changed since it was written (its SHA-256 differs" in warned[0]
    assert warned[0].endswith(f"; using {latest} instead")
    from attnlab.train.checkpoint import CheckpointDamaged, CheckpointWarning
    with pytest.warns(CheckpointWarning, match="using"):
        assert open_run(run).path == latest
    # named directly, the damaged checkpoint is refused in one line by every loader
    for command in (["eval", str(best), *data], ["export", str(best), str(run.parent / "hf")],
                    ["generate", str(best), "--prompt", "the", "--max-new-tokens", "2"]):
        assert main(command) == 2, command
        errors = _lines(capsys.readouterr().err, "error")
        assert len(errors) == 1 and "model.safetensors: damaged or changed since it was written" in errors[0]
    with pytest.raises(CheckpointDamaged, match="model.safetensors: damaged"):
        load_checkpoint(best, _model(run))
    # no intact copy left: one line, naming the first damaged one
    for step in run.glob("step-*"):
        _flip(step / "model.safetensors")
    assert main(["eval", str(run), *data]) == 2
    errors = _lines(capsys.readouterr().err, "error")
    assert len(errors) == 1 and f"{best}/model.safetensors: damaged" in errors[0]
    assert errors[0].endswith(f"{run} holds no intact checkpoint")


def _model(run: Path):
    from attnlab.tasks.run import build_model, read_run
    info = read_run(resolve_checkpoint(run))
    return build_model(info.model_type, info.config, info.architecture)


def test_a_best_that_names_nothing_is_said_before_another_checkpoint_is_used(run, home, capsys):
    shutil.rmtree(resolve_best(run).resolve())
    assert main(["eval", str(run), "--data", str(home / "text.txt")]) == 0
    warned = _lines(capsys.readouterr().err, "warning")
    assert warned == [f"attnlab eval: warning: {run}/best names no complete checkpoint; using "
                      f"{resolve_checkpoint(run)} instead"]


def test_resume_past_a_damaged_newest_checkpoint_continues_from_the_newest_intact_one(run, capsys, caplog):
    newest = resolve_checkpoint(run)
    assert newest.name == "step-0000004" and (run / "step-0000003").is_dir()
    _flip(newest / "optimizer.safetensors")
    with caplog.at_level(logging.WARNING, logger="attnlab.train"):
        assert main(["train", "lm", "--out", str(run), "--resume", "--steps", "5", "--no-progress"]) == 0
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume: skipped")]
    assert said == [f"resume: skipped step-0000004, damaged ({newest}/optimizer.safetensors: damaged or changed "
                    f"since it was written (its SHA-256 differs from the one in {newest}/manifest.json)); "
                    "resuming from step-0000003"]
    assert resolve_checkpoint(run).name == "step-0000005"
    state = load_checkpoint(run, _model(run))
    assert state["step"] == 5 and [r["step"] for r in state["metrics"] if r["kind"] == "eval"] == [2, 4, 5]
    load_checkpoint(newest, _model(run))                      # written again, intact
    # every checkpoint damaged: one line, and nothing is resumed
    for step in run.glob("step-*"):
        _flip(step / "optimizer.safetensors")
    capsys.readouterr()
    assert main(["train", "lm", "--out", str(run), "--resume", "--steps", "6", "--no-progress"]) == 2
    errors = _lines(capsys.readouterr().err, "error")
    assert len(errors) == 1 and errors[0].endswith(f"{run} holds no intact checkpoint to resume from "
                                                   "(and 2 older damaged)"), errors


def test_a_checkpoint_without_a_manifest_loads_unchecked_and_silently(run, home, capsys):
    for manifest in run.rglob("manifest.json"):               # as an older attnlab wrote them
        manifest.unlink()
    _flip(resolve_best(run) / "model.safetensors")            # nothing to check it against
    assert main(["eval", str(run), "--data", str(home / "text.txt")]) == 0
    assert not _lines(capsys.readouterr().err, "warning")
    assert load_checkpoint(run, _model(run))["step"] == 4
