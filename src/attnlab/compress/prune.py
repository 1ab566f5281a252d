"""Pruning masks for one weight matrix W (out, in): True where a weight is kept.

- magnitude: the ``sparsity`` fraction of the whole matrix with the smallest |W_ij| is removed
  (the baseline of Sun et al. 2024, compared per layer);
- Wanda (Sun et al. 2024, "A Simple and Effective Pruning Approach for Large Language Models"):
  the score is S_ij = |W_ij| * ||X_j||_2, the weight's magnitude times the l2 norm of its input
  feature over the calibration tokens, and each output row loses its ``sparsity`` fraction of
  lowest scores (the comparison group is the row, not the layer);
- pattern N:M (2:4, which sparse tensor cores run at twice the speed): in every group of M
  consecutive weights of a row along the input dimension, the N highest scores are kept and the
  M - N others removed (so the sparsity is 1 - N/M whatever ``sparsity`` says); the score is |W|
  or Wanda's. N:M means "N non-zero of every M", the convention of sparse tensor cores.

A count of weights to remove that is not whole is rounded to nearest (a 0.5 sparsity of 7 weights
removes 4: halves round to even, as Python's ``round``). Ties are broken by position (a stable
sort: the earlier of two equal scores is removed first).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["prune_scores", "prune_mask", "METHODS"]

METHODS = ("magnitude", "wanda")


def prune_scores(weight: Tensor, method: str, input_norms: Tensor | None = None) -> Tensor:
    """|W| (magnitude) or |W| * ||X_j||_2 (wanda: ``input_norms`` (in,), the per-feature l2 norms)."""
    w = weight.detach().float().abs()
    if method == "magnitude":
        return w
    if method != "wanda":
        raise ValueError(f"pruning method must be one of {', '.join(METHODS)}, got {method!r}")
    if input_norms is None or tuple(input_norms.shape) != (weight.size(1),):
        raise ValueError(f"wanda needs the {weight.size(1)} input-feature norms of calibration data")
    return w * input_norms.float()[None, :]


def _lowest(scores: Tensor, count: int) -> Tensor:
    """Boolean mask of the ``count`` lowest entries along the last dim (stable: earlier first)."""
    drop = torch.zeros_like(scores, dtype=torch.bool)
    if count > 0:
        idx = torch.sort(scores, dim=-1, stable=True).indices[..., :count]
        drop.scatter_(-1, idx, True)
    return drop


def prune_mask(weight: Tensor, sparsity: float = 0.5, method: str = "magnitude", input_norms: Tensor | None = None,
               pattern: tuple[int, int] | None = None) -> Tensor:
    """The keep-mask (out, in) bool of ``weight`` (see the module docstring)."""
    scores = prune_scores(weight, method, input_norms)
    n, k = scores.shape
    if pattern is not None:
        keep_n, m = pattern
        if not 0 < keep_n < m or k % m:
            raise ValueError(f"pattern {keep_n}:{m} must have 0 < N < M and M dividing the input width {k}")
        return ~_lowest(scores.reshape(n, k // m, m), m - keep_n).reshape(n, k)
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity}")
    if method == "magnitude":
        return ~_lowest(scores.reshape(1, -1), int(round(sparsity * n * k))).reshape(n, k)
    return ~_lowest(scores, int(round(sparsity * k)))
