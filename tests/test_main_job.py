"""The main job end to end with its real defaults (slow: about 5 minutes on 2 cores).

Run with: .venv/bin/python -m pytest -m slow tests/test_main_job.py
"""
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_main_job_reaches_bleu_90_on_the_embedded_corpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-m", "attnlab.cli", "train", "translate", "--out", str(tmp_path / "run"),
                        "--no-progress"], capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"test \(500 pairs\): BLEU ([\d.]+)\s+chrF ([\d.]+)\s+exact match ([\d.]+)%", r.stdout)
    assert m, r.stdout[-2000:]
    assert float(m.group(1)) >= 90.0, f"test BLEU {m.group(1)} < 90"
