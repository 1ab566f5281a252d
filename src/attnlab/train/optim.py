"""The optimizers (AdamW, or Adafactor for T5) with the parameter groups every attnlab model trains
with: decay on matrices only, and never on what a module declares must not decay."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["split_decay", "no_decay_parameters", "lr_scales", "param_groups", "build_optimizer", "OPTIMIZERS"]

OPTIMIZERS = ("adamw", "adafactor")

# torch's own tables and norms, which cannot declare no_weight_decay(): their parameters never decay
_TORCH_EXEMPT: tuple[type, ...] = (nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.GroupNorm,
                                   nn.modules.batchnorm._NormBase)
if hasattr(nn, "RMSNorm"):
    _TORCH_EXEMPT += (nn.RMSNorm,)


def no_decay_parameters(model: nn.Module) -> set[int]:
    """The ids of the parameters that must not decay, as their modules declare them.

    A module declares them with a ``no_weight_decay()`` method returning the names of its
    parameters (relative to the module), as timm's models do: attnlab's norms (their gains and
    shifts set the scale of what they normalise; pulling them towards 0 fights that), learned
    position tables, class and distillation tokens, a state-space model's ``A_log`` and ``D``
    (decaying them drags the dynamics towards a fixed decay rate). torch's embeddings and norms,
    which cannot declare, are exempt whole. A declared name the module lacks is an error.
    """
    exempt = {id(p) for module in model.modules() if isinstance(module, _TORCH_EXEMPT)
              for p in module.parameters(recurse=False)}
    exempt.update(id(p) for _, _, _, p, _ in _declared(model, "no_weight_decay"))
    return exempt


def _declared(model: nn.Module, method: str):
    """(prefix, module, name, parameter, value) for each parameter that a module names through its
    ``method()``: a tuple of names, or a ``{name: value}`` dict (value None for a tuple). A name
    the module lacks is an error that names the module."""
    for prefix, module in model.named_modules():
        declare = getattr(module, method, None)
        if not callable(declare):
            continue
        declared = declare()
        for name, value in (declared.items() if isinstance(declared, dict) else ((n, None) for n in declared)):
            try:
                param = module.get_parameter(name)
            except AttributeError:
                raise ValueError(f"{type(module).__name__} ({prefix or 'the model'}): {method}() names "
                                 f"{name!r}, which is not one of its parameters") from None
            yield prefix, module, name, param, value


def split_decay(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(decayed, not decayed) trainable parameters, each listed once.

    Not decayed: what :func:`no_decay_parameters` collects (each module's ``no_weight_decay()``,
    torch's embeddings and norms) and every parameter with fewer than 2 dimensions (biases,
    gains, scalars). A weight tied between an embedding and a linear layer is one parameter,
    listed once, not decayed: the embedding exempts it, and decaying it through the head would
    shrink the embedding as well.
    """
    exempt = no_decay_parameters(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # remove_duplicate=True: a tied weight appears once
        if p.requires_grad:
            (no_decay if id(p) in exempt or p.ndim < 2 else decay).append((name, p))
    return decay, no_decay


def lr_scales(model: nn.Module) -> dict[int, float]:
    """The ids of the parameters that train at a multiple of the learning rate, with the multiple.

    A module declares them with an ``lr_scale()`` method returning ``{name: multiple}`` for its
    own parameters, as :class:`~attnlab.nn.norm.DyT` does for its alpha when asked to
    (``DyT.alpha_lr_scale``). A multiple that is not a positive number, or a name the module
    lacks, is an error. Parameters no module names train at the learning rate itself.
    """
    scales: dict[int, float] = {}
    for prefix, module, name, param, scale in _declared(model, "lr_scale"):
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
            raise ValueError(f"{type(module).__name__} ({prefix or 'the model'}): lr_scale() gives {name!r} the "
                             f"multiple {scale!r}; it must be a positive number")
        scales[id(param)] = float(scale)
    return scales


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The AdamW param groups: decayed matrices, then undecayed norms/biases/embeddings, then one
    group per (decay, learning-rate multiple) that a module asks for (:func:`lr_scales`), each of
    those with its ``"lr_scale"`` (:func:`build_optimizer` multiplies the lr by it). The first two
    are always there, so a model without multiples has exactly those two, as it always had."""
    decay, no_decay = split_decay(model)
    scales = lr_scales(model)
    groups = [{"params": [p for _, p in decay if id(p) not in scales], "weight_decay": weight_decay},
              {"params": [p for _, p in no_decay if id(p) not in scales], "weight_decay": 0.0}]
    extra: dict[tuple[float, float], list] = {}
    for wd, params in ((weight_decay, decay), (0.0, no_decay)):
        for _, p in params:
            if id(p) in scales:
                extra.setdefault((wd, scales[id(p)]), []).append(p)
    groups += [{"params": ps, "weight_decay": wd, "lr_scale": scale} for (wd, scale), ps in extra.items()]
    return groups


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
    either way; on a CPU the step of a 56M-parameter model took about 4x less time fused
    (benchmarks/seq2seq.py, benchmarks/results/code.md). Build it after moving the model
    to its device, as the Trainer does.
    """
    groups = param_groups(model, config.weight_decay)
    for group in groups:
        if "lr_scale" in group:                      # the schedule then scales this lr like the others
            group["lr"] = config.lr * group["lr_scale"]
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
