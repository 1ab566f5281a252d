"""Data-parallel training under torchrun: process group, DDP wrapping, plan sharding.

``torchrun --nproc_per_node N script.py`` sets RANK, LOCAL_RANK and WORLD_SIZE; the Trainer
calls :func:`init_distributed`, which joins the group (NCCL on CUDA, gloo on CPU) when
WORLD_SIZE > 1 and does nothing otherwise, so the same script runs alone or under torchrun.
Rank 0 alone logs and writes checkpoints (of a sharded run every rank writes its shards:
:mod:`attnlab.train.sharded`); the others wait at barriers.

Every rank must run the same number of optimizer steps, or the gradient all-reduce hangs:
:func:`shard_plan` gives each rank exactly ``len(plan) // world_size`` entries even when a
length-bucketed plan does not divide evenly (NeMo Automodel PR#3473
met the hang that uneven shards cause).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["DistEnv", "init_distributed", "shard_plan", "wrap_model", "unwrap_model", "all_reduce_sum",
           "all_gather_bytes", "barrier", "shutdown"]


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: rank, world size, its device, and whether a group is active."""
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False   # True if init_distributed created the process group

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def init_distributed(device: str | torch.device | None = None) -> DistEnv:
    """Join the torchrun process group if WORLD_SIZE > 1 (gloo on CPU, NCCL on CUDA).

    ``device`` None or "auto" means cuda:LOCAL_RANK when CUDA is present, else CPU. An
    already initialised group is reused (and left alone by :func:`shutdown`).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = _pick_device(device, local_rank)
    if dev.type == "cuda":  # the current device: autocast, RNG state and NCCL use it
        torch.cuda.set_device(dev)
    if world <= 1 and not dist.is_initialized():
        return DistEnv(device=dev)
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
        owns = True
    return DistEnv(rank=dist.get_rank(), local_rank=local_rank, world_size=dist.get_world_size(), device=dev,
                   owns_group=owns)


def shard_plan(plan: list, rank: int, world_size: int) -> list:
    """This rank's share of an epoch plan: entries rank, rank + W, rank + 2W, ...

    Every rank gets exactly ``len(plan) // W`` entries (the last ``len(plan) % W`` are
    dropped), so all ranks take the same number of steps. With a strided share, global
    micro-batch j of the plan is trained in the same step whatever W is, which is what
    makes N processes equal one process with the same global batch.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_plan: bad rank {rank} for world size {world_size}")
    per_rank = len(plan) // world_size
    return list(plan[rank: per_rank * world_size: world_size])


def wrap_model(model: nn.Module, env: DistEnv, find_unused_parameters: bool = False) -> nn.Module:
    """DistributedDataParallel around ``model`` when the group is active, else ``model`` (FSDP2
    instead: :func:`attnlab.train.sharded.shard_model`)."""
    if not env.active:
        return model
    ids = [env.device.index] if env.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused_parameters)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside a DDP wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def all_reduce_sum(tensor: Tensor, env: DistEnv) -> Tensor:
    """In-place sum over ranks (no-op alone). NCCL needs the tensor on the rank's GPU."""
    if env.active:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_bytes(data: bytes, env: DistEnv) -> list[bytes]:
    """Gather a byte string from every rank (rank order), as padded uint8 tensors: no pickle."""
    if not env.active:
        return [data]
    dev = env.device if env.device.type == "cuda" else torch.device("cpu")
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(env.world_size)]
    dist.all_gather(sizes, size)
    longest = int(max(int(s) for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.zeros_like(buf) for _ in range(env.world_size)]
    dist.all_gather(bufs, buf)
    return [b[: int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def barrier(env: DistEnv) -> None:
    """Wait for every rank (no-op alone)."""
    if env.active:
        dist.barrier()


def shutdown(env: DistEnv) -> None:
    """Leave the process group if :func:`init_distributed` created it."""
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()
