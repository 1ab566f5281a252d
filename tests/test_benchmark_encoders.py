"""benchmarks/encoders.py keeps running: its quick mode on a tiny BERT, every table and target line."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_encoder_benchmark_quick_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "encoders.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for title in ("Forward (inference), fp32 weights", "Forward (inference), bf16 weights", "Fine-tuning step, fp32",
                  "Fine-tuning step, bf16 autocast"):
        for kind in ("full batch (100% real tokens)", "padded batch ("):
            assert out.count(f"{title}{' (fp32 weights)' if 'autocast' in title else ''}, {kind}") == 2, f"{title!r}, {kind}: a table and a target line expected"
    assert "transformers BertModel (sdpa)" in out and "A/A: again" in out and "Writing model shards" not in out
