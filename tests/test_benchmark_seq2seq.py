"""benchmarks/seq2seq.py must keep running: a smoke test on its --quick shape."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_seq2seq_benchmark_quick_runs():
    # one thread: on a busy 2-core machine two OpenMP threads can stall for a scheduler slice per op
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "seq2seq.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "speed ratio" in out and "target tokens/s" in out
    assert "same weights, dropout off: loss" in out          # the parity check ran
    for name in ("attnlab Transformer", "torch nn.Transformer", "unfused AdamW", "A/A"):
        assert name in out, f"{name!r} missing from the benchmark table"
    ref_row = next(line for line in out.splitlines() if line.startswith("torch nn.Transformer "))
    assert " 1.00 " in ref_row                                # the reference's own ratio
    assert "Target: attnlab >= 1.10" in out
