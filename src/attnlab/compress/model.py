"""Whole models: calibration statistics, quantisation, pruning and GGUF export.

Which layers (the choices made here):
- every ``nn.Linear`` of the model is quantised at ``bits`` / ``group_size`` / ``method``, except
  the output head and a mixture-of-experts router;
- the output head is quantised round-to-nearest to q8_0 (8 bits, groups of 32), as llama.cpp's
  Q4_0 / Q4_1 files keep their token table and head at 8 bits or more: the head turns the last
  hidden state into every logit, and at 4 bits costs more perplexity than any block's layer;
- an ``nn.Embedding`` (a lookup reads one row per token: no time to win) stays a float table, but
  holds the values of its q8_0 quantisation, which is what a GGUF file stores for it: the model in
  memory then equals the one :func:`save_quantized_gguf` writes, weight for weight. A head tied
  to the embedding stays tied in the file (one q8_0 tensor) and equals it in memory.

Calibration (GPTQ, Wanda) runs the float model once over ``batches`` of token ids and keeps, for
every Linear, H = sum over tokens of x x^T (float64); layers fed the very same input tensor (a
block's q, k and v projections, the gate and up projections) share one H. GPTQ here quantises every
layer from those statistics of the float model (not layer by layer from the already quantised
model's outputs, as the paper's sequential variant does): one forward pass instead of one per block.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from .gptq import gptq, hqq
from .prune import prune_mask
from .quant import LAYOUTS, QuantLinear, dequantize, layout_for, quantize_rtn

__all__ = ["QUANT_METHODS", "linear_layers", "calibration_stats", "quantize_model", "prune_model",
           "save_quantized_gguf", "sparsity_of"]

QUANT_METHODS = ("rtn", "gptq", "hqq")
_HEAD_NAMES = ("lm_head", "output_projection")
HEAD_LAYOUT = "q8_0"


def _is_router(parent: nn.Module, child_name: str) -> bool:
    from ..nn.mlp import SparseMoE
    return isinstance(parent, SparseMoE) and child_name == "gate"


def linear_layers(model: nn.Module, head: bool = False) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """name -> (parent, attribute, Linear) of the model's ``nn.Linear`` layers (a router never;
    the output head only with ``head``)."""
    found = {}
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and not _is_router(parent, child_name) and (head or name not in _HEAD_NAMES):
                found[name] = (parent, child_name, child)
    return found


@torch.no_grad()
def calibration_stats(model: nn.Module, batches: Iterable[Tensor], full: bool = True) -> dict[str, Tensor]:
    """name -> H = sum over calibration tokens of x x^T (in, in) float64, for every Linear of
    :func:`linear_layers` (see the module docstring). ``batches``: token-id tensors (B, T).
    ``full=False`` keeps only H's diagonal (in,), the sums of x_j^2, which is all Wanda reads."""
    layers = linear_layers(model)
    stats: dict[str, Tensor] = {}
    seen: dict[int, tuple[str, Tensor]] = {}     # id of an input in this forward -> (the layer that took it, it)
    alias: dict[str, str] = {}

    def hook(name):
        def record(module, args):
            x = args[0]
            first = seen.get(id(x))                      # holding x keeps its id from being reused
            if first is not None and first[1] is x and first[0] != name:
                alias[name] = first[0]
                return
            seen[id(x)] = (name, x)
            x2 = x.detach().reshape(-1, x.size(-1)).double()
            if not full:
                x2 = x2.square().sum(0)
                stats[name] = stats[name].add_(x2) if name in stats else x2
            else:
                stats[name] = stats[name].addmm_(x2.t(), x2) if name in stats else x2.t() @ x2
        return record

    handles = [lin.register_forward_pre_hook(hook(name)) for name, (_, _, lin) in layers.items()]
    was_training = model.training
    model.eval()
    try:
        count = 0
        for ids in batches:
            seen.clear()
            model(ids)
            count += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not count:
        raise ValueError("calibration: no batch of calibration tokens")
    for name, first in alias.items():
        stats[name] = stats[first]
    return stats


def _quantized_embeddings(model: nn.Module) -> None:
    """Give every float nn.Embedding the values of its q8_0 quantisation (see the module docstring)."""
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight.size(1) % 32 == 0:
            with torch.no_grad():
                module.weight.copy_(dequantize(*quantize_rtn(module.weight, HEAD_LAYOUT, 32)))


def quantize_model(model: nn.Module, bits: int = 4, group_size: int | None = 32, method: str = "rtn", *,
                   symmetric: bool | None = None, calibration: dict[str, Tensor] | None = None,
                   damp: float = 0.01) -> nn.Module:
    """Replace the model's Linear layers by :class:`~.quant.QuantLinear`, in place (see the module
    docstring); returns the model. ``method``: "rtn", "gptq" (needs ``calibration``, from
    :func:`calibration_stats`) or "hqq" (4-bit asymmetric only). ``group_size=None``: one group
    per row (per-channel scales; at 8 bits the layout torch's int8 kernel runs)."""
    if method not in QUANT_METHODS:
        raise ValueError(f"quantisation method must be one of {', '.join(QUANT_METHODS)}, got {method!r}")
    if method == "gptq" and calibration is None:
        raise ValueError("gptq needs calibration statistics (a calibration text)")
    layout = layout_for(bits, symmetric)
    if method == "hqq" and layout.symmetric:
        raise ValueError(f"hqq searches an asymmetric offset: use --bits 4 without --symmetric, not {layout.name}")
    layers = linear_layers(model, head=True)
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("quantize_model: the model is already quantised; quantising again would round twice")
    if not layers:
        raise ValueError(f"quantize_model: {type(model).__name__} has no nn.Linear layer to quantise")
    for name, (parent, attr, lin) in layers.items():
        if name not in _HEAD_NAMES and group_size is not None and lin.in_features % group_size:
            raise ValueError(f"group size {group_size} does not divide {name}'s input width {lin.in_features}")
    _quantized_embeddings(model)
    for name, (parent, attr, lin) in layers.items():
        size = group_size or lin.in_features
        if name in _HEAD_NAMES:
            q = QuantLinear.from_linear(lin, HEAD_LAYOUT, 32)
        elif method == "rtn":
            q = QuantLinear.from_linear(lin, layout, size)
        else:
            if method == "gptq":
                codes, d, m = gptq(lin.weight, calibration[name], layout, size, damp=damp)
            else:
                codes, d, m = hqq(lin.weight, layout, size)
            q = QuantLinear.from_codes(codes, d, m, layout, lin.bias)
        setattr(parent, attr, q)
    return model


@torch.no_grad()
def prune_model(model: nn.Module, sparsity: float = 0.5, method: str = "magnitude", *,
                pattern: tuple[int, int] | None = None, calibration: dict[str, Tensor] | None = None) -> nn.Module:
    """Zero the pruned weights of every Linear but the head and routers, in place (see
    :mod:`.prune`); returns the model. Wanda needs ``calibration`` from :func:`calibration_stats`
    (full or not: its norms are sqrt(diag H)). Like GPTQ here, Wanda reads the statistics of the
    unpruned model, not of the blocks before it already pruned (the paper's sequential variant)."""
    if method == "wanda" and calibration is None:
        raise ValueError("wanda needs calibration statistics (a calibration text)")
    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise ValueError("prune_model: the model is quantised; prune the float model, then quantise it")
    for name, (_, _, lin) in linear_layers(model).items():
        norms = None
        if method == "wanda":
            h = calibration[name]
            norms = (torch.diagonal(h) if h.dim() == 2 else h).clamp_min(0).sqrt()
        lin.weight.mul_(prune_mask(lin.weight, sparsity, method, norms, pattern))
    return model


def sparsity_of(model: nn.Module) -> float:
    """The fraction of zero weights over the Linear layers :func:`prune_model` prunes."""
    zeros = total = 0
    for _, _, lin in linear_layers(model).values():
        zeros += int((lin.weight == 0).sum())
        total += lin.weight.numel()
    return zeros / max(total, 1)


def save_quantized_gguf(model: nn.Module, path, tokenizer=None, name: str | None = None) -> Path:
    """Write a model quantised by :func:`quantize_model` at group size 32 as a GGUF file whose
    blocks are its very codes, scales and offsets (Q4_0, Q4_1 or Q8_0), the embeddings as Q8_0."""
    from ..gguf import save_gguf
    from ..models.pretrained import to_hf_state_dict
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not quantized:
        raise ValueError("save_quantized_gguf: the model has no quantised layer (quantize_model first)")
    if bad := [n for n, m in quantized.items() if m.group_size != 32]:
        raise ValueError(f"GGUF blocks hold 32 values: {bad[0]} is quantised in groups of "
                         f"{quantized[bad[0]].group_size}; quantise with --group-size 32 to write GGUF")
    shadow = copy.deepcopy(model)                # float Linears in place of the quantised ones, same names
    embeddings = [m for m in shadow.modules() if isinstance(m, nn.Embedding)]
    linears = {}
    for n, q in quantized.items():
        parent_name, _, attr = n.rpartition(".")
        lin = nn.Linear(q.in_features, q.out_features, bias=q.bias is not None)
        if q.bias is not None:
            lin.bias.data.copy_(q.bias)
        setattr(shadow.get_submodule(parent_name) if parent_name else shadow, attr, lin)
        tied = next((e for e in embeddings if e.weight.shape == lin.weight.shape and torch.equal(e.weight, q.weight)), None)
        if tied is not None:                     # a head tied to the token table: one tensor, the table's q8_0
            lin.weight = tied.weight
        else:
            linears[n] = lin

    def checkpoint(fill) -> dict[str, Tensor]:
        with torch.no_grad():
            for n, lin in linears.items():
                lin.weight.data = fill(n, quantized[n])
        return to_hf_state_dict(shadow)

    names = list(linears)                       # layer i is marked i + 1: which checkpoint tensor is which layer
    marks = checkpoint(lambda n, q: torch.full((q.out_features, q.in_features), float(names.index(n) + 1)))
    codes = checkpoint(lambda n, q: q.codes().float())
    scales = checkpoint(lambda n, q: q.scales.float().repeat_interleave(32, dim=1))
    offsets = checkpoint(lambda n, q: q.offsets.float().repeat_interleave(32, dim=1))
    blocks = {}
    for key, mark in marks.items():
        first = float(mark.flatten()[0]) if mark.dim() == 2 else 0.0
        if first.is_integer() and 1 <= first <= len(names) and bool((mark == first).all()):
            blocks[key] = (codes[key], scales[key], offsets[key], quantized[names[int(first) - 1]].layout.qtype)
    if len(blocks) != len(linears):
        raise ValueError("save_quantized_gguf: the checkpoint's tensors do not map one to one onto the "
                         "quantised layers (a fused tensor?)")
    checkpoint(lambda n, q: q.weight)            # the values, for everything save_gguf reads besides the blocks
    return save_gguf(shadow, path, tokenizer, qtype=HEAD_LAYOUT.upper(), name=name, quantized=blocks)
