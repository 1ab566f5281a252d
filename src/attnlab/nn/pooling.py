"""Pooling a sequence of token vectors into one vector per sequence, padding excluded.

Letters: B batch, T tokens, E width. ``x`` is (B, T, E); ``mask`` is the (B, T) padding mask,
True for real tokens (attnlab's one convention), or None when every token is real.

- ``mean``: the average over the real tokens, sum_t m_t x_t / sum_t m_t (the chapter's
  ``x.mean(dim=1)`` also averages the padding, so the same text padded to another length gets
  another vector; sentence-transformers' mean pooling is this masked mean).
- ``cls``: the first token's vector (BERT's [CLS]); right padding keeps it real.
- ``attention``: a learned query q scores every token, s_t = x_t . q / sqrt(E), padding gets
  no weight, and the result is sum_t softmax(s)_t x_t (attention pooling, as in Lin et al. 2017,
  "A Structured Self-Attentive Sentence Embedding", with one head).

A row without a single real token pools to zeros, never NaN. Padded and unpadded inputs give
the same vector for the same real tokens.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["POOLINGS", "mean_pool", "cls_pool", "attention_pool", "Pooling"]

POOLINGS = ("mean", "cls", "attention")


def _check(x: Tensor, mask: Tensor | None, who: str) -> None:
    if x.dim() != 3:
        raise ValueError(f"{who}: x must be (batch, seq, d_model), got shape {tuple(x.shape)}")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != x.shape[:2]):
        raise ValueError(f"{who}: mask must be bool {tuple(x.shape[:2])} (True = real token), got "
                         f"{mask.dtype} {tuple(mask.shape)}")


def mean_pool(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B, T, E), (B, T) -> (B, E): the mean over real tokens (zeros for a row with none)."""
    _check(x, mask, "mean_pool")
    if mask is None:
        return x.mean(dim=1)
    m = mask.to(x.dtype).unsqueeze(-1)                                  # (B, T, 1)
    return (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


def cls_pool(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B, T, E) -> (B, E): the first token's vector (zeros where that token is padding)."""
    _check(x, mask, "cls_pool")
    first = x[:, 0]
    return first if mask is None else first * mask[:, :1].to(x.dtype)


def attention_pool(x: Tensor, query: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B, T, E), query (E,), (B, T) -> (B, E): softmax(x q / sqrt(E)) over the real tokens,
    then the weighted sum of x. Scores and softmax in fp32."""
    _check(x, mask, "attention_pool")
    scores = (x.float() @ query.float()) / math.sqrt(x.size(-1))      # (B, T)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if mask is not None:                                                # a row of padding only: zeros, not NaN
        weights = torch.where(mask.any(-1, keepdim=True), weights, torch.zeros_like(weights))
    return (weights.to(x.dtype).unsqueeze(-1) * x).sum(dim=1)


class Pooling(nn.Module):
    """One of :data:`POOLINGS` as a module: ``Pooling(kind, d_model)(x, mask) -> (B, E)``.
    Only "attention" has a parameter, its query (initialised N(0, 0.02): near-uniform weights
    at the start, i.e. close to the mean)."""

    def __init__(self, kind: str = "mean", d_model: int | None = None):
        super().__init__()
        if kind not in POOLINGS:
            raise ValueError(f"Pooling: kind must be one of {', '.join(POOLINGS)}, got {kind!r}")
        self.kind = kind
        if kind == "attention":
            if not d_model or d_model <= 0:
                raise ValueError(f"Pooling('attention') needs d_model > 0, got {d_model}")
            self.query = nn.Parameter(torch.randn(d_model) * 0.02)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.kind == "mean":
            return mean_pool(x, mask)
        if self.kind == "cls":
            return cls_pool(x, mask)
        return attention_pool(x, self.query, mask)

    def extra_repr(self) -> str:
        return repr(self.kind)
