"""benchmarks/distributed.py keeps running, and its count of what each process holds is right: a
smoke test on a tiny LLaMA, FSDP in 2 processes under torchrun (gloo, CPU)."""
import json
import subprocess
import sys
from pathlib import Path

from test_train import _env  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]


def test_distributed_benchmark_counts_half_the_state_per_process_under_fsdp():
    """The reference: the parameter count of the same configuration built here, 16 bytes each (fp32
    weight, gradient and two AdamW moments), which one process or DDP holds whole; each of 2 FSDP
    processes holds half, and at most one more row per tensor (fully_shard pads the first
    dimension to a multiple of 2)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from distributed import QUICK
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from attnlab.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(**QUICK))
    n = sum(p.numel() for p in model.parameters())
    slack = 16 * sum(p[0].numel() for p in model.parameters())      # one row of every tensor, 16 bytes a number
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distributed.py"), "--quick"], env=_env(),
                          capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "state / 16 P" in proc.stdout and "step / DDP" in proc.stdout
    (fsdp,) = json.loads(proc.stdout.splitlines()[-1])
    assert (fsdp["processes"], fsdp["wrapper"], fsdp["parameters"]) == (2, "FSDP", n)
    state = fsdp["param_bytes"] + fsdp["grad_bytes"] + fsdp["adam_bytes"]
    assert 8 * n <= state <= 8 * n + slack, (state, n)
    assert fsdp["param_bytes"] * 2 == fsdp["grad_bytes"] * 2 == fsdp["adam_bytes"]
