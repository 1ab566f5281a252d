"""Where an image classifier looks: attention over the patch grid, drawn on the image.

Two maps of the class token's attention over the patches, both from the per-call records of
:func:`~attnlab.viz.record.record_attention` (whatever kernel the model ran):

- **attention rollout** (Abnar and Zuidema 2020, "Quantifying Attention Flow in Transformers",
  section 3): each layer's weights averaged over the heads, the residual connection added as an
  identity and the rows renormalised, A_l = (mean_h W_l + I) / 2, then multiplied through the
  layers, R = A_L ... A_2 A_1. Row 0 of R says how much of the class token's final state comes,
  through every path of attention and residual, from each input token; its patch columns make the map.
- **per-head attention** of one layer: row 0 of W_l for each head, over the patch columns (what
  the class token read in that layer, before any mixing by later layers).

Shapes: L layers, H heads, T = prefix + rows * cols tokens (prefix: the tokens the model's config
names before the patches, ``config.prefix_names``: a class token, a distillation token). The maps
are (rows, cols); :func:`draw_image_attention` paints them over the image the model saw (after its
processor's resize and crop), one patch per cell.

A model whose mixers report their tokens as a map (attnlab.nn.record, ``tiles_map``: attention
within windows of a map that each stage halves, as a Swin's) has no class token; its PNG reads the
per-stage weights of :func:`map_stage_weights` (which the explorer page, attnlab.viz.image_views,
draws too, and whose docstring there says how): the rollout of the pooled output over the first
stage's patches, and per stage the attention each patch receives in the stage's last block (the
block's (H, N, N) weights averaged over the heads and the N queries: a (rows, cols) map of that
stage, each cell a patch times the stage's reduction a side). Nothing here names a family: the
mixers say what their weights are and where their tokens sit.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from ..nn.record import ReportsMixing  # noqa: E402
from .labels import PatchGrid  # noqa: E402
from .record import record_attention, record_mixers  # noqa: E402

__all__ = ["attention_rollout", "image_attention", "class_token_maps", "draw_image_attention", "figure_layout",
           "tiles_maps", "map_panels", "map_rollout", "map_stage_weights",
           "is_swin", "swin_panels", "swin_rollout", "swin_stage_weights",
           "PANEL_INCHES", "DPI"]

PANEL_INCHES, DPI, MAX_COLUMNS = 2.4, 100, 4
PREFIX_NAMES = ("[CLS]", "[DIST]")


def attention_rollout(weights: Tensor) -> Tensor:
    """(L, H, T, T) self-attention weights of one image, layers in order -> the rollout R (T, T):
    ``R = A_L ... A_1`` with ``A_l = (mean over heads of W_l + I) / 2`` renormalised by rows."""
    if weights.dim() != 4 or weights.size(-1) != weights.size(-2):
        raise ValueError(f"attention_rollout: expected (layers, heads, T, T) weights, got {tuple(weights.shape)}")
    w = weights.detach().double()
    eye = torch.eye(w.size(-1), dtype=w.dtype, device=w.device)
    rollout = eye
    for layer in w:
        a = layer.mean(0) + eye
        a = a / a.sum(-1, keepdim=True)
        rollout = a @ rollout
    return rollout.float()


@torch.no_grad()
def image_attention(model: nn.Module, pixel_values: Tensor) -> tuple[Tensor, PatchGrid]:
    """Run ``model`` on one image, pixel_values (1, C, H, W), recording its attention: (weights
    (L, H, T, T) of every self-attention layer in order, the :class:`PatchGrid` of its tokens).

    The grid comes from the model's patch size (``model.config.patch_size``) and the image's size;
    the tokens before the patches are the prefix. A model whose attention is not over that grid
    (no patch size, or attention within windows of it) is a ValueError saying so."""
    if pixel_values.dim() != 4 or pixel_values.size(0) != 1:
        raise ValueError(f"image_attention: expected pixel values of one image (1, C, H, W), got "
                         f"{tuple(pixel_values.shape)}")
    patch = getattr(getattr(model, "config", None), "patch_size", None)
    if not isinstance(patch, int):
        raise ValueError(f"image_attention: {type(model).__name__} states no patch size (config.patch_size), so "
                         f"its tokens are not known to be an image's patches")
    model.eval()
    with record_attention(model) as record:
        model(pixel_values)
    weights = record.stack("self")[:, 0]                              # (L, H, T, T)
    rows, cols = pixel_values.size(2) // patch, pixel_values.size(3) // patch
    T, prefix = weights.size(-1), weights.size(-1) - rows * cols
    # the config names the tokens before the patches; a model that does not is read by counting
    names = tuple(getattr(model.config, "prefix_names", PREFIX_NAMES[:max(prefix, 0)]))
    if weights.size(-2) != T or prefix != len(names):
        raise ValueError(f"image_attention: {type(model).__name__} attends over {tuple(weights.shape[-2:])} tokens, "
                         f"not the {rows}x{cols} patch grid (and {len(names) or 'no'} token(s) before it) of its input")
    return weights, PatchGrid((rows * patch, cols * patch), patch, names)


def class_token_maps(weights: Tensor, grid: PatchGrid, layer: int = -1) -> tuple[Tensor, Tensor]:
    """(rollout map (rows, cols), per-head map of ``layer`` (H, rows, cols)): the class token's row
    over the patches, from (L, H, T, T) weights (see the module docstring); ``layer`` 0-based.
    Tokens without a class token before them (a classifier that pools the patches) give the mean
    of the rows instead: what an average of every token's final state reads, and per head the
    attention each patch receives, averaged over the queries."""
    n = len(grid.prefix)
    rollout = attention_rollout(weights)
    rows = weights[layer].float()                                     # (H, T, T)
    rollout, heads = (rollout[0], rows[:, 0]) if n else (rollout.mean(0), rows.mean(1))
    return rollout[n:].reshape(grid.rows, grid.cols), heads[:, n:].reshape(-1, grid.rows, grid.cols)


def figure_layout(num_heads: int) -> tuple[int, int, tuple[int, int]]:
    """(panel rows, panel columns, PNG (width, height) in pixels) of a figure with the image, the
    rollout and ``num_heads`` head panels."""
    panels = 2 + num_heads
    cols = min(panels, MAX_COLUMNS)
    rows = math.ceil(panels / cols)
    return rows, cols, (round(cols * PANEL_INCHES * DPI), round(rows * PANEL_INCHES * DPI))


def _overlay(ax, image, heat: Tensor, title: str, cell: int | None = None) -> None:
    """Paint ``heat`` (rows, cols) over ``image``: stretched over the whole picture, or with
    ``cell`` pixels a side per cell (a Swin stage's map may overhang a picture it padded)."""
    H, W = image.shape[:2]
    ax.imshow(image, cmap="gray" if image.ndim == 2 else None)
    heat = heat / heat.max().clamp_min(1e-12)
    bottom, right = (H, W) if cell is None else (heat.size(0) * cell, heat.size(1) * cell)
    # one cell per patch, stretched over the pixels it covers; imshow centres pixel i on i, so the
    # picture spans -0.5 .. W - 0.5 and the patch grid must span the same or sit half a pixel off
    ax.imshow(heat.numpy(), cmap="inferno", alpha=0.6, extent=(-0.5, right - 0.5, bottom - 0.5, -0.5),
              interpolation="nearest",
              vmin=0.0, vmax=1.0)
    ax.set_xlim(-0.5, W - 0.5)
    ax.set_ylim(H - 0.5, -0.5)
    ax.set_title(title, fontsize=8)
    ax.set_axis_off()


def _token_panels(model, pixels, layer):
    """(the rows x cols the picture is cut to, [(title, map, cell)]) of a model whose attention runs
    over a class token (and any other the config names) and the patches."""
    weights, grid = image_attention(model, pixels)
    L, H = weights.shape[:2]
    if layer is not None and not 1 <= layer <= L:
        raise ValueError(f"viz: --layer must be in 1..{L}, got {layer}")
    layer = L if layer is None else layer
    rollout, heads = class_token_maps(weights.cpu(), grid, layer - 1)
    crop = (grid.rows * grid.patch_size[0], grid.cols * grid.patch_size[1])
    return crop, [(f"rollout, {L} layers", rollout, None)] + [
        (f"layer {layer}, head {h + 1}", heads[h], None) for h in range(H)]


def tiles_maps(model: nn.Module) -> bool:
    """Whether a mixer of ``model`` reports its tokens as a map (attnlab.nn.record ``tiles_map``:
    attention within windows, as a Swin's)."""
    return any(isinstance(m, ReportsMixing) and m.tiles_map for m in model.modules())


def map_stage_weights(model: nn.Module, pixel_values: Tensor) -> list[tuple[Tensor, tuple[int, int]]]:
    """Per stage (the calls that ran on one map, in order): (weights (blocks, H, N, N) of its blocks
    over the stage's map, its (rows, cols)), N = rows * cols in row-major order; from one recorded
    forward of one image, as the mixers report them (attnlab.nn.record)."""
    model.eval()
    with torch.no_grad(), record_mixers(model) as entries:
        model(pixel_values)
    stages: list[tuple[list[Tensor], tuple[int, int]]] = []
    for entry in entries:
        call = entry.call
        if call.grid is None or call.matrix is None:
            continue
        if not stages or stages[-1][1] != call.grid:
            stages.append(([], call.grid))
        stages[-1][0].append(call.magnitude()[0])                          # (H, N, N) of the one image
    if not stages:
        raise ValueError(f"viz: no mixer of {type(model).__name__} reported weights on a map")
    return [(torch.stack(ws), grid) for ws, grid in stages]


def _merging(rows: int, cols: int) -> Tensor:
    """(N', N): each token of the merged map as the mean of the (up to four) tokens it joins."""
    r2, c2 = (rows + 1) // 2, (cols + 1) // 2
    P = torch.zeros(r2 * c2, rows * cols, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            P[(r // 2) * c2 + c // 2, r * cols + c] = 1.0
    return P / P.sum(-1, keepdim=True)


def map_rollout(stages: list[tuple[Tensor, tuple[int, int]]]) -> Tensor:
    """(N_0,): the pooled output's rollout over the first stage's patches (module docstring)."""
    total = None
    for i, (w, (rows, cols)) in enumerate(stages):
        if i:
            prev_rows, prev_cols = stages[i - 1][1]
            total = _merging(prev_rows, prev_cols) @ total
        r = attention_rollout(w).double()
        total = r if total is None else r @ total
    return total.mean(0).float()


def stage_cell(patch: int, first: tuple[int, int], grid: tuple[int, int]) -> int:
    """The pixels a side of a token of the map ``grid``: a patch times the power of two the map was
    reduced by from the ``first`` (each merge halves it, rounding up)."""
    return patch * 2 ** round(math.log2(first[0] / grid[0]))


def map_panels(model, pixels) -> list[tuple[str, Tensor, int]]:
    """[(title, map (rows, cols), cell pixels)]: the pooled rollout, then per stage the attention
    each patch receives in its last block (module docstring)."""
    stages = map_stage_weights(model, pixels)
    patch = model.config.patch_size
    rows, cols = stages[0][1]
    panels = [("rollout of the pooled output", map_rollout(stages).cpu().reshape(rows, cols), patch)]
    for s, (w, (r, c)) in enumerate(stages):
        received = w[-1].mean(0).mean(0).cpu().reshape(r, c)             # (N, N) -> mean over heads, queries
        panels.append((f"stage {s + 1} ({r}x{c}), block {w.size(0)}: received", received,
                       stage_cell(patch, (rows, cols), (r, c))))
    return panels


# the names these had when a Swin was the only model with windows
is_swin, swin_stage_weights, swin_rollout, swin_panels = tiles_maps, map_stage_weights, map_rollout, map_panels


def draw_image_attention(model: nn.Module, processor, image, path: str | Path, *, layer: int | None = None) -> Path:
    """Write a PNG of ``image`` (a path, PIL image or uint8 array; ``processor`` an
    :class:`attnlab.processors.ImageProcessor`) as ``model`` sees it, then the attention rollout and
    the class token's attention per head in ``layer`` (1-based; default the last) over it; for a
    model whose mixers tile maps, the pooled rollout and each stage's received attention (module
    docstring).
    Returns the path. Its size in pixels is :func:`figure_layout`'s (heads, or a Swin's stages
    plus one, for ``num_heads``)."""
    shown = processor.resized(image)                                  # (C, H, W) uint8, what the model reads
    pixels = processor.finish(shown)[None].to(next(model.parameters()).device)
    picture = shown.permute(1, 2, 0).numpy()
    picture = picture[..., 0] if picture.shape[-1] == 1 else picture
    if tiles_maps(model):
        if layer is not None:
            raise ValueError("viz: --layer picks a ViT's layer; a Swin's PNG draws each stage's last block "
                             "(the page, --html, has every block)")
        panels = map_panels(model, pixels)
    else:
        crop, panels = _token_panels(model, pixels, layer)
        picture = picture[: crop[0], : crop[1]]
    rows, cols, _ = figure_layout(len(panels) - 1)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * PANEL_INCHES, rows * PANEL_INCHES), dpi=DPI, squeeze=False)
    for ax in axes.flat:
        ax.set_axis_off()
    axes.flat[0].imshow(picture, cmap="gray" if picture.ndim == 2 else None)
    axes.flat[0].set_title("input", fontsize=8)
    for ax, (title, heat, cell) in zip(axes.flat[1:], panels):
        _overlay(ax, picture, heat, title, cell)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.92, wspace=0.05, hspace=0.15)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
