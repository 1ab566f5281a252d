"""benchmarks/vision.py keeps running: its quick mode on a tiny ViT, every table, its timm note and
the target lines."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_vision_benchmark_quick_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vision.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for section in ("inference (forward)", "training (forward, backward, AdamW)"):
        for precision in ("fp32", "bf16 autocast"):
            assert out.count(f"**ViT-S/16 {section}, {precision};") == 1, f"{section}, {precision}: a table"
            target = f"- ViT-S/16 {section}, {precision}, against transformers:"
            assert out.count(target) == 1, f"{section}, {precision}: a target"
    assert "transformers ViTForImageClassification (sdpa)" in out and "A/A: again" in out
    assert "peak MiB" in out and "images/s" in out
    # timm is either a row or named as left out, with the reason
    assert "timm vit_small_patch16_224" in out
