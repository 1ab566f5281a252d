"""Attention heatmaps as PNG files (the chapter's ``plot_attention``, labelled and readable).

Rows are the query tokens (for cross-attention: the target tokens), columns the key tokens
(the source tokens); each cell is the weight a query puts on a key, rows summing to 1.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor  # noqa: E402

__all__ = ["plot_attention", "plot_attention_grid"]


def _check(weights: Tensor, rows: Sequence[str], cols: Sequence[str]) -> Tensor:
    w = torch.as_tensor(weights).detach().float().cpu()
    if w.dim() != 2 or w.shape != (len(rows), len(cols)):
        raise ValueError(f"plot_attention: weights of shape {tuple(w.shape)} do not match "
                         f"{len(rows)} row labels x {len(cols)} column labels")
    return w


def _draw(ax, w: Tensor, rows: Sequence[str], cols: Sequence[str], title: str | None, ticks: bool = True):
    im = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=max(float(w.max()), 1e-6), aspect="auto")
    if ticks:
        ax.set_xticks(range(len(cols)), labels=list(cols), rotation=90, fontsize=8)
        ax.set_yticks(range(len(rows)), labels=list(rows), fontsize=8)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=9)
    return im


def _save(fig, path: str | Path, dpi: int) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_attention(weights: Tensor, row_tokens: Sequence[str], col_tokens: Sequence[str], path: str | Path,
                   title: str | None = None, xlabel: str = "source", ylabel: str = "target") -> Path:
    """One (T, S) weight matrix as a labelled heatmap with a colour bar; returns the PNG path."""
    w = _check(weights, row_tokens, col_tokens)
    T, S = w.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * S + 2.0), max(3.0, 0.3 * T + 1.8)))
    im = _draw(ax, w, row_tokens, col_tokens, title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    return _save(fig, path, dpi=120)


def plot_attention_grid(weights: Tensor, row_tokens: Sequence[str], col_tokens: Sequence[str], path: str | Path,
                        title: str | None = None) -> Path:
    """(L, H, T, S) weights: one panel per layer (rows) and head (columns), labels on the edges."""
    w = torch.as_tensor(weights).detach().float().cpu()
    if w.dim() != 4:
        raise ValueError(f"plot_attention_grid: expected (layers, heads, T, S), got {tuple(w.shape)}")
    L, H = w.shape[:2]
    _check(w[0, 0], row_tokens, col_tokens)
    T, S = w.shape[2:]
    cell_w, cell_h = max(2.0, 0.22 * S + 1.0), max(1.8, 0.2 * T + 0.9)
    fig, axes = plt.subplots(L, H, figsize=(cell_w * H, cell_h * L), squeeze=False)
    for i in range(L):
        for j in range(H):
            ax = axes[i][j]
            _draw(ax, w[i, j], row_tokens, col_tokens, f"layer {i + 1} head {j + 1}", ticks=False)
            if i == L - 1:
                ax.set_xticks(range(S), labels=list(col_tokens), rotation=90, fontsize=6)
            if j == 0:
                ax.set_yticks(range(T), labels=list(row_tokens), fontsize=6)
    if title:
        fig.suptitle(title)
    return _save(fig, path, dpi=110)
