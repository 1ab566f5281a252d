"""What scripts/figures.py and scripts/figures_vision.py share: matplotlib's Agg backend, the
saving of a figure (no timestamp in the PNG, so the bytes depend only on the figure) and the
0-1 heatmap of a weight matrix."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save_figure", "save_plain", "heatmap", "fitted_top"]


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def save_plain(fig, path: Path) -> None:
    """As :func:`save_figure`, for a figure laid out by hand (tight_layout would move its axes)."""
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def heatmap(ax, w, labels_x, labels_y, title, vmax=1.0):
    """``w`` from 0 to ``vmax`` (1 for weights, unless a figure fits its scale to them)."""
    im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax)
    ax.set_xticks(range(len(labels_x)), labels=labels_x)
    ax.set_yticks(range(len(labels_y)), labels=labels_y)
    ax.set_title(title, fontsize=10)
    return im


def fitted_top(w) -> float:
    """A colour scale's top that fits weights ``w``: their largest, rounded up to the next 0.05,
    so that weights of 0.1-0.3 use the whole scale instead of its dark third (the colour bar
    says where it ends)."""
    import math
    return min(1.0, math.ceil(float(w.max()) * 20 + 1e-9) / 20)
