"""What sharding saves, per process: FSDP2 (``--shard``) against DDP at 1, 2 and 4 processes.

A LLaMA-shaped model (attnlab's Llama: vocabulary 16384, d_model 768, 12 layers of 12 heads,
SwiGLU d_ff 2048, untied head: 110M parameters) trains a few AdamW steps on random tokens under
torchrun with gloo on the CPU, the global batch (4 sequences of 128 tokens) split over the
processes. Each process counts the bytes of the tensors it holds itself: its parameters, their
gradients after the backward and AdamW's two moments (for FSDP the local shards of each DTensor,
for DDP the whole tensors; DDP's gradient buckets, a second copy of the gradients, are not
counted). Also per process: the peak of torch's CPU allocator during one forward + backward
above what existed before it (benchmarks/_util.py: the activations, the gathered weights of
FSDP's units and the unsharded gradients before their reduce-scatter), with and without
activation checkpointing, and the step time (forward, backward, clipping, AdamW; the slowest
process, median of the timed steps).

Usage:
  python benchmarks/distributed.py --markdown        # 1, 2 and 4 processes, the 110M model
  python benchmarks/distributed.py --quick           # a tiny model, FSDP in 2 processes (smoke test)
The script launches torchrun itself, once per row (``--worker`` is that row's process).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import fmt_mib, peak_memory, render_table  # noqa: E402

from attnlab.models.llama import Llama, LlamaConfig  # noqa: E402

FULL = dict(vocab_size=16384, d_model=768, num_heads=12, num_layers=12, d_ff=2048, max_position_embeddings=128)
QUICK = dict(vocab_size=512, d_model=64, num_heads=4, num_layers=2, d_ff=128, max_position_embeddings=16)
ROWS = [(1, "none", False), (2, "DDP", False), (2, "FSDP", False), (2, "FSDP", True), (4, "DDP", False),
        (4, "FSDP", False)]
QUICK_ROWS = [(2, "FSDP", False)]


def local_bytes(tensors) -> int:
    """Bytes of the tensors this process holds: a DTensor's local shard, a plain tensor whole."""
    total = 0
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def worker(args) -> None:
    from attnlab.train import TrainConfig
    from attnlab.train.distributed import init_distributed, shutdown, wrap_model
    from attnlab.train.optim import build_optimizer
    from attnlab.train.sharded import shard_model
    env = init_distributed("cpu")
    sizes = QUICK if args.quick else FULL
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**sizes))
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing = args.checkpointing
    wrapped = shard_model(model, env) if args.wrapper == "FSDP" else wrap_model(model, env)
    optimizer = build_optimizer(model, TrainConfig(out_dir=tempfile.gettempdir(), steps=1, lr=1e-4))
    per_rank = args.batch // env.world_size
    g = torch.Generator().manual_seed(1 + env.rank)
    ids = torch.randint(0, sizes["vocab_size"], (per_rank, args.length + 1), generator=g)

    def forward_backward() -> None:
        logits = wrapped(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()

    def step() -> None:
        forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(args.steps):
        if env.active:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if env.active:
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        if i > 0:                       # the first step allocates AdamW's state and DDP's buckets
            times.append(float(elapsed))
    peak = peak_memory(forward_backward)
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    row = {"processes": env.world_size, "wrapper": args.wrapper, "checkpointing": args.checkpointing,
           "parameters": n_params, "param_bytes": local_bytes(model.parameters()), "grad_bytes": grads,
           "adam_bytes": local_bytes(t for s in optimizer.state.values() for t in s.values() if t.dim()),
           "peak_fwd_bwd_bytes": peak, "step_s": statistics.median(times),
           "tokens_per_s": args.batch * args.length / statistics.median(times)}
    rows = [None] * env.world_size
    if env.active:
        torch.distributed.all_gather_object(rows, row)
    else:
        rows = [row]
    if env.is_main:                     # the largest of the processes (they differ by uneven slices)
        worst = {k: max(r[k] for r in rows) if isinstance(row[k], (int, float)) and not isinstance(row[k], bool)
                 else row[k] for k in row}
        Path(args.worker).write_text(json.dumps(worst))
    shutdown(env)


def launch(processes: int, wrapper: str, checkpointing: bool, args, out: Path) -> dict:
    """One row: torchrun with ``processes`` processes, each with its share of the cores' threads."""
    threads = max(1, (os.cpu_count() or 1) // processes)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(processes),
           __file__, "--worker", str(out), "--wrapper", wrapper, "--steps", str(args.steps), "--batch",
           str(args.batch), "--length", str(args.length)] + (["--checkpointing"] if checkpointing else []) + (
           ["--quick"] if args.quick else [])
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks/distributed.py: {processes} x {wrapper} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(out.read_text()), threads=threads)


def state_bytes(row: dict) -> int:
    return row["param_bytes"] + row["grad_bytes"] + row["adam_bytes"]


def table(rows: list[dict], markdown: bool) -> str:
    """One line a row; "state / 16 P" is the process's parameters, gradients and moments against one
    whole fp32 copy of them (4 + 4 + 8 bytes a parameter), "step / DDP" its step time against DDP
    (or one process) at the same number of processes."""
    ddp = {r["processes"]: r for r in rows if r["wrapper"] in ("DDP", "none")}
    body = [[r["processes"], r["wrapper"] + (" + checkpointing" if r["checkpointing"] else ""), r["threads"],
             fmt_mib(r["param_bytes"]), fmt_mib(r["grad_bytes"]), fmt_mib(r["adam_bytes"]), fmt_mib(state_bytes(r)),
             f"{state_bytes(r) / (16 * r['parameters']):.3f}", fmt_mib(r["peak_fwd_bwd_bytes"]), f"{r['step_s']:.2f}",
             f"{r['step_s'] / ddp[r['processes']]['step_s']:.2f}" if r["processes"] in ddp else "-",
             f"{r['tokens_per_s']:.0f}"] for r in rows]
    headers = ["processes", "wrapper", "threads each", "params MiB", "grads MiB", "AdamW MiB", "state MiB",
               "state / 16 P", "peak fwd+bwd MiB", "step s", "step / DDP", "tokens/s"]
    return render_table(headers, body, markdown=markdown)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model, FSDP in 2 processes")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--steps", type=int, default=3, help="training steps per row (the first is not timed)")
    p.add_argument("--batch", type=int, default=4, help="global batch, sequences")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--wrapper", default="none", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.length = min(args.length, QUICK["max_position_embeddings"])
    if args.worker:
        return worker(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (processes, wrapper, checkpointing) in enumerate(QUICK_ROWS if args.quick else ROWS):
            rows.append(launch(processes, wrapper, checkpointing, args, Path(tmp) / f"row{i}.json"))
    n = rows[0]["parameters"]
    print(f"LLaMA-shaped, {n / 1e6:.1f}M parameters; global batch {args.batch} x {args.length} tokens; "
          f"{args.steps} steps a row (median of the last {args.steps - 1}); torch {torch.__version__}, gloo, "
          f"{os.cpu_count()} CPUs")
    print(table(rows, args.markdown))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
