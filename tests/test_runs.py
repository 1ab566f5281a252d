"""Run directories: one run.json format for every task, runs written by the previous format still
load, and every command dispatches on the recorded task (or a Hugging Face directory's
architecture), naming the command that takes a model of another kind."""
import json
import shutil

import pytest
import torch

from attnlab.cli import main
from attnlab.tasks import inspect_path, open_run
from attnlab.tasks.lm import load_lm
from attnlab.tasks.translate import load_translator
from _hf_fixtures import tiny_gpt2_dir  # noqa: E402  (tests/ is on sys.path under pytest)

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    pairs = [f"{a} {b}\t{b} {a}" for a in ["one", "two", "three"] for b in ["cat", "dog"]]
    (d / "pairs.tsv").write_text("\n".join(pairs * 4) + "\n")
    (d / "text.txt").write_text(TEXT)
    assert main(["train", "translate", "--data", str(d / "pairs.tsv"), "--valid", str(d / "pairs.tsv"),
                 "--tokenizer", "word", "--steps", "3", "--eval-every", "3", "--d-model", "16", "--heads", "2",
                 "--layers", "1", "--d-ff", "32", "--max-tokens", "256", "--eval-size", "4", "--no-progress",
                 "--out", str(d / "translate")]) == 0
    assert main(["train", "lm", "--data", str(d / "text.txt"), "--steps", "3", "--eval-every", "3",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
                 "--sample-tokens", "0", "--no-progress", "--out", str(d / "lm")]) == 0
    return d


def test_every_task_writes_the_same_run_format(runs):
    for task, arch in (("translate", "Transformer"), ("lm", "GPT2LMHeadModel")):
        meta = json.loads((runs / task / "best" / "run.json").read_text())
        assert meta["format"] == 3 and meta["task"] == task and meta["architecture"] == arch
        assert set(meta) == {"format", "task", "model_type", "architecture", "config", "processors", "task_options"}
        for proc in meta["processors"].values():
            assert proc["modality"] == "text" and (runs / task / "best" / proc["file"]).is_file()
        info = inspect_path(runs / task)
        assert info.kind == "run" and info.run.task == task


def _as_format_2(ckpt, dest):
    """A copy of a checkpoint as run format 2 wrote it: "tokenizers" (role -> file) in place of
    "processors"."""
    shutil.copytree(ckpt, dest)
    (dest / "manifest.json").unlink()                  # run.json changes below: the copy goes unchecked
    meta = json.loads((dest / "run.json").read_text())
    meta.update(format=2, tokenizers={role: p["file"] for role, p in meta.pop("processors").items()})
    (dest / "run.json").write_text(json.dumps(meta))


def test_runs_of_format_2_load_and_resume(runs, tmp_path):
    _as_format_2(runs / "translate" / "best", tmp_path / "old-translate")
    new_model, src, tgt = load_translator(runs / "translate", "cpu")
    old_model, src1, _ = load_translator(tmp_path / "old-translate", "cpu")
    assert open_run(tmp_path / "old-translate").tokenizers == {"source": "tokenizer.json", "target": "tokenizer.json"}
    assert src1.vocabulary() == src.vocabulary()
    ids = torch.tensor([src.encode("one cat two dog")])
    tgt_in = torch.tensor([[tgt.bos_id] + tgt.encode("cat one dog")])
    torch.testing.assert_close(old_model(ids, tgt_in), new_model(ids, tgt_in), rtol=0, atol=0)


def test_runs_of_the_first_format_are_refused_in_one_line(runs, tmp_path, capsys):
    old = tmp_path / "old-lm"
    shutil.copytree(runs / "lm" / "best", old)
    for name in ("run.json", "manifest.json"):          # the first format wrote neither
        (old / name).unlink()
    (old / "lm.json").write_text(json.dumps({"task": "lm", "format": 1}))
    assert main(["generate", str(old), "--prompt", "the"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "first format (lm.json, before run.json)" in err and "train it again" in err


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def test_a_model_of_the_wrong_kind_names_the_command_that_takes_it(runs, tmp_path, capsys):
    assert main(["translate", str(runs / "lm"), "hello"]) == 2
    assert "an attnlab 'lm' run (gpt2), which 'attnlab translate' does not take; use 'attnlab generate'" \
        in _error(capsys)
    assert main(["generate", str(runs / "translate"), "--prompt", "one"]) == 2
    assert "'translate' run (transformer), which 'attnlab generate' does not take; use 'attnlab translate'" \
        in _error(capsys)
    tiny_gpt2_dir(tmp_path / "hf", n_embd=32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, architectures=["GPT2Model"])))
    capsys.readouterr()                                       # transformers' own progress output
    assert main(["generate", str(tmp_path / "hf"), "--prompt", "the"]) == 2
    assert "a Hugging Face GPT2Model directory, which 'attnlab generate' does not take" in _error(capsys)
    # a task's eval options are refused for another task's model
    assert main(["eval", str(runs / "translate"), "--data", str(runs / "pairs.tsv"), "--stride", "4"]) == 2
    assert "--stride: not an option for an attnlab 'translate' run" in _error(capsys)
    assert main(["eval", str(runs / "lm"), "--data", str(runs / "text.txt"), "--beam", "2"]) == 2
    assert "--beam: not an option for an attnlab 'lm' run" in _error(capsys)
    # and a run of one task cannot be resumed as another
    assert main(["train", "lm", "--resume", "--data", str(runs / "text.txt"), "--out", str(runs / "translate")]) == 2
    assert "holds an attnlab 'translate' run; it cannot be resumed as 'lm'" in _error(capsys)


def test_eval_dispatches_on_the_recorded_task(runs, capsys):
    assert main(["eval", str(runs / "translate"), "--data", str(runs / "pairs.tsv"), "--beam", "1"]) == 0
    assert "BLEU" in capsys.readouterr().out
    assert main(["eval", str(runs / "lm"), "--data", str(runs / "text.txt"), "--stride", "8"]) == 0
    assert "perplexity" in capsys.readouterr().out
