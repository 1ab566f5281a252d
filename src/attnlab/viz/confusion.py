"""A classifier's confusion matrix as a PNG: rows are the true classes, columns the predicted ones,
each cell the count (and its share of the row, i.e. of that true class)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

__all__ = ["plot_confusion"]


def plot_confusion(confusion, labels: Sequence[str], path: str | Path, title: str | None = None) -> Path:
    """Draw the (C, C) count matrix ``confusion`` labelled with ``labels``; returns the PNG path."""
    from matplotlib.figure import Figure
    counts = torch.as_tensor(confusion).long().cpu()
    C = len(labels)
    if counts.shape != (C, C):
        raise ValueError(f"plot_confusion: a matrix of shape {tuple(counts.shape)} for {C} labels")
    share = counts.double() / counts.sum(1, keepdim=True).clamp(min=1)
    size = max(3.5, 0.7 * C + 2.0)
    fig = Figure(figsize=(size + 1.0, size))
    ax = fig.add_subplot()
    im = ax.imshow(share.numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(C), labels=list(labels), rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(C), labels=list(labels), fontsize=8)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if C <= 20:
        for i in range(C):
            for j in range(C):
                ax.text(j, i, f"{int(counts[i, j])}\n{100 * float(share[i, j]):.0f}%", ha="center", va="center",
                        fontsize=7, color="white" if share[i, j] > 0.5 else "black")
    ax.set_title(title or f"confusion matrix ({int(counts.sum())} texts)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
