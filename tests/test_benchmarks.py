"""The benchmarks must keep running: a smoke test of each one on a tiny shape."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmark_quick_runs():
    # one thread: on a busy 2-core machine two OpenMP threads can stall for a scheduler slice per op
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "attention.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "time ratio" in out and "memory ratio" in out
    for name in ("attnlab explicit", "attnlab default", "torch SDPA", "naive textbook",
                 "attnlab MHA fused_qkv=True", "attnlab MHA fused_qkv=False",
                 "torch nn.MultiheadAttention", "naive textbook MHA", "A/A"):
        assert name in out, f"{name!r} missing from the benchmark table"
    assert "Targets" in out


def test_markdown_table_renders():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _util import render_table
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    md = render_table(["mode", "seq", "ms"], [["fwd", 256, "1.00"]], markdown=True).splitlines()
    assert md[0] == "| mode | seq | ms |" and md[2] == "| fwd | 256 | 1.00 |"
