"""The optimizers (AdamW, or Adafactor for T5) with the parameter groups every attnlab model trains
with: decay on matrices only."""
from __future__ import annotations

import torch
from torch import nn

from ..nn.norm import DyT, LayerNorm, RMSNorm

__all__ = ["split_decay", "param_groups", "build_optimizer", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "adafactor")

_NORMS: tuple[type, ...] = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, LayerNorm, RMSNorm, DyT)
if hasattr(nn, "RMSNorm"):
    _NORMS += (nn.RMSNorm,)


def split_decay(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decayed, not decayed) trainable parameters, each listed once (pitfall 16).

    Not decayed: parameters of embeddings and norm layers (nn.Embedding, torch's and
    attnlab's LayerNorm/RMSNorm/DyT, GroupNorm, BatchNorm) and every parameter with
    fewer than 2 dimensions (biases, gains, scalars). A weight tied between an embedding and
    a linear layer is one parameter, listed once, not decayed (the embedding wins).
    """
    exempt: set[int] = set()
    for module in model.modules():
        owned = module.parameters(recurse=False)
        if isinstance(module, (nn.Embedding, *_NORMS)):
            exempt.update(id(p) for p in owned)
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied weight appears once
        if p.requires_grad:
            (no_decay if id(p) in exempt or p.ndim < 2 else decay).append((name, p))
    return decay, no_decay


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW param groups: decayed matrices and undecayed norms/biases/embeddings."""
    decay, no_decay = split_decay(model)
    return [{"params": [p for _, p in decay], "weight_decay": weight_decay},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, config) -> torch.optim.Optimizer:
    """The TrainConfig's ``optimizer`` over the groups of :func:`param_groups`: AdamW (lr, betas,
    eps, weight_decay) with decoupled weight decay, or Adafactor.

    Adafactor (Shazeer and Stern 2018; torch.optim.Adafactor) is what T5 was trained with: no
    momentum, factored second moments, and each step relative to the weight's own scale, RMS(w)
    times min(lr, 1/sqrt(t)). That matters for T5, whose embedding starts N(0, 1) while its matrices
    start at ~d_model^-1/2: under AdamW's absolute steps the embedding (which is also the input of
    every layer) moves ~10x slower than the rest. On the embedded translation corpus, 400 steps:
    BLEU 98.4 with Adafactor (lr 0.05, no weight decay) against 27.8 with AdamW (lr 2e-3), and on
    Multi30k, 300 steps: 14.2 against 5.8 (docs/t5.md).

    Fused (one kernel pass over parameters, gradients and both moments, instead of about a
    dozen passes) when torch has a fused AdamW for every parameter's device and dtype;
    otherwise torch's default (a per-parameter loop on CPU, foreach on CUDA). Same update rule
    either way; on this project's 2-core CPU the step of a 56M-parameter model takes about
    4x less time fused (190 -> 42 ms; benchmarks/seq2seq.py). Build it after moving the model
    to its device, as the Trainer does.
    """
    groups = param_groups(model, config.weight_decay)
    if config.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=config.lr)
    params = [p for g in groups for p in g["params"]]
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:                 # older torch: fused AdamW on CUDA only
        devices = {"cuda"}
    floats = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    fused = bool(params) and all(p.device.type in devices and p.dtype in floats for p in params)
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             **({"fused": True} if fused else {}))
