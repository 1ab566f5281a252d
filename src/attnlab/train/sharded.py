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
optimizer state's tensors into one temporary directory, through ``torch.distributed.checkpoint``
with its safetensors storage (``shards/shard-0000R-model-00001-of-00001.safetensors``, each
tensor's offset in the whole written in the file's header: nothing is pickled, which DCP's
default ``.metadata`` file would be). After a barrier rank 0 adds the trainer state (with the
optimizer's param groups and non-tensor state as JSON) and the assets, the manifest, and
renames the directory into place and moves ``latest``, as for any checkpoint
(:meth:`attnlab.train.checkpoint.CheckpointManager.finalise`). A run killed before that rename
leaves ``latest`` naming the previous complete step, and the next run sweeps the temporary
away. :func:`load_sharded` reads the shards back into a sharded model and optimizer, each rank
the parts it holds; :func:`load_gathered` puts the whole weights together in one process
(``attnlab generate``, ``export``, ``eval`` on a sharded run).
"""
from __future__ import annotations

import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from torch import Tensor, nn
from torch.optim import Optimizer

from .checkpoint import SHARDS_DIR, CheckpointManager, read_checkpoint_state
from .distributed import DistEnv, barrier

__all__ = ["shard_model", "transformer_blocks", "skip_gradient_sync", "save_sharded", "load_sharded",
           "full_state_dict", "load_gathered", "SHARDS_DIR"]


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
    from torch.distributed.fsdp import fully_shard    # here: it takes about a second to import
    for block in transformer_blocks(model):
        fully_shard(block)
    fully_shard(model)
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
    import torch.distributed.checkpoint as dcp
    _, optim_sd, parts = _split(model, optimizer)
    writer = dcp.HuggingFaceStorageWriter(str(staged / SHARDS_DIR), save_distributed=True)   # one file per rank
    dcp.save(parts["tensors"], storage_writer=writer)
    barrier(env)                                 # every rank's shards are on disk before the step is made final
    if env.is_main:
        groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]]
        state = dict(state, optimizer={"param_groups": groups, "scalars": parts["scalars"]})
        manager.finalise(step, staged, state, assets, is_best)
    barrier(env)
    return Path(out_dir) / name


def load_sharded(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None) -> dict:
    """Load a sharded checkpoint into the sharded ``model`` (and ``optimizer``): every rank reads
    the parts of the shards it holds, whatever the number of processes that wrote them. Returns
    the trainer state dict as :func:`attnlab.train.checkpoint.load_checkpoint` does."""
    ckpt, state = read_checkpoint_state(path, with_optimizer=optimizer is not None)
    if not (ckpt / SHARDS_DIR).is_dir():
        raise ValueError(f"{ckpt}: written by a run without --shard (no {SHARDS_DIR}/); resume it without --shard")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    _, optim_sd, parts = _split(model, optimizer)
    if optimizer is not None and len(state["optimizer"]["param_groups"]) != len(optim_sd["param_groups"]):
        raise ValueError(f"{ckpt}: {len(state['optimizer']['param_groups'])} optimizer param groups, the optimizer "
                         f"has {len(optim_sd['param_groups'])}")
    dcp.load(parts["tensors"], storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / SHARDS_DIR)))
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
