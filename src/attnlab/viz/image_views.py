"""Views of an image classifier's attention that the explorer page draws over the image itself.

    views = image_views(model, processor, "cat.png")    # each view's .image: the picture and its grid

Each view is an ordinary (L, H, T, S) :class:`~attnlab.viz.views.View` whose ``image`` says
which picture its keys tile (:class:`ImageGrid`): the page tints every patch by the weight the
chosen query gives it. By what the model's mixers report (no family is named here):

- **attention over the patches** (one grid, and the tokens the config names before it, such as a
  class token and a distillation token: ViT, DeiT): the self-attention of every layer over
  prefix + rows * cols tokens, and the attention rollout of attnlab.viz.image.attention_rollout
  as a (1, 1, T, T) view (row t: how much of token t's final state comes, through attention and
  residuals, from each input token).
- **mixers that tile maps** (attnlab.nn.record ``tiles_map``: attention inside windows of a map
  that each stage halves, as a Swin's; no class token): one view per stage, its blocks as layers.
  Each block reports its weights put back on the stage's (rows, cols) map (attnlab.nn.window.
  on_the_map), so query (r, c) has weights on the tokens of its own (shifted) window and zero
  elsewhere (keys of the padding a map gets when the window does not divide it are left out, so
  such rows sum to less than 1). The rollout follows Abnar and Zuidema within each stage and
  treats a patch merging as the average of the four tokens it concatenates (as rollout treats
  the MLPs and norms: as passing the token on), then averages the last stage's rows as the
  classifier pools them: a (1, 1, 1, patches) view, "[pooled]", of where the pooled output comes from.
"""
from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from .image import (attention_rollout, image_attention, is_swin, map_rollout, map_stage_weights, stage_cell,
                    swin_rollout, swin_stage_weights, tiles_maps)
from .labels import PatchGrid
from .views import View

__all__ = ["ImageGrid", "image_views", "tiles_maps", "png_bytes", "map_stage_weights", "map_rollout",
           "is_swin", "swin_stage_weights", "swin_rollout"]


@dataclass(frozen=True, eq=False)
class ImageGrid:
    """The picture a view's keys tile: ``png`` (the bytes of a PNG of the image as the model saw
    it), the key tokens ``prefix`` (how many come before the patches) then ``rows`` x ``cols``
    patches, row by row, each ``cell`` (height, width) pixels of the picture. The page tints
    patch (r, c) over the pixels (r * height, c * width) onwards, clipped to the picture."""
    png: bytes
    rows: int
    cols: int
    cell: tuple[int, int]
    prefix: int = 0


def png_bytes(picture: np.ndarray) -> bytes:
    """(H, W) or (H, W, C) uint8 -> PNG bytes."""
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(picture[..., 0] if picture.ndim == 3 and picture.shape[-1] == 1 else picture).save(buf, "PNG")
    return buf.getvalue()


def _picture(processor, image) -> tuple[Tensor, np.ndarray]:
    shown = processor.resized(image)                           # (C, H, W) uint8: what the model reads
    return processor.finish(shown)[None], shown.permute(1, 2, 0).numpy()


def _token_views(model, pixels, png) -> list[View]:
    weights, grid = image_attention(model, pixels)
    labels = grid()
    at = ImageGrid(png, grid.rows, grid.cols, grid.patch_size, len(grid.prefix))
    L, H = weights.shape[:2]
    rollout = attention_rollout(weights.cpu())[None, None]
    return [View("layers/self", f"self-attention ({L} layers, {H} heads)", weights.cpu(), labels, labels, image=at),
            View("rollout", "attention rollout (all layers, heads averaged)", rollout, labels, labels, image=at)]


def _map_views(model, pixels, png) -> list[View]:
    stages = map_stage_weights(model, pixels)
    views, patch = [], model.config.patch_size
    for s, (w, (rows, cols)) in enumerate(stages):
        side = stage_cell(patch, stages[0][1], (rows, cols))
        labels = PatchGrid((rows, cols), 1, ())()
        views.append(View(f"stage{s + 1}/self", f"stage {s + 1} window attention ({rows}x{cols} tokens)", w.cpu(),
                          labels, labels, image=ImageGrid(png, rows, cols, (side, side))))
    rows, cols = stages[0][1]
    views.append(View("rollout", "attention rollout of the pooled output (merges as averages)",
                      map_rollout(stages)[None, None, None], ["[pooled]"], PatchGrid((rows, cols), 1, ())(),
                      image=ImageGrid(png, rows, cols, (patch, patch))))
    return views


@torch.no_grad()
def image_views(model: nn.Module, processor, image) -> list[View]:
    """The views of ``image`` (a path, PIL image or uint8 array, through ``processor``, an
    :class:`attnlab.processors.ImageProcessor`) in ``model`` (module docstring)."""
    pixels, picture = _picture(processor, image)
    pixels = pixels.to(next(model.parameters()).device)
    model.eval()
    if tiles_maps(model):
        return _map_views(model, pixels, png_bytes(picture))
    patch = model.config.patch_size
    rows, cols = pixels.size(2) // patch, pixels.size(3) // patch
    return _token_views(model, pixels, png_bytes(np.ascontiguousarray(picture[: rows * patch, : cols * patch])))
