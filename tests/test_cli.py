"""The `attnlab` command end to end, on tiny settings (the full main job is marked slow)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--max-tokens", "512",
        "--eval-size", "20", "--no-progress"]


def run_cli(*args, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "attnlab.cli", *args], capture_output=True, text=True,
                          cwd=kw.get("cwd", ROOT), env=env, timeout=kw.get("timeout", 300))


def test_version_and_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert "attnlab 0.1.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "example:" in out and "translate" in out and "lm" in out        # the registered tasks


def test_python_dash_m_attnlab_runs_the_command():
    """``python -m attnlab`` (and so ``torchrun ... -m attnlab train ...``) is the attnlab command,
    exit codes included: a package needs its own __main__ for that, attnlab.cli's is not enough."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "attnlab", "--version"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 0 and "attnlab 0.1.0" in done.stdout, done.stderr
    bad = subprocess.run([sys.executable, "-m", "attnlab", "train", "no-such-task"], capture_output=True,
                         text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and "no-such-task" in bad.stderr and "Traceback" not in bad.stderr


def test_each_task_shows_only_its_own_options(capsys):
    helps = {}
    for task in ("translate", "lm"):
        with pytest.raises(SystemExit):
            main(["train", task, "--help"])
        helps[task] = capsys.readouterr().out
    for out in helps.values():
        assert "example:" in out and "--data" in out and "--resume" in out and "--config" in out
    for flag in ("--pre-norm", "--max-tokens", "--separate-vocab", "--label-smoothing", "--eval-size"):
        assert flag in helps["translate"] and flag not in helps["lm"]
    for flag in ("--context", "--experts", "--batch-size", "--eval-windows", "--sample-tokens"):
        assert flag in helps["lm"] and flag not in helps["translate"]
    # an option of the other task is refused, not ignored
    with pytest.raises(SystemExit) as e:
        main(["train", "lm", "--pre-norm"])
    assert e.value.code == 2 and "--pre-norm" in capsys.readouterr().err


def test_train_translate_eval_viz_on_a_user_tsv(tmp_path):
    pairs = [f"{a} {b}\t{b} {a}" for a in ["one", "two", "three", "four"] for b in ["cat", "dog", "bird"]]
    data = tmp_path / "pairs.tsv"
    data.write_text("\n".join(pairs * 5) + "\n")
    out = tmp_path / "run"
    r = run_cli("train", "translate", "--data", str(data), "--valid", str(data), "--tokenizer", "word",
                "--steps", "6", "--eval-every", "3", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    assert "BLEU" in r.stdout and (out / "metrics.jsonl").exists() and (out / "loss.png").exists()
    assert (out / "best" / "run.json").exists() and (out / "config.yaml").exists()

    r = run_cli("translate", str(out), "one cat", "two dog", "--beam", "2")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2          # one line per input, even an empty translation
    after = run_cli("translate", str(out), "--beam", "2", "one cat", "two dog")   # texts after the options
    assert after.returncode == 0 and after.stdout == r.stdout, after.stderr

    r = run_cli("eval", str(out), "--data", str(data), "--beam", "1", "--limit", "5")
    assert r.returncode == 0 and "BLEU" in r.stdout and "5 pairs" in r.stdout, r.stderr

    png = tmp_path / "align.png"
    r = run_cli("viz", str(out), "three bird", "--out", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:4] == b"\x89PNG"

    # resume continues the same run to more steps
    r = run_cli("train", "translate", "--data", str(data), "--valid", str(data), "--tokenizer", "word",
                "--steps", "8", "--eval-every", "3", "--out", str(out), "--resume", *TINY)
    assert r.returncode == 0, r.stderr
    assert (out / "step-0000008").exists()


def test_malformed_tsv_gives_one_line_with_file_and_line(tmp_path):
    data = tmp_path / "bad.tsv"
    data.write_text("a b\tb a\nno tab here\nc\td\n")
    r = run_cli("train", "translate", "--data", str(data), "--steps", "2", "--out", str(tmp_path / "r"), *TINY)
    assert r.returncode == 2
    assert "bad.tsv" in r.stderr and "line 2" in r.stderr and "Traceback" not in r.stderr


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    r = run_cli("translate", str(tmp_path / "nothing"), "hello")
    assert r.returncode == 2 and "no checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_the_command_keeps_freed_memory_unless_told_not_to(monkeypatch):
    """attnlab's command raises glibc's mmap and trim thresholds for its own process (large tensors
    reuse freed pages instead of page-faulting fresh ones); ATTNLAB_MALLOC=default or the user's own
    MALLOC_* variables leave the allocator alone, and main() calls it before running a command."""
    import sys as _sys
    import attnlab.cli as cli
    monkeypatch.setenv("ATTNLAB_MALLOC", "default")
    assert cli.keep_freed_memory() is False
    monkeypatch.delenv("ATTNLAB_MALLOC")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert cli.keep_freed_memory() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    import ctypes.util
    glibc = _sys.platform == "linux" and "libc.so.6" in (ctypes.util.find_library("c") or "")
    assert cli.keep_freed_memory() is glibc
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main([]) == 0 and calls == [], "no command: the help alone, the allocator untouched"
    assert cli.main(["classify", "/nonexistent/run", "text"]) == 2 and calls == [1], "a command tunes it first"
