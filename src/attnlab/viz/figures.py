"""PNG figures of :class:`~attnlab.viz.views.View` s: one figure per view and layer with a grid of
its heads, or one heatmap for a chosen layer and head.

Token labels are drawn on every panel up to ``LABELLED`` tokens; a longer input would make them
an unreadable smear, so its panels keep only the heatmap and the figure stays a few inches wide.
"""
from __future__ import annotations

import math
from pathlib import Path

from .attention import _draw, _save, plot_attention, plt
from .views import View

__all__ = ["write_figures", "figure_name"]

LABELLED = 40


def figure_name(view: View, layer: int, head: int | None = None) -> str:
    """File name of one figure: "encoder_layers-self-layer2.png", "...-layer2-head3.png"."""
    stem = view.name.replace("/", "-").replace(".", "_")
    return f"{stem}-layer{layer + 1}" + ("" if head is None else f"-head{head + 1}") + ".png"


def _check(views: list[View], layer: int | None, head: int | None) -> None:
    for v in views:
        L, H = v.weights.shape[:2]
        if layer is not None and not 1 <= layer <= L:
            raise ValueError(f"viz: --layer must be in 1..{L} ({v.title} has {L} layers), got {layer}")
        if head is not None and not 1 <= head <= H:
            raise ValueError(f"viz: --head must be in 1..{H} ({v.title} has {H} heads), got {head}")


def _layer_grid(view: View, layer: int, path: Path) -> Path:
    w = view.weights[layer] / view.scale
    H, T, S = w.shape
    cols = math.ceil(math.sqrt(H))
    rows = math.ceil(H / cols)
    labelled = max(T, S) <= LABELLED
    cell_w, cell_h = (max(2.4, 0.2 * S + 1.2), max(2.2, 0.18 * T + 1.2)) if labelled else (2.6, 2.6)
    fig, axes = plt.subplots(rows, cols, figsize=(cell_w * cols, cell_h * rows), squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= H:
            ax.axis("off")
            continue
        _draw(ax, w[h], view.rows, view.cols, f"head {h + 1}", ticks=False)
        if labelled:
            ax.set_xticks(range(S), labels=view.cols, rotation=90, fontsize=6)
            ax.set_yticks(range(T), labels=view.rows, fontsize=6)
    fig.suptitle(f"{view.title}, layer {layer + 1} (rows: queries, columns: keys)")
    return _save(fig, path, dpi=100)


def write_figures(views: list[View], out_dir: str | Path, *, layer: int | None = None,
                  head: int | None = None) -> list[Path]:
    """Write the figures into ``out_dir``; returns their paths. ``layer``/``head`` (1-based):
    only that layer / only that head (one labelled heatmap per figure); default: every layer,
    all heads in a grid."""
    _check(views, layer, head)
    out = Path(out_dir)
    paths = []
    for v in views:
        layers = range(v.weights.size(0)) if layer is None else [layer - 1]
        for i in layers:
            if head is None:
                paths.append(_layer_grid(v, i, out / figure_name(v, i)))
            else:
                paths.append(_one_head(v, i, head - 1, out / figure_name(v, i, head - 1)))
    return paths


def _one_head(view: View, layer: int, head: int, path: Path) -> Path:
    w = view.weights[layer, head] / view.scale
    title = f"{view.title}, layer {layer + 1}, head {head + 1}"
    if max(w.shape) <= LABELLED:
        return plot_attention(w, view.rows, view.cols, path, title=title, xlabel="keys", ylabel="queries")
    fig, ax = plt.subplots(figsize=(7.0, 6.0))
    fig.colorbar(_draw(ax, w, view.rows, view.cols, title, ticks=False), ax=ax, fraction=0.046, pad=0.04)
    ax.set_xlabel(f"keys (0..{w.size(1) - 1})")
    ax.set_ylabel(f"queries (0..{w.size(0) - 1})")
    return _save(fig, path, dpi=110)
