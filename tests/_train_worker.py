"""A tiny translation-like task for the Trainer tests, runnable as a script (alone or under torchrun).

Task: reverse a random token sequence. Sources have random lengths and are padded with
PAD = 0, so the target token counts differ between batches and ignore_index matters.
Model: attnlab's Transformer with d_model 16, one encoder and one decoder layer, tied
embeddings. ``--model gpt2`` / ``llama`` trains a tiny causal LM (GPT-2 with its tied head, or
LLaMA) on random padded token sequences instead (:class:`NextTokenTask`); ``--shard`` trains
under FSDP2 (attnlab.train.sharded).

    python tests/_train_worker.py --out DIR --steps 10 [--resume] [--hang-at-loss-call N] ...
    torchrun --standalone --nproc_per_node 2 tests/_train_worker.py --out DIR --micro 2 ...
    torchrun --standalone --nproc_per_node 2 tests/_train_worker.py --model llama --shard --out DIR ...
    torchrun --standalone --nproc_per_node 2 tests/_train_worker.py cli 1 4 train lm --shard ...   # attnlab's CLI
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.models import Transformer
from attnlab.train import TrainConfig, Trainer, count_tokens, label_smoothed_cross_entropy
from attnlab.train.trainer import TrainingInterrupted

PAD, BOS, EOS, VOCAB = 0, 1, 2, 13
MAX_LEN = 7


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src (n, MAX_LEN), tgt_in (n, MAX_LEN + 1), tgt_out (n, MAX_LEN + 1)), PAD-padded."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((n, MAX_LEN), PAD)
    tgt_out = torch.full((n, MAX_LEN + 1), PAD)
    lengths = torch.randint(1, MAX_LEN + 1, (n,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        seq = torch.randint(3, VOCAB, (length,), generator=g)
        src[i, :length] = seq
        tgt_out[i, :length] = seq.flip(0)
        tgt_out[i, length] = EOS
    tgt_in = torch.cat([torch.full((n, 1), BOS), tgt_out[:, :-1]], dim=1)
    return src, tgt_in, tgt_out


class ReverseTask:
    """Implements attnlab.train.Task. Micro-batches are (src, tgt_in, tgt_out) tuples."""

    def __init__(self, n_examples: int = 64, micro: int = 8, dropout: float = 0.1, model_seed: int = 0,
                 smoothing: float = 0.1, hang_at_loss_call: int | None = None, hang_marker: Path | None = None,
                 wait_for_signal_at: int | None = None):
        self.data = make_data(n_examples, seed=1234)
        self.val = make_data(16, seed=4321)
        self.micro, self.smoothing = micro, smoothing
        torch.manual_seed(model_seed)
        self.model = Transformer(VOCAB, VOCAB, d_model=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1,
                                 d_ff=32, max_seq_len=16, dropout=dropout, pad_id=PAD, tie_output=True,
                                 share_embeddings=True)
        self.loss_calls, self.hang_at, self.hang_marker = 0, hang_at_loss_call, hang_marker
        self.wait_for_signal_at, self.trainer = wait_for_signal_at, None

    def plan(self, epoch: int, seed: int) -> list:
        g = torch.Generator().manual_seed(seed * 7919 + epoch)
        perm = torch.randperm(len(self.data[0]), generator=g)
        chunks = [perm[i: i + self.micro] for i in range(0, len(perm) - self.micro + 1, self.micro)]
        return [tuple(t[idx] for t in self.data) for idx in chunks]

    def loss(self, model, batch):
        self.loss_calls += 1
        if self.hang_at is not None and self.loss_calls == self.hang_at:
            self.hang_marker.write_text(str(self.loss_calls))
            time.sleep(600)  # the test SIGKILLs us here, mid-step, after a checkpoint
        if self.wait_for_signal_at is not None and self.loss_calls == self.wait_for_signal_at:
            self.hang_marker.write_text(str(self.loss_calls))
            deadline = time.monotonic() + 120
            while self.trainer.interrupted is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the test sends SIGINT or SIGTERM here, mid-step
        src, tgt_in, tgt_out = batch
        logits = model(src, tgt_in)
        loss_sum = label_smoothed_cross_entropy(logits, tgt_out, self.smoothing, ignore_index=PAD, reduction="sum")
        real = tgt_out != PAD
        correct = ((logits.argmax(-1) == tgt_out) & real).sum()
        return loss_sum, count_tokens(tgt_out, PAD), {"correct": correct}

    def evaluate(self, model):
        src, tgt_in, tgt_out = (t.to(next(model.parameters()).device) for t in self.val)
        logits = model(src, tgt_in)
        return {"val_loss": float(label_smoothed_cross_entropy(logits, tgt_out, 0.0, PAD, reduction="mean"))}

    def save_assets(self, directory: Path) -> None:
        (directory / "vocab.txt").write_text("\n".join(str(i) for i in range(VOCAB)))


class NextTokenTask:
    """Next-token prediction on random sequences of 2..8 tokens, right-padded (targets -100 there,
    so micro-batches differ in their target-token counts), with a tiny GPT-2 or LLaMA."""

    def __init__(self, family: str, n_examples: int = 32, micro: int = 8, model_seed: int = 0):
        from attnlab.models.gpt import GPT, GPTConfig
        from attnlab.models.llama import Llama, LlamaConfig
        g = torch.Generator().manual_seed(99)
        self.ids = torch.zeros(n_examples, 8, dtype=torch.long)
        self.targets = torch.full((n_examples, 8), -100)
        for i, length in enumerate(torch.randint(2, 9, (n_examples,), generator=g).tolist()):
            seq = torch.randint(1, VOCAB, (length + 1,), generator=g)
            self.ids[i, :length], self.targets[i, :length] = seq[:-1], seq[1:]
        self.micro = micro
        torch.manual_seed(model_seed)
        if family == "gpt2":
            self.model = GPT(GPTConfig(vocab_size=VOCAB, n_positions=16, d_model=16, num_heads=2, num_layers=2,
                                       dropout=0.0))
        else:
            self.model = Llama(LlamaConfig(vocab_size=VOCAB, d_model=16, num_heads=2, num_kv_heads=1, num_layers=2,
                                           d_ff=32, max_position_embeddings=16))

    def plan(self, epoch: int, seed: int) -> list:
        perm = torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        return [(self.ids[perm[i: i + self.micro]], self.targets[perm[i: i + self.micro]])
                for i in range(0, len(perm) - self.micro + 1, self.micro)]

    def loss(self, model, batch):
        ids, targets = batch
        logits = model(ids)
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return loss_sum, int((targets != -100).sum()), {}

    def evaluate(self, model):
        logits = model(self.ids[:8])
        return {"val_loss": float(F.cross_entropy(logits.reshape(-1, VOCAB), self.targets[:8].reshape(-1)))}


def _kill_after_shards(step: int) -> None:
    """SIGKILL rank 1 once it has written its shards of ``step``, before rank 0 completes the step."""
    import os
    import signal

    import torch.distributed.checkpoint as dcp
    save = dcp.save

    def save_then_die(state, storage_writer):
        save(state, storage_writer=storage_writer)
        if f"step-{step:07d}" in str(storage_writer.path) and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
    dcp.save = save_then_die


def _fail_write(rank: int, step: int) -> None:
    """Rank ``rank`` cannot write its shards of ``step``: the storage raises EROFS, as a read-only
    directory on that rank's machine would."""
    import errno
    import os

    import torch.distributed.checkpoint as dcp
    write = dcp.HuggingFaceStorageWriter.write_data

    def refuse(self, plan, planner):
        if f"step-{step:07d}" in str(self.path) and os.environ.get("RANK") == str(rank):
            raise OSError(errno.EROFS, "Read-only file system", str(self.path))
        return write(self, plan, planner)
    dcp.HuggingFaceStorageWriter.write_data = refuse


def _record(trainer, path: Path) -> None:
    """Train, and write (rank 0) record.json: the dtype the first block's first linear layer computes
    with, how many times that block ran forward during training (twice a micro-batch when its
    activations are recomputed in the backward), and after one more backward the dtypes of the
    stored (sharded) weight, of its gradient and of the optimizer's tensors."""
    import json
    block = trainer.model.layers[0]
    linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    seen = {"block_forwards": 0}

    def count(module, inputs):
        seen["block_forwards"] += 1

    def compute_dtype(module, inputs):
        seen.setdefault("compute", str(module.weight.dtype))

    hooks = [linear.register_forward_pre_hook(compute_dtype), block.register_forward_pre_hook(count)]
    trainer.fit()
    for hook in hooks:
        hook.remove()
    batch = trainer._epoch_plan(0)[0]
    with trainer._autocast():
        loss, _, _ = trainer.task.loss(trainer.ddp_model, batch)
    loss.backward()
    seen.update(stored=str(linear.weight.dtype), grad=str(linear.weight.grad.dtype),
                optimizer=sorted({str(t.dtype) for st in trainer.optimizer.state.values() for t in st.values()
                                  if t.dim()}))
    if trainer.env.is_main:
        (path / "record.json").write_text(json.dumps(seen))


def _dump_weights(trainer, path: Path) -> None:
    """The whole weights into ``path`` (rank R of an unsharded run: rank<R>; a sharded run: gathered, rank 0)."""
    from safetensors.torch import save_file, save_model
    if not trainer.config.shard:
        save_model(trainer.model, str(path / f"rank{trainer.env.rank}.safetensors"))
        return
    from attnlab.train.sharded import full_state_dict
    full = full_state_dict(trainer.model)
    if trainer.env.is_main:
        save_file({k: v.clone().contiguous() for k, v in full.items()}, str(path / "rank0.safetensors"))


def _load_resharded(args, checkpoint: Path) -> None:
    """Load a sharded checkpoint into this many processes (it may have been written by another
    number) and write, on rank 0, the whole weights and optimizer tensors as they now are."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from attnlab.train.distributed import init_distributed, shutdown
    from attnlab.train.optim import build_optimizer
    from attnlab.train.sharded import full_state_dict, load_sharded, shard_model
    env = init_distributed("cpu")
    task = NextTokenTask(args.model, args.n_examples, args.micro)
    model = shard_model(task.model, env)
    optimizer = build_optimizer(model, TrainConfig(out_dir=args.out, steps=1, lr=args.lr))
    load_sharded(checkpoint, model, optimizer)
    weights = full_state_dict(model)
    whole = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
    if env.is_main:
        moments = {f"optimizer.{name}.{slot}": t for name, slots in whole["state"].items()
                   for slot, t in slots.items() if slot != "step"}
        tensors = {**{f"model.{k}": v for k, v in weights.items()}, **moments}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(Path(args.out) / "loaded.safetensors"))
    shutdown(env)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["cli"]:           # cli RANK STEP ARGS...: `attnlab ARGS` with _fail_write(RANK, STEP)
        from attnlab.cli import main as attnlab
        _fail_write(int(argv[1]), int(argv[2]))
        sys.exit(attnlab(argv[3:]))
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--n-examples", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--schedule", default="noam")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--hang-at-loss-call", type=int)
    p.add_argument("--wait-for-signal-at-loss-call", type=int)
    p.add_argument("--dump-weights", action="store_true", help="each rank writes rank<R>.safetensors")
    p.add_argument("--model", default="reverse", choices=("reverse", "gpt2", "llama"))
    p.add_argument("--shard", action="store_true")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--kill-after-shards-at", type=int, help="rank 1 dies in the save of this step")
    p.add_argument("--fail-write", type=int, nargs=2, metavar=("RANK", "STEP"), help="RANK cannot write STEP")
    p.add_argument("--record", action="store_true", help="write record.json (see _record)")
    p.add_argument("--grad-checkpointing", action="store_true")
    p.add_argument("--load-resharded", type=Path, help="only load this sharded checkpoint; --out gets what loaded")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.load_resharded is not None:
        return _load_resharded(args, args.load_resharded)
    if args.model == "reverse":
        task = ReverseTask(args.n_examples, args.micro, args.dropout, hang_at_loss_call=args.hang_at_loss_call,
                           hang_marker=out.parent / f"{out.name}.hanging",
                           wait_for_signal_at=args.wait_for_signal_at_loss_call)
    else:
        task = NextTokenTask(args.model, args.n_examples, args.micro)
    if args.kill_after_shards_at is not None:
        _kill_after_shards(args.kill_after_shards_at)
    if args.fail_write is not None:
        _fail_write(*args.fail_write)
    cfg = TrainConfig(out_dir=out, steps=args.steps, lr=args.lr, schedule=args.schedule, warmup_steps=args.warmup,
                      accum_steps=args.accum, save_every=args.save_every, eval_every=args.eval_every,
                      log_every=args.log_every, precision=args.precision, device=args.device, progress=False,
                      seed=7, clip_norm=args.clip or None, shard=args.shard,
                      grad_checkpointing=args.grad_checkpointing)
    trainer = task.trainer = Trainer(task, cfg, resume=args.resume)
    try:
        _record(trainer, out) if args.record else trainer.fit()
    except TrainingInterrupted as e:
        sys.exit(e.exit_code)
    if args.dump_weights:
        _dump_weights(trainer, out)
    trainer.close()


if __name__ == "__main__":
    main()
