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


def test_shakespeare_reference_trains_and_compares(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from shakespeare_reference import nanogpt_lr, nanogpt_param_groups
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert abs(nanogpt_lr(0) - 1e-3 / 101) < 1e-12 and nanogpt_lr(100) == 1e-3      # nanoGPT's get_lr
    assert abs(nanogpt_lr(5000) - 1e-4) < 1e-12 and nanogpt_lr(6000) == 1e-4
    assert abs(nanogpt_lr(2550) - 5.5e-4) < 1e-9                                       # half-way down
    import transformers
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                                                n_head=2))
    wte, wpe = gpt2.transformer.wte.weight, gpt2.transformer.wpe.weight
    for decay_embeddings in (True, False):
        decay, no_decay = (g["params"] for g in nanogpt_param_groups(gpt2, 0.1, decay_embeddings))
        assert len(decay) + len(no_decay) == len(list(gpt2.parameters()))           # the tied head once
        def holds(group, t):
            return any(p is t for p in group)
        assert holds(decay, gpt2.transformer.h[0].attn.c_attn.weight) and holds(no_decay, gpt2.transformer.ln_f.weight)
        assert all(holds(decay, e) == decay_embeddings and holds(no_decay, e) != decay_embeddings for e in (wte, wpe))
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question.\n" * 60)
    script = str(ROOT / "benchmarks" / "shakespeare_reference.py")
    proc = subprocess.run([sys.executable, script, "--data", str(text), "--tiny", "--steps", "4", "--eval-every", "2",
                           "--eval-windows", "4", "--batch-size", "4", "--out", str(tmp_path / "ref.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "step 2: val loss" in proc.stdout and "step 4: val loss" in proc.stdout
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 2, "val_loss": 3.0}\n'
                                            '{"kind": "train", "step": 4, "loss": 2.0}\n')
    proc = subprocess.run([sys.executable, script, "--compare", str(tmp_path / "metrics.jsonl"),
                           str(tmp_path / "ref.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 2 |")]
    assert len(rows) == 1 and "3.0000" in rows[0]
