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
- Precision: under bf16 the units gather their weights in bf16 and reduce gradients in fp32
  (:func:`mixed_precision`); the sharded fp32 weights are the master copy AdamW updates.

Checkpoints: :func:`save_sharded` has every rank write its own shards of the weights and of the
optimizer state's tensors into one temporary directory, through ``torch.distributed.checkpoint``
with its safetensors storage (``shards/shard-0000R-model-00001-of-00001.safetensors``, each
tensor's offset in the whole written in the file's header: nothing is pickled, which DCP's
default ``.metadata`` file would be). Once every rank has said its shards are written, rank 0
adds the trainer state (with the optimizer's param groups and non-tensor state as JSON) and the
assets, the manifest, and renames the directory into place and moves ``latest``, as for any checkpoint
(:meth:`attnlab.train.checkpoint.CheckpointManager.finalise`). A run killed before that rename
leaves ``latest`` naming the previous complete step, and the next run sweeps the temporary
away. A rank whose part fails makes every rank raise :class:`ShardedSaveError` (each phase ends
in an exchange of outcomes, not a bare barrier a failed rank would never reach).
:func:`load_sharded` reads the shards back into a sharded model and optimizer, each rank the
parts it holds, at any number of processes, or whole into one process; :func:`load_gathered`
puts the whole weights together in one process (``attnlab generate``, ``export``, ``eval`` on a
sharded run).
"""
from __future__ import annotations

import errno
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .checkpoint import LATEST, SHARDS_DIR, CheckpointManager, read_checkpoint_state
from .distributed import DistEnv, all_gather_bytes

__all__ = ["shard_model", "mixed_precision", "ShardedSaveError", "transformer_blocks", "skip_gradient_sync",
           "save_sharded", "load_sharded",
           "full_state_dict", "load_gathered", "SHARDS_DIR"]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of the outermost ``nn.ModuleList``s that hold parameters, in order (an entry
    that is itself a list, such as ALBERT's groups of layers, gives its own entries: a list has no
    forward for FSDP to hook), leaving out any whose parameters are also used outside it (a tied
    weight belongs to the root group)."""
    blocks: list[nn.Module] = []
    inside: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(prefix) for prefix in inside):
            inside.append(f"{name}.")
            blocks += [b for b in _entries(module) if any(True for _ in b.parameters())]
    return [b for b in blocks if not _used_outside(model, b)]


def _entries(modules: nn.ModuleList) -> list[nn.Module]:
    return [b for m in modules for b in (_entries(m) if isinstance(m, nn.ModuleList) else [m])]


def _used_outside(model: nn.Module, block: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also registered on a module outside it."""
    mine = {id(p) for p in block.parameters()}
    within = {id(m) for m in block.modules()}
    return any(id(m) not in within and any(id(p) in mine for p in m.parameters(recurse=False))
               for m in model.modules())


def mixed_precision(precision: str):
    """FSDP's policy for the Trainer's ``precision``: under "bf16" each unit's gathered weights are
    cast to bf16, so its matmuls take bf16 operands and the all-gathers move half the bytes, while
    the gradients are reduced in fp32 (a sum over ranks in bf16 would lose their low bits) and the
    sharded weights that AdamW updates (the master copy), its moments and the checkpoints stay
    fp32. Other precisions: everything fp32 (fp16 keeps autocast and its GradScaler)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_model(model: nn.Module, env: DistEnv, precision: str = "fp32") -> nn.Module:
    """``fully_shard`` each transformer block of ``model`` and then ``model`` itself, in place, under
    :func:`mixed_precision` of ``precision``; returns ``model`` (now also an FSDPModule).
    ValueError if there is only one process."""
    if not env.active:
        raise ValueError("TrainConfig: shard=True (--shard) splits the model over several processes and this is "
                         "one: run under torchrun --nproc_per_node N with N >= 2, or leave out --shard")
    from torch.distributed.fsdp import fully_shard    # here: it takes about a second to import
    policy = mixed_precision(precision)
    for block in transformer_blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


@contextmanager
def skip_gradient_sync(model: nn.Module) -> Iterator[None]:
    """No gradient reduction in the backward passes inside: DDP's ``no_sync``, or FSDP's
    ``set_requires_gradient_sync(False)`` (restored on leaving)."""
    if not hasattr(model, "set_requires_gradient_sync"):      # not an FSDPModule
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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _tied(model: nn.Module) -> dict[str, str]:
    """Each further name of a shared parameter -> its first name (safetensors stores a tensor once)."""
    first: dict[int, str] = {}
    tied = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        first.setdefault(id(p), name)
    return tied


def _split(model: nn.Module, optimizer: Optimizer | None) -> tuple[dict, dict, dict]:
    """(the model and optimizer state dicts keyed by parameter name, the tensors to store: the
    model's without tied repeats and the optimizer's, the optimizer's non-tensor state by name)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    model_sd, optim_sd = get_state_dict(model, optimizer) if optimizer is not None else (
        get_model_state_dict(model), {"state": {}})
    tied = _tied(model)
    tensors = {"model": {k: v for k, v in model_sd.items() if k not in tied}, "optimizer": {}}
    scalars: dict[str, dict] = {}
    for name, slots in optim_sd["state"].items():
        for slot, value in slots.items():
            if isinstance(value, Tensor):
                tensors["optimizer"].setdefault(name, {})[slot] = value
            else:
                scalars.setdefault(name, {})[slot] = value
    return model_sd, optim_sd, {"tensors": tensors, "scalars": scalars}


class ShardedSaveError(OSError):
    """A rank could not write its part of a sharded checkpoint. Every rank raises it, with one line
    naming the run directory, the step, the rank and what the system said, and the checkpoint that
    ``--resume`` continues from."""

    def __init__(self, message: str, directory: Path):
        super().__init__(errno.EIO, message, str(directory))
        self.message = message

    def __str__(self) -> str:
        return self.message


def _together(env: DistEnv, out_dir: Path, step: int, action: Callable[[], object]) -> object:
    """Run ``action`` on this rank, then learn from every rank whether its part failed (the gather
    is also the barrier): a failure on one rank must stop all of them, since the others would wait
    at the next collective for ever. Raises :class:`ShardedSaveError` naming the lowest failed rank
    on every rank; a failure that is not an OSError (a bug) keeps its own traceback on its rank."""
    from torch.distributed.checkpoint.api import CheckpointException
    problem, error, result = "", None, None
    try:
        result = action()
    except CheckpointException as e:          # DCP hands every rank the failures of all of them
        rank, (error, _) = min(e.failures.items(), key=lambda item: item[0])
        problem = f"{rank}\t{error}"
        error = error if rank == env.rank else None
    except Exception as e:                    # noqa: BLE001 (re-raised below, on every rank)
        problem, error = f"{env.rank}\t{e}", e
    failed = sorted(p.decode() for p in all_gather_bytes(problem.encode(), env) if p)
    if not failed:
        return result
    if error is not None and not isinstance(error, OSError):
        raise error
    rank, what = failed[0].split("\t", 1)
    latest = Path(out_dir) / LATEST
    intact = (f"{Path(out_dir) / latest.read_text().strip()} is intact and --resume continues from it"
              if latest.is_file() else "there is no earlier checkpoint")
    raise ShardedSaveError(f"{out_dir}: rank {rank} could not write its part of the checkpoint of step {step} "
                           f"({' '.join(what.split())}); every rank stopped, {intact}", Path(out_dir)) from None


def save_sharded(manager: CheckpointManager | None, out_dir: Path, step: int, model: nn.Module,
                 optimizer: Optimizer, state: dict, assets: Callable[[Path], None] | None, is_best: bool,
                 env: DistEnv) -> Path:
    """Checkpoint ``step`` of a sharded run (collective; ``manager`` is rank 0's). Returns the
    checkpoint directory on every rank; :class:`ShardedSaveError` on every rank if any failed."""
    name = f"step-{step:07d}"
    staged = Path(out_dir) / f".tmp-{name}-sharded"

    def stage() -> None:
        if env.is_main:
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(parents=True)

    def write_shards() -> dict:
        import torch.distributed.checkpoint as dcp
        _, optim_sd, parts = _split(model, optimizer)
        writer = dcp.HuggingFaceStorageWriter(str(staged / SHARDS_DIR), save_distributed=True)   # one file per rank
        dcp.save(parts["tensors"], storage_writer=writer)
        return {"param_groups": optim_sd["param_groups"], "scalars": parts["scalars"]}

    def complete(saved: dict) -> None:
        if env.is_main:
            groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
                      for g in saved["param_groups"]]
            manager.finalise(step, staged, dict(state, optimizer=dict(saved, param_groups=groups)), assets, is_best)

    _together(env, out_dir, step, stage)
    saved = _together(env, out_dir, step, write_shards)   # every rank's shards are on disk before the step is final
    _together(env, out_dir, step, lambda: complete(saved))
    return Path(out_dir) / name


def load_sharded(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None) -> dict:
    """Load a sharded checkpoint into the sharded ``model`` (and ``optimizer``): every rank reads
    the parts of the shards it holds, whatever the number of processes that wrote them; without a
    process group, into a whole ``model`` in this one process. Returns the trainer state dict as
    :func:`attnlab.train.checkpoint.load_checkpoint` does."""
    ckpt, state = read_checkpoint_state(path, with_optimizer=optimizer is not None)
    if not (ckpt / SHARDS_DIR).is_dir():
        raise ValueError(f"{ckpt}: written by a run without --shard (no {SHARDS_DIR}/); resume it without --shard")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    _, optim_sd, parts = _split(model, optimizer)
    if optimizer is not None and len(state["optimizer"]["param_groups"]) != len(optim_sd["param_groups"]):
        raise ValueError(f"{ckpt}: {len(state['optimizer']['param_groups'])} optimizer param groups, the optimizer "
                         f"has {len(optim_sd['param_groups'])}")
    import torch.distributed as dist
    with warnings.catch_warnings():        # DCP warns when it loads in one process, which is then the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(parts["tensors"], storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / SHARDS_DIR)),
                 no_dist=not dist.is_initialized())
    stored = parts["tensors"]["model"]
    loaded = dict(stored, **{name: stored[first] for name, first in _tied(model).items()})
    if optimizer is None:
        set_model_state_dict(model, loaded)
    else:
        saved = state["optimizer"]
        slots = {name: dict(parts["tensors"]["optimizer"].get(name, {}), **saved["scalars"].get(name, {}))
                 for name in optim_sd["state"]}
        groups = [{k: (tuple(v) if isinstance(now.get(k), tuple) else v) for k, v in g.items()}
                  for g, now in zip(saved["param_groups"], optim_sd["param_groups"])]
        set_state_dict(model, optimizer, model_state_dict=loaded,
                       optim_state_dict={"state": slots, "param_groups": groups})
    state["path"] = str(ckpt)
    return state


def load_gathered(path: str | Path, model: nn.Module) -> None:
    """Load the weights of the sharded checkpoint ``path`` into the whole, unsharded ``model`` in
    this one process (no process group): each tensor is put together from every rank's shard."""
    import torch.distributed.checkpoint as dcp
    ckpt = Path(path)
    tied = _tied(model)
    target = {"model": {k: v for k, v in model.state_dict().items() if k not in tied}}
    # state_dict()'s tensors share the parameters' storage: dcp.load writes the weights into the model
    with warnings.catch_warnings():        # DCP warns that it loads in one process, which is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / SHARDS_DIR)), no_dist=True)
