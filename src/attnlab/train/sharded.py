"""Sharded training (FSDP2) and sharded checkpoints (torch.distributed.checkpoint).

Under ``torchrun`` with ``TrainConfig(shard=True)`` (``attnlab train TASK --shard``) each
process keeps 1/W of every parameter, of its gradient and of the optimizer's state instead of
a whole copy: :func:`shard_model` hands each transformer block (the entries of the model's
layer lists) and then the whole model to PyTorch's ``fully_shard``. A block's parameters are
gathered just before its forward and its backward and dropped after; its gradients are
reduce-scattered, averaged over the ranks as DDP averages them, so the Trainer's loss
normalisation (multiply by W / N, N the global target-token count) is the same for both.

- Parameters not in a block (embeddings, the final norm, the head) belong to the root's group.
  A weight shared between two modules (GPT-2's head tied to its token embedding) is one
  parameter there, so it stays tied; a block whose weights are also used outside it is left
  to the root group for the same reason.
- Accumulation: on all but the last micro-batch of a step :func:`skip_gradient_sync` turns the
  reduce-scatter off, so gradients accumulate unsharded and are reduced once per step.
- Clipping: ``torch.nn.utils.clip_grad_norm_`` on sharded (DTensor) gradients computes the
  norm over all shards, the same global norm one process would compute.
- Evaluation runs on every rank (a forward is collective: every rank must take part in each
  gather); rank 0 records the metrics.

Checkpoints: :func:`save_sharded` has every rank write its own shards of the weights and of the
optimizer state into one temporary directory (``dcp.save``, files ``shards/__R_0.distcp`` and
``shards/.metadata``); after a barrier rank 0 adds the trainer state and the assets, the
manifest, and renames the directory into place and moves ``latest``, as for any checkpoint
(:meth:`attnlab.train.checkpoint.CheckpointManager.finalise`). A run killed before that rename
leaves ``latest`` naming the previous complete step, and the next run sweeps the temporary
away. :func:`load_sharded` reads the shards back into the sharded model and optimizer.
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer

from .checkpoint import SHARDS_DIR, CheckpointManager, read_checkpoint_state
from .distributed import DistEnv, barrier

__all__ = ["shard_model", "transformer_blocks", "skip_gradient_sync", "save_sharded", "load_sharded",
           "full_state_dict", "SHARDS_DIR"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of the outermost ``nn.ModuleList``s that hold parameters, in order, leaving out
    any whose parameters are also used outside it (a tied weight belongs to the root group)."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(prefix) for prefix in inside):
            inside.append(f"{name}.")
            blocks += [b for b in module if any(True for _ in b.parameters())]
    return [b for b in blocks if not _used_outside(model, b)]


def _used_outside(model: nn.Module, block: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also registered on a module outside it."""
    mine = {id(p) for p in block.parameters()}
    within = {id(m) for m in block.modules()}
    return any(id(m) not in within and any(id(p) in mine for p in m.parameters(recurse=False))
               for m in model.modules())


def shard_model(model: nn.Module, env: DistEnv) -> nn.Module:
    """``fully_shard`` each transformer block of ``model`` and then ``model`` itself, in place;
    returns ``model`` (now also an FSDPModule). ValueError if there is only one process."""
    if not env.active:
        raise ValueError("TrainConfig: shard=True (--shard) splits the model over several processes and this is "
                         "one: run under torchrun --nproc_per_node N with N >= 2, or leave out --shard")
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model


@contextmanager
def skip_gradient_sync(model: nn.Module) -> Iterator[None]:
    """No gradient reduction in the backward passes inside: DDP's ``no_sync``, or FSDP's
    ``set_requires_gradient_sync(False)`` (restored on leaving)."""
    if not isinstance(model, FSDPModule):
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict(model: nn.Module) -> dict:
    """The whole (unsharded) weights of a sharded model on CPU, on rank 0 (empty elsewhere).
    Collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded(manager: CheckpointManager | None, out_dir: Path, step: int, model: nn.Module,
                 optimizer: Optimizer, state: dict, assets: Callable[[Path], None] | None, is_best: bool,
                 env: DistEnv) -> Path:
    """Checkpoint ``step`` of a sharded run (collective; ``manager`` is rank 0's). Returns the
    checkpoint directory on every rank."""
    name = f"step-{step:07d}"
    staged = Path(out_dir) / f".tmp-{name}-sharded"
    if env.is_main:
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
    barrier(env)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=staged / SHARDS_DIR)
    barrier(env)                                 # every rank's shards are on disk before the step is made final
    if env.is_main:
        manager.finalise(step, staged, state, assets, is_best)
    barrier(env)
    return Path(out_dir) / name


def load_sharded(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None) -> dict:
    """Load a sharded checkpoint into the sharded ``model`` (and ``optimizer``); returns the
    trainer state dict as :func:`attnlab.train.checkpoint.load_checkpoint` does."""
    ckpt, state = read_checkpoint_state(path, with_optimizer=True)
    if not (ckpt / SHARDS_DIR).is_dir():
        raise ValueError(f"{ckpt}: written by a run without --shard (no {SHARDS_DIR}/); resume it without --shard")
    if optimizer is None:
        model_sd = get_model_state_dict(model)
        dcp.load({"model": model_sd}, checkpoint_id=ckpt / SHARDS_DIR)
        set_model_state_dict(model, model_sd)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=ckpt / SHARDS_DIR)
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    state["path"] = str(ckpt)
    return state
