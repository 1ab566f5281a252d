"""benchmarks/lm_families.py: every causal-LM family builds through `attnlab train lm`'s own flags
and takes a timed training step (--quick), the budget's steps are the floor of budget / step, and
the table reads each run's last validation loss."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import lm_families  # noqa: E402


@pytest.fixture
def text(tmp_path):
    lines = [f"{name}: {'o ' * (i % 7)}what light through yonder window breaks {i}\n"
             for i, name in zip(range(400), ["ROMEO", "JULIET", "NURSE"] * 200)]
    file = tmp_path / "plays.txt"
    file.write_text("".join(lines))
    return file


def test_every_registered_causal_lm_family_is_in_the_table():
    from attnlab.models.registry import architectures
    # attnlab's own families (a test elsewhere in this process may have registered a toy one)
    assert set(lm_families.FAMILIES) == {a.model_type for a in architectures()
                                         if a.kind == "causal-lm" and a.model_cls.__module__.startswith("attnlab.")}


def test_quick_times_a_step_of_every_family(text, tmp_path, capsys):
    times = tmp_path / "times.json"
    threads = torch.get_num_threads()
    try:
        lm_families.main(["--quick", "--data", str(text), "--json", str(times), "--budget", "0.01"])
    finally:
        torch.set_num_threads(threads)             # the benchmark times one thread
    out = capsys.readouterr().out
    saved = json.loads(times.read_text())
    assert saved["budget_min"] == 0.01 and set(saved["families"]) == set(lm_families.FAMILIES)
    for name, t in saved["families"].items():
        assert t["params"] > 0 and t["step_ms"] > 0 and len(t["times_ms"]) == 1, name
        assert f"\n{name} " in out


def test_budget_steps_and_the_table(tmp_path, capsys):
    assert lm_families.budget_steps(250.0, 5) == 1200          # 300,000 ms / 250 ms
    assert lm_families.budget_steps(299.0, 0.01) == 2          # 600 ms / 299 ms, rounded down
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"budget_min": 1, "families": {
        "gpt2": {"params": 1000, "step_ms": 600.0}, "mamba": {"params": 990, "step_ms": 1200.0}}}))
    run = tmp_path / "runs" / "gpt2"
    run.mkdir(parents=True)
    rows = [{"kind": "train", "step": 50, "loss": 3.0}, {"kind": "eval", "step": 50, "val_loss": 2.5},
            {"kind": "eval", "step": 100, "val_loss": 2.25}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lm_families.main(["--table", "--families", "gpt2,mamba", "--times", str(times), "--out",
                      str(tmp_path / "runs"), "--data", "t.txt"])
    out = capsys.readouterr().out.splitlines()
    gpt, mamba = (next(line for line in out if line.startswith(n)) for n in ("gpt2 ", "mamba "))
    assert " 100 " in gpt and "2.2500" in gpt and "unfinished" not in gpt and "--steps 100 --eval-every 20" in gpt
    assert " 50 " in mamba and " - " in mamba and "--steps 50 " in mamba    # no run yet: no loss
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    lm_families.main(["--table", "--families", "gpt2", "--times", str(times), "--out", str(tmp_path / "runs")])
    assert "2.5000 (step 50, unfinished)" in capsys.readouterr().out       # a run still going says so


def test_a_learning_rate_grid_gives_each_family_its_best_finished_run(tmp_path, capsys):
    times = tmp_path / "times.json"
    times.write_text(json.dumps({"budget_min": 1, "families": {"gpt2": {"params": 1000, "step_ms": 600.0}}}))
    for lr, loss, step in (("0.001", 2.4, 100), ("0.002", 2.1, 100), ("0.004", 1.9, 60)):   # 4e-3 unfinished
        run = tmp_path / "runs" / f"gpt2-lr{lr}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": step, "val_loss": loss}) + "\n")
    lm_families.main(["--commands", "--table", "--families", "gpt2", "--times", str(times), "--out",
                      str(tmp_path / "runs"), "--lrs", "1e-3,2e-3,4e-3"])
    out = capsys.readouterr().out
    assert out.count("--lr ") >= 3 and "gpt2-lr0.004 --lr 0.004" in out                  # one command per lr
    row = next(line for line in out.splitlines() if line.startswith("gpt2 "))
    assert " 0.002 " in row and " 2.1000 " in row and "--lr 0.002" in row           # the best finished run
    assert "0.001: 2.4000" in row and "0.004: 1.9000 (step 60, unfinished)" in row
