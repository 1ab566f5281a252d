"""benchmarks/ssm.py's table from stored rows: ratios against the family's transformers model and
the GPT, a ratio across two processes (a --resume with --only) marked, a row that did not run
said so. Rows are written by hand here; no timing is asserted."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ssm as B  # noqa: E402

OURS, REF, GPT = "attnlab Mamba (chunked scan)", B._REFERENCE["mamba"], B._GPT


def _row(name, run, seconds, peak, mode="fwd+bwd"):
    return {"family": "mamba", "mode": mode, "length": 512, "name": name, "run": run, "median_s": seconds,
            "times": [seconds], "peak_bytes": peak}


def test_ratios_and_the_mark_of_a_ratio_across_processes():
    rows = [_row(REF, "a", 10.0, 400 * 2**20), _row(GPT, "a", 0.5, 50 * 2**20), _row(OURS, "a", 1.0, 100 * 2**20)]
    table, notes = B._table(rows, [OURS, REF, GPT])
    assert [r[2] for r in table] == [OURS, REF, GPT] and notes == []
    assert table[0][6:] == ["10.0", "0.25", "2.00"]          # speed, memory vs transformers, time vs GPT
    rows[2] = _row(OURS, "b", 2.0, 100 * 2**20)               # attnlab's row measured again, alone
    table, notes = B._table(rows, [OURS, REF, GPT])
    assert table[0][6:] == ["5.0¹", "0.25¹", "4.00¹"] and table[1][6:] == ["1.0", "1.00", "20.00"]
    assert len(notes) == 1 and notes[0].startswith("¹")


def test_rows_not_run_or_without_memory():
    def not_run(name, why):
        return {"family": "mamba", "mode": "fwd+bwd", "length": 512, "name": name, "run": "a", "not_run": why}
    rows = [not_run(REF, "forward+backward above --reference-max-length 512"), not_run(GPT, "over the 6 GiB memory cap"),
            {k: v for k, v in _row(OURS, "a", 1.0, 0).items() if k != "peak_bytes"} | {"peak_missing": "over the 6 GiB cap"}]
    table, _ = B._table(rows, [OURS, REF, GPT])
    assert table[0][3:] == ["1000", 1, "over the 6 GiB cap", "-", "-", "-"]
    assert table[1][3] == "not run" and table[2][3] == "over the cap"


def test_only_the_python_loops_over_positions_skip_long_backward():
    """--reference-max-length keeps the loops over positions out of forward+backward at long lengths;
    transformers' Mamba-2 path is a chunked SSD, not a loop, and runs at every length."""
    assert B._slow_loop(B._REFERENCE["mamba"]) and B._slow_loop("mambapy (sequential)")
    assert not B._slow_loop(B._REFERENCE["mamba2"]) and not B._slow_loop("mambapy (pscan)")
    assert not B._slow_loop(OURS)
