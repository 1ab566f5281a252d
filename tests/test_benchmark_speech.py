"""benchmarks/speech.py keeps running: its smoke test on tiny sizes (`attnlab train speech` for 3
steps, then the word error rate of the best checkpoint on the validation and held-out-voice sets).
Slow (about a minute with the corpus made afresh): opt in with -m slow."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_speech_benchmark_quick_runs(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speech.py"), "--quick", "--markdown",
                           "--audio-cache", str(tmp_path / "audio"), "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    rows = re.findall(r"\| (validation, training voices|test, held-out voice) \| ([^|]+) \| 3 \| ([0-9.]+) % \|", out)
    assert [r[0] for r in rows] == ["validation, training voices", "test, held-out voice"], out
    assert rows[1][1].strip() == "en-gb-x-rp+m7" and "en-gb-x-rp+m7" not in rows[0][1]
    assert "measured on a loaded machine" in out and "$ attnlab train speech" in out
    assert (tmp_path / "w" / "run" / "best" / "run.json").is_file()
