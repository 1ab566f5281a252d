"""docs/errors.md, checked: every bad input and fault of its table gets the one-line message (or
the recovery) the table gives. A probe is a function below, named by the table's first column;
a row without a message names the test that checks the recovery, and that test must exist."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli import is_user_error, main

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "errors.md"
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
PAIRS = [f"{a} {b}\t{b} {a}" for a in ["one", "two", "three"] for b in ["cat", "dog"]]
TINY_TR = ["--tokenizer", "word", "--steps", "3", "--eval-every", "3", "--d-model", "16", "--heads", "2",
           "--layers", "1", "--d-ff", "32", "--max-tokens", "256", "--eval-size", "4", "--no-progress"]
REVIEWS = "text\tlabel\n" + "a great film\tpos\na dull film\tneg\n" * 4
TINY_CLS = ["--steps", "2", "--d-model", "16", "--heads", "2", "--layers", "1", "--no-progress"]
TINY_LM = ["--steps", "3", "--eval-every", "3", "--d-model", "16", "--heads", "2", "--layers", "1",
           "--context", "16", "--batch-size", "4", "--sample-tokens", "0", "--no-progress"]


def _rows() -> list[tuple[str, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    d = tmp_path_factory.mktemp("errors")
    (d / "pairs.tsv").write_text("\n".join(PAIRS * 4) + "\n")
    (d / "text.txt").write_text(TEXT)
    (d / "reviews.tsv").write_text(REVIEWS)
    cwd = os.getcwd()
    os.chdir(d)
    try:
        assert main(["train", "translate", "--data", "pairs.tsv", "--valid", "pairs.tsv", "--out", "tr", *TINY_TR]) == 0
        assert main(["train", "lm", "--data", "text.txt", "--out", "lm", *TINY_LM]) == 0
        assert main(["train", "classify", "--data", "reviews.tsv", "--out", "cls", *TINY_CLS]) == 0
    finally:
        os.chdir(cwd)
    return d


@pytest.fixture
def work(home, tmp_path, monkeypatch):
    """A fresh copy of the two runs and their data, as the current directory."""
    for name in ("pairs.tsv", "text.txt", "reviews.tsv", "tr", "lm", "cls"):
        (shutil.copytree if (home / name).is_dir() else shutil.copy)(home / name, tmp_path / name,
                                                                     **({"symlinks": True} if (home / name).is_dir()
                                                                        else {}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(capsys, *args, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:                       # argparse
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _gpt2_dir(d: Path) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                               "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 50,
                                               "n_positions": 32}))
    return d


def _probe(name: str, work: Path, capsys, monkeypatch) -> tuple[int, str, str]:
    """Run the probe ``name`` in ``work``; (exit code, stdout, stderr)."""
    cli = lambda *a, **k: _cli(capsys, *a, monkeypatch=monkeypatch, **k)  # noqa: E731
    resume_lm = ["train", "lm", "--out", "lm", "--resume"]
    if name == "resume-other-data":
        shutil.copy("pairs.tsv", "other.tsv")
        return cli("train", "translate", "--out", "tr", "--resume", "--data", "other.tsv")
    if name == "resume-other-size":
        return cli(*resume_lm, "--d-model", "32")
    if name == "resume-data-edited":
        with open("pairs.tsv", "a") as f:
            f.write("four cat\tcat four\n")
        return cli("train", "translate", "--out", "tr", "--resume")
    if name == "resume-nothing":
        return cli("train", "lm", "--out", "empty", "--resume")
    if name == "resume-fewer-steps":
        return cli(*resume_lm, "--steps", "2")
    if name == "resume-other-task":
        return cli("train", "lm", "--out", "tr", "--resume")
    if name == "resume-more-steps":
        return cli(*resume_lm, "--steps", "4", "--eval-every", "4")
    if name == "latest-empty":
        Path("lm/latest").write_text("")
        return cli(*resume_lm)
    if name == "latest-dangling":
        Path("lm/latest").write_text("step-0000009\n")
        return cli(*resume_lm)
    if name == "trainer-state-broken":
        Path("lm/step-0000003/trainer_state.json").write_text("{not json")
        return cli(*resume_lm)
    if name == "trainer-state-array":
        Path("lm/step-0000003/trainer_state.json").write_text("[1]")
        return cli(*resume_lm)
    if name == "config-yaml-broken":
        Path("lm/config.yaml").write_text("task: [lm")
        return cli(*resume_lm)
    if name == "tokenizer-broken":
        (Path("tr/best").resolve() / "tokenizer.json").write_text('{"a":')
        return cli("translate", "tr", "one cat")
    if name == "weights-truncated":
        best = Path("tr/best").resolve() / "model.safetensors"
        data = best.read_bytes()
        best.unlink()                              # a hard link: do not damage step-0000003 as well
        best.write_bytes(data[:100])
        return cli("translate", "tr", "one cat")
    if name == "run-json-broken":
        (Path("tr/best").resolve() / "run.json").write_text("[1,")
        return cli("translate", "tr", "one cat")
    if name == "data-dir":
        return cli("train", "mlm", "--data", ".", "--out", "r")
    if name == "data-dir-no-split":
        Path("notes").mkdir()
        Path("notes/readme.md").write_text("notes")
        return cli("train", "classify", "--data", "notes", "--out", "r")
    if name == "data-missing":
        return cli("train", "lm", "--data", "missing.txt", "--out", "r")
    if name == "data-unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads a file of mode 000")
        Path("locked.txt").write_text(TEXT)
        os.chmod("locked.txt", 0)
        return cli("train", "lm", "--data", "locked.txt", "--out", "r")
    if name == "out-is-file":
        return cli("train", "lm", "--data", "text.txt", "--out", "text.txt")
    if name == "out-under-file":
        return cli("train", "lm", "--data", "text.txt", "--out", "text.txt/run")
    if name == "eval-empty-tsv":
        Path("empty.tsv").write_text("")
        return cli("eval", "tr", "--data", "empty.tsv")
    if name == "tsv-malformed":
        Path("bad.tsv").write_text("one cat\tcat one\nno tab here\n")
        return cli("eval", "tr", "--data", "bad.tsv")
    if name.startswith(("eval-labelled", "eval-pairs", "translate-header", "translate-one", "translate-over")):
        return _file_probe(name, cli)
    if name.startswith(("classify-", "init-", "embed-", "head-", "export-")):
        return _classify_probe(name, cli)
    if name == "mlm-no-sentences":
        Path("blank.txt").write_text("\n  \n")
        return cli("train", "mlm", "--data", "blank.txt", "--out", "m")
    if name == "mlm-one-document":
        Path("one.txt").write_text("the dog runs\nthe dog sleeps\n")
        return cli("train", "mlm", "--data", "one.txt", "--out", "m")
    if name == "mlm-no-head":
        return cli("train", "mlm", "--model", "gpt2", "--out", "m")
    if name == "device-unknown":
        return cli("generate", "lm", "--device", "foo")
    if name == "device-no-cuda":
        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        return cli("generate", "lm", "--device", "cuda")
    if name == "hf-config-array":
        Path("hf").mkdir()
        Path("hf/config.json").write_text("[1, 2]")
        return cli("generate", "hf")
    if name == "hf-bin-list":
        torch.save([torch.zeros(2)], _gpt2_dir(Path("hfbin")) / "pytorch_model.bin")
        return cli("generate", "hfbin")
    if name in ("steps-zero", "lr-zero", "time-budget-zero", "vocab-size-zero"):
        flag = "--" + name.rsplit("-zero", 1)[0]
        return cli("train", "lm", "--data", "text.txt", "--out", "r", flag, "0")
    if name == "aux-coef-negative":
        return cli("train", "lm", "--model", "mixtral", "--data", "text.txt", "--out", "r", "--aux-coef", "-1")
    if name == "mamba-d-ff":
        return cli("train", "lm", "--model", "mamba", "--data", "text.txt", "--out", "r", "--d-ff", "64")
    if name == "pre-norm-with-t5":
        return cli("train", "translate", "--model", "t5", "--data", "pairs.tsv", "--out", "r", "--pre-norm")
    if name == "mamba2-heads":
        return cli("train", "lm", "--model", "mamba2", "--data", "text.txt", "--out", "r", "--d-model", "16",
                   "--heads", "3")
    if name == "mamba2-groups":
        return cli("train", "lm", "--model", "mamba2", "--data", "text.txt", "--out", "r", "--d-model", "16",
                   "--heads", "4", "--n-groups", "3")
    if name == "rwkv-dropout":
        return cli("train", "lm", "--model", "rwkv", "--data", "text.txt", "--out", "r", "--dropout", "0.1")
    if name == "rwkv7-head-size":
        return cli("train", "lm", "--model", "rwkv7", "--data", "text.txt", "--out", "r", "--d-model", "16",
                   "--head-size", "5")
    if name == "experts-with-gpt":
        return cli("train", "lm", "--data", "text.txt", "--out", "r", "--experts", "4")
    if name == "limit-negative":
        return cli("eval", "tr", "--data", "pairs.tsv", "--limit", "-1")
    if name == "other-task-option":
        return cli("eval", "lm", "--data", "text.txt", "--beam", "2")
    if name == "eval-size-zero":
        result = cli("train", "translate", "--data", "pairs.tsv", "--out", "r", *TINY_TR, "--eval-size", "0")
        records = [json.loads(x) for x in Path("r/metrics.jsonl").read_text().splitlines()]
        evals = [r for r in records if r["kind"] == "eval"]
        assert evals and all("val_loss" in r and "bleu" not in r for r in evals)
        assert json.loads(Path("r/best/trainer_state.json").read_text())["best"]["metric"] == "val_loss"
        return result
    if name == "translate-stdin-blank":
        result = cli("translate", "tr", "--beam", "1", stdin="one cat\n\ntwo dog\n")
        lines = result[1].split("\n")
        assert len(lines) == 4 and lines[1] == "" and lines[0] and lines[2] and lines[3] == "", result[1]
        return result
    if name == "lm-unknown-chars":
        Path("odd.txt").write_text("the quick ЖЖЖ dog. ok")
        return cli("eval", "lm", "--data", "odd.txt")
    if name == "internal-error":
        try:
            json.loads("{not json")
        except ValueError as e:
            assert not is_user_error(e)            # raised outside attnlab: a bug, with its traceback
        from attnlab.data.files import DataFormatError
        try:
            raise ValueError("--steps: must be positive")
        except ValueError as e:
            assert is_user_error(e) is False       # raised in a test file, not in attnlab's source
        assert is_user_error(DataFormatError("f.tsv", 2, "bad"))
        monkeypatch.setattr("attnlab.cli.generate.run", lambda args: json.loads("{"))
        with pytest.raises(json.JSONDecodeError):
            main(["generate", "lm"])
        return 1, "", "the traceback"
    if name == "debug":
        with pytest.raises(FileNotFoundError, match="no checkpoint at nothing"):
            main(["--debug", "generate", "nothing"])
        monkeypatch.setenv("ATTNLAB_DEBUG", "1")
        with pytest.raises(FileNotFoundError):
            main(["generate", "nothing"])
        monkeypatch.delenv("ATTNLAB_DEBUG")
        code, out, err = cli("generate", "nothing")
        assert code == 2 and "no checkpoint at nothing" in err
        return 1, "", "the traceback of the user error"
    raise AssertionError(f"docs/errors.md names the probe {name!r}, which tests/test_errors.py does not run")


def _classify_probe(name: str, cli) -> tuple[int, str, str]:
    """The probes of text classification (a classify run ``cls`` trained on ``reviews.tsv``)."""
    files = {"classify-empty-file": ("empty.tsv", ""),
             "classify-no-label-column": ("scores.tsv", "text\tscore\ngood\t5\n"),
             "classify-bad-jsonl": ("bad.jsonl", '{"text": "good", "label": "pos"}\n{"text": good}\n'),
             "classify-jsonl-array": ("list.jsonl", "[1, 2]\n"),
             "classify-fields": ("ragged.tsv", "text\tlabel\ngood\tpos\nbad\tneg\textra\n"),
             "classify-empty-text": ("blank.csv", 'text,label\n"",pos\n'),
             "classify-format": ("reviews.txt", "good\tpos\n"),
             "classify-headerless": ("ag.tsv", "".join(f"{w} news story {i}\t{i % 4 + 1}\n" for i, w in
                                                        enumerate(["world", "sport", "trade", "tech"] * 3))),
             "classify-csv-line-break": ("multi.csv", 'text,label\n"a great\nfilm",pos\n"dull, slow",neg\n' * 4),
             "classify-csv-big-field": ("big.csv", "text,label\n" + "great " * 34_000 + "film,pos\n"
                                       + "great film,pos\ndull,neg\n" * 4),
             "classify-one-label": ("one.tsv", "text\tlabel\n" + "a great film\tpos\n" * 4)}
    if name in files:
        file, content = files[name]
        Path(file).write_text(content)
        return cli("train", "classify", "--data", file, "--out", "r", *TINY_CLS)
    if name == "classify-unknown-column":
        return cli("train", "classify", "--data", "reviews.tsv", "--label-column", "stars", "--out", "r")
    if name == "classify-valid-label":
        Path("valid.tsv").write_text("text\tlabel\nfine\tpos\nso so\tneutral\n")
        return cli("train", "classify", "--data", "reviews.tsv", "--valid", "valid.tsv", "--out", "r")
    if name == "classify-eval-label":
        Path("other.tsv").write_text("text\tlabel\nso so\tneutral\n")
        return cli("eval", "cls", "--data", "other.tsv")
    if name == "classify-other-kind":
        return cli("classify", "lm", "a text")
    if name == "classify-top-zero":
        return cli("classify", "cls", "--top", "0", "a text")
    if name == "init-no-encoder":
        return cli("train", "classify", "--init", "tr", "--data", "reviews.tsv", "--out", "r")
    if name == "init-with-sizes":
        return cli("train", "classify", "--init", "enc", "--data", "reviews.tsv", "--d-model", "64", "--out", "r")
    if name == "head-native-scratch":
        return cli("train", "classify", "--head", "native", "--data", "reviews.tsv", "--out", "r")
    if name == "head-native-gpt":
        from _toy_encoder import pretrained_dir
        pretrained_dir(Path("gpt"), "gpt2", "GPT2Model")
        return cli("train", "classify", "--init", "gpt", "--head", "native", "--data", "reviews.tsv", "--out", "r")
    if name == "export-pooling-head":
        return cli("export", "cls", "out")
    if name == "export-not-a-run":
        _gpt2_dir(Path("hfdir"))
        return cli("export", "hfdir", "out")
    if name == "export-busy":
        Path("out").mkdir()
        Path("out/notes.txt").write_text("mine")
        return cli("export", "lm", "out")
    if name == "embed-out-not-npy":
        return cli("embed", "cls", "a text", "--out", "vectors.txt")
    if name == "embed-translation":
        return cli("embed", "tr", "a text")
    raise AssertionError(f"docs/errors.md names the probe {name!r}, which tests/test_errors.py does not run")


def _file_probe(name: str, cli) -> tuple[int, str, str]:
    """Another task's file given to 'attnlab eval', and training files that leave no training pair."""
    if name == "eval-labelled-as-pairs":
        return cli("eval", "tr", "--data", "reviews.tsv")
    if name == "eval-pairs-as-labelled":
        return cli("eval", "cls", "--data", "pairs.tsv")
    if name == "eval-labelled-as-text":
        return cli("eval", "lm", "--data", "reviews.tsv")
    if name == "translate-header-only":
        Path("header.tsv").write_text("source\ttarget\n")
        return cli("train", "translate", "--data", "header.tsv", "--out", "r", *TINY_TR)
    if name == "translate-one-long-line":
        Path("huge.tsv").write_text("x" * 10_000_000 + "\ty\n")
        return cli("train", "translate", "--data", "huge.tsv", "--out", "r", *TINY_TR)
    if name == "translate-over-max-len":
        return cli("train", "translate", "--data", "pairs.tsv", "--valid", "pairs.tsv", "--max-len", "1", "--out", "r",
                   *TINY_TR)
    raise AssertionError(f"docs/errors.md names the probe {name!r}, which tests/test_errors.py does not run")


ROWS = _rows()


def test_the_table_lists_the_probes_once():
    names = [r[0] for r in ROWS]
    assert len(names) >= 30 and len(names) == len(set(names))


@pytest.mark.parametrize("name,what,answer", ROWS, ids=[r[0] for r in ROWS])
def test_each_bad_input_gets_what_the_table_says(name, what, answer, work, capsys, monkeypatch):
    cited = re.search(r"\(tests/(\w+\.py)::(\w+)\)", answer)
    if cited:                                       # a recovery checked by another test: it must exist
        source = (ROOT / "tests" / cited.group(1)).read_text()
        assert f"def {cited.group(2)}(" in source, answer
        return
    code, out, err = _probe(name, work, capsys, monkeypatch)
    expected = re.search(r"`([^`]+)`", answer)
    if answer.startswith("exit 0"):
        assert code == 0, err
        if expected:
            assert expected.group(1) in err, err
        return
    if answer.startswith("the traceback"):
        return                                      # the probe itself checked it
    assert expected, answer
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and code == 2, err
    error_lines = [line for line in lines if line.startswith("attnlab ") and ": error: " in line
                   or line.startswith("usage:")]
    assert error_lines and error_lines[-1].split(": error: ", 1)[-1].count("\n") == 0, err
    assert expected.group(1) in error_lines[-1], f"expected {expected.group(1)!r} in {error_lines[-1]!r}"
