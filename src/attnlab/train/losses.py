"""Training losses.

Label smoothing (Szegedy et al. 2016; "Attention Is All You Need" section 5.4, eps_ls = 0.1):
the one-hot target is mixed with the uniform distribution over the V classes,

    q = (1 - eps) * onehot(y) + eps / V
    loss = -sum_c q_c log p_c = (1 - eps) * (-log p_y) + eps * mean_c(-log p_c)

which is what ``torch.nn.functional.cross_entropy(label_smoothing=eps)`` computes. Targets
equal to ``ignore_index`` (padding) contribute nothing, neither to the likelihood term nor
to the smoothing term, and are not counted by the mean (smoothing over padding targets would train the model
towards predicting padding; pytorch#73205).

Knowledge distillation (Hinton, Vinyals and Dean 2015, "Distilling the Knowledge in a Neural
Network", section 2): a student with logits s learns from a teacher's logits t softened by a
temperature T, and from the hard labels y, per real target position:

    p = softmax(t / T),  q = softmax(s / T)                  # over the V classes
    KL(p || q) = sum_v p_v (log p_v - log q_v)
    loss = alpha * T^2 * KL(p || q) + (1 - alpha) * CE(s, y)  # CE at temperature 1

The T^2 keeps the soft term's gradients at the hard term's scale as T changes (the gradient of
the KL term with respect to s scales as 1 / T^2). Positions whose target is ``ignore_index``
(padding) contribute to neither term and are not counted.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["label_smoothed_cross_entropy", "distillation_loss", "count_tokens"]


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


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, target: Tensor, temperature: float = 1.0,
                      alpha: float = 0.5, ignore_index: int = -100, reduction: str = "sum") -> Tensor:
    """The distillation loss of the module docstring, in fp32 whatever the logits' dtype.

    student_logits and teacher_logits (..., V), target (...) class ids; positions whose target is
    ``ignore_index`` are excluded from both terms. ``reduction``: "sum" over the real positions
    (what the Trainer wants, see :class:`attnlab.train.Task`) or "mean" (sum / their number).
    The hard term is exactly ``F.cross_entropy(..., reduction="sum")``, so with alpha = 0 the loss
    and its gradients are those of plain next-token training bit for bit.
    """
    if not temperature > 0:
        raise ValueError(f"distillation_loss: temperature must be positive, got {temperature}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"distillation_loss: alpha must be in [0, 1], got {alpha}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"distillation_loss: reduction must be 'sum' or 'mean', got {reduction!r}")
    if student_logits.shape != teacher_logits.shape or student_logits.shape[:-1] != target.shape:
        raise ValueError(f"distillation_loss: student logits {tuple(student_logits.shape)}, teacher logits "
                         f"{tuple(teacher_logits.shape)} and target {tuple(target.shape)} do not match")
    s = student_logits.float()
    hard = F.cross_entropy(s.flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction="sum")
    log_q = F.log_softmax(s / temperature, dim=-1)                        # (..., V)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=-1)                      # (...)
    real = target != ignore_index
    soft = torch.where(real, kl, torch.zeros_like(kl)).sum()
    loss = (1.0 - alpha) * hard + alpha * temperature ** 2 * soft
    return loss if reduction == "sum" else loss / real.sum()


def count_tokens(target: Tensor, ignore_index: int = -100) -> int:
    """Number of real (non-ignored) targets: the count a Task returns beside its loss sum."""
    return int((target != ignore_index).sum())
