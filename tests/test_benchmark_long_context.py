"""benchmarks/long_context.py keeps running: its measuring functions on tiny presets (seconds);
the whole script on SmolLM2 with ``--quick`` is opt-in (``-m slow``, about a minute)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script("benchmarks/long_context.py")


def test_quality_rows_and_constant_recurrent_state():
    bench = _bench()
    model = bench._tiny("llama")
    ids = torch.randint(0, model.config.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    rows = {r[0]: r for r in bench.quality(model, ids, 16, 8)}
    assert set(rows) == {"full", "sliding 8", "sink 4+8", "int8", "int4"}
    assert rows["full"][2] == "+0.0000" and rows["full"][4] == "1.0000"          # full against itself
    assert float(rows["sliding 8"][3]) > 0                                        # a window loses something
    for family, _, first, last, *_ in bench.recurrent_rows(8192):
        assert first == last > 0, family                                          # constant memory
    assert [r[0] for r in bench.update_rows(cached=128, steps=4)] == ["full", "int8", "int4"]
    sizes = {r[0]: r[2] for r in bench.family_rows()}
    assert sizes["deepseek_v3"] > 0 and sizes["mamba"] > 0


def test_stretch_rows_read_past_the_trained_context():
    """Each RoPE stretch on a fresh tiny LLaMA (trained context 64) reads 96 tokens once: three rows per
    text, perplexities finite, and linear interpolation changes them (the check can fail)."""
    bench = _bench()
    load = lambda: bench._tiny("llama")                                           # noqa: E731
    ctx = load().config.max_position_embeddings
    ids = torch.randint(0, 96, (ctx + 33,), generator=torch.Generator().manual_seed(0))
    rows = bench.stretch_rows(load, {"random": ids}, [ctx // 2, ctx + 32], 16, 16)
    assert [r[1] for r in rows] == ["checkpoint RoPE", "linear x2", "YaRN x2"]
    ppl = {r[1]: [float(v) for v in r[2:4]] for r in rows}
    assert all(0 < v < float("inf") for vs in ppl.values() for v in vs)
    assert ppl["linear x2"] != ppl["checkpoint RoPE"]


def test_bias_rows_show_kivi_keys_absorb_qk_bias():
    """The q/k-bias table: KIVI's per-channel keys cost less KL than keys quantised per token on the
    biased Qwen2 (the contrast the table exists for), and int8 less than int4."""
    rows = {(r[0], r[1]): r for r in _bench().bias_rows(steps=12, rows_=2)}
    kl = {k: float(r[3]) for k, r in rows.items()}
    biased = "q/k bias 5/20"
    assert kl[biased, "int8 (KIVI)"] < kl[biased, "int8, keys per token"] / 2
    assert kl[biased, "int8 (KIVI)"] < kl[biased, "int4 (KIVI)"]
    assert kl["no bias", "int8 (KIVI)"] < kl[biased, "int8 (KIVI)"]
    assert all(0.0 <= float(r[2]) <= 1.0 for r in rows.values())


@pytest.mark.slow
def test_long_context_benchmark_quick_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_context.py"), "--quick"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for title in ("Cache bytes per token", "Quality against the full cache", "Chunked prefill", "Recurrent models"):
        assert title in proc.stdout
