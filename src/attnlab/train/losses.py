"""Training losses.

Label smoothing (Szegedy et al. 2016; "Attention Is All You Need" section 5.4, eps_ls = 0.1):
the one-hot target is mixed with the uniform distribution over the V classes,

    q = (1 - eps) * onehot(y) + eps / V
    loss = -sum_c q_c log p_c = (1 - eps) * (-log p_y) + eps * mean_c(-log p_c)

which is what ``torch.nn.functional.cross_entropy(label_smoothing=eps)`` computes. Targets
equal to ``ignore_index`` (padding) contribute nothing, neither to the likelihood term nor
to the smoothing term, and are not counted by the mean (smoothing over padding targets would train the model
towards predicting padding; pytorch#73205).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["label_smoothed_cross_entropy", "count_tokens"]


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float = 0.0,
                                 ignore_index: int = -100, reduction: str = "sum") -> Tensor:
    """Cross-entropy with label smoothing that ignores padding targets.

    logits (..., V), target (...) integer class ids; positions whose target is
    ``ignore_index`` are excluded. ``reduction``: "sum" (over real targets; what the
    Trainer wants, see :class:`attnlab.train.Task`), "mean" (sum / number of real targets;
    NaN when there are none, as in torch) or "none" (per-position losses, zero at
    ignored positions). Computed in fp32 whatever the logits' dtype; returns fp32.
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"label_smoothed_cross_entropy: smoothing must be in [0, 1), got {smoothing}")
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"label_smoothed_cross_entropy: reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"label_smoothed_cross_entropy: logits {tuple(logits.shape)} need target of shape "
                         f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
    log_p = F.log_softmax(logits.float(), dim=-1)                  # (..., V)
    real = target != ignore_index                                  # (...)
    safe_target = target.masked_fill(~real, 0)                     # any valid id; masked below
    nll = -log_p.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
    loss = nll if smoothing == 0.0 else (1.0 - smoothing) * nll - smoothing * log_p.mean(dim=-1)
    loss = torch.where(real, loss, torch.zeros_like(loss))
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / real.sum()


def count_tokens(target: Tensor, ignore_index: int = -100) -> int:
    """Number of real (non-ignored) targets: the count a Task returns beside its loss sum."""
    return int((target != ignore_index).sum())
