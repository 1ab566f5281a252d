"""benchmarks/ssm_generate.py keeps running: its quick mode builds each transformers model, loads
the same weights into attnlab, asserts equal greedy tokens at batch 1 and 4 (it exits otherwise),
and prints both tables with a row per model."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import ssm_generate as G  # noqa: E402


def test_ssm_generate_quick_runs(capsys):
    threads = torch.get_num_threads()
    try:
        assert G.main(["--quick"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    for family in ("Mamba", "Mamba-2", "RWKV-4"):
        assert out.count(f"\n{family} ") == 2, family          # batch 1 and batch 4
    assert "4 (transformers row by row)" in out
    for model in ("Mamba", "Mamba-2", "Mamba-3", "RWKV-4", "RWKV-7", "GPT (SDPA, KV cache)"):
        assert f"attnlab {model}" in out, model
