"""benchmarks/distill.py keeps running: its smoke test on tiny sizes (teacher, hard-label student,
distilled student, each through `attnlab train lm`, and their held-out perplexities)."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_distill_benchmark_quick_runs(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("To be, or not to be, that is the question.\n" * 600)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distill.py"), "--quick", "--threads", "1",
                           "--data", str(data), "--work", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    rows = {name: re.search(rf"{name}\s+\d+\s+\S+\s+\d+\s+([0-9.]+)", out) for name in
            ("teacher", "student, hard labels", "student, distilled")}
    assert all(rows.values()), out
    assert all(float(m.group(1)) > 1 for m in rows.values())
    assert "distilled / hard-label perplexity" in out and "--teacher" in out
    assert (tmp_path / "runs" / "kd-0" / "latest").is_file()
