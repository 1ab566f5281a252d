"""How the text of a model that reads an image as tokens looks at the image.

A vision-language model (a vision tower, a projector, a causal LM) puts one token per image feature
among the text's tokens: the ids hold ``config.image_token_id`` at those positions, and the
language model's self-attention runs over the whole sequence. What a question's and an answer's
tokens read from the picture is therefore a block of that attention: rows at the text positions,
columns at the image positions.

    a = image_text_attention(model, ids, pixel_values)   # ImageTextAttention
    a.weights        # (L, H, T, T): the language model's self-attention, every layer and head
    a.image_map      # (L, H, N_text, P): the text rows, the image columns
    a.image_share    # (L, H, N_text): how much of each text row goes to the image (<= 1)
    draw_image_text_attention(a, picture, labels, "out.png")

The weights come from :func:`attnlab.viz.record.record_attention`, the recording every attention
layer reports through (whatever kernel ran): the language model is the layer stack that runs last,
over the ids' positions (the vision tower runs first, over its patches, and the language model
reads what it gave). The image tokens tile the
picture as the tower cuts it: ``image_size // patch_size`` a side (the family's stated input
limits), after one class row where the model keeps it. Nothing here names a family.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from .image_views import ImageGrid, png_bytes  # noqa: E402
from .labels import PatchGrid  # noqa: E402
from .record import record_attention  # noqa: E402
from .views import View  # noqa: E402

__all__ = ["ImageTextAttention", "image_text_attention", "image_text_views", "draw_image_text_attention"]

MAX_TOKEN_PANELS = 8


@dataclass
class ImageTextAttention:
    """The language model's self-attention over one prompt with its image (module docstring):
    ``weights`` (L, H, T, T); ``image_positions`` (P,) and ``text_positions`` (N_text,) index T;
    the image tokens tile a ``rows`` x ``cols`` grid after ``prefix`` tokens (a class row)."""
    weights: Tensor
    image_positions: Tensor
    text_positions: Tensor
    rows: int
    cols: int
    prefix: int

    @property
    def image_map(self) -> Tensor:
        """(L, H, N_text, P): each text position's attention to each image token."""
        return self.weights[:, :, self.text_positions][..., self.image_positions]

    @property
    def image_share(self) -> Tensor:
        """(L, H, N_text): the part of each text row's attention that goes to the image."""
        return self.image_map.sum(-1)

    def patch_map(self, layer: int | None = None) -> Tensor:
        """(N_text, rows, cols): the attention to the patches, averaged over the heads and over
        every layer (or ``layer``'s, from 0); a kept class row is left out."""
        w = self.image_map if layer is None else self.image_map[layer:layer + 1]
        return w.mean((0, 1))[:, self.prefix:].reshape(-1, self.rows, self.cols)


def _image_grid(model: nn.Module, n_image: int) -> tuple[int, int, int]:
    """(rows, cols, prefix) of the image tokens, from the family's stated image and patch sizes."""
    from ..models.registry import input_limits
    limits = input_limits(model)
    side = limits["image_size"] // limits["patch_size"]
    prefix = n_image - side * side
    if prefix not in (0, 1):
        raise ValueError(f"viz: {n_image} image tokens do not tile the {side}x{side} patches of the image tower")
    return side, side, prefix


@torch.no_grad()
def image_text_attention(model: nn.Module, ids: Sequence[int], pixel_values: Tensor) -> ImageTextAttention:
    """Run ``model`` on one prompt (``ids``, holding ``model.config.image_token_id`` once per image
    token) and its image (pixel values (1, C, H, W)), recording the language model's attention."""
    image_token = model.config.image_token_id
    x = torch.tensor([list(ids)], device=pixel_values.device)
    model.eval()
    with record_attention(model) as record:
        model(x, pixel_values)
    T, last = x.size(1), record.parts("self")[-1]        # the stack that ran last read what the tower gave
    if record.select(part=last, role="self")[0].weights.size(-2) != T:
        raise ValueError(f"viz: the last layer stack to run ({last!r}) did not read the {T} tokens of the prompt")
    weights = record.stack("self", part=last)[:, 0].float().cpu()
    is_image = x[0].cpu() == image_token
    if not is_image.any():
        raise ValueError("viz: the prompt holds no image token")
    image, text = is_image.nonzero().flatten(), (~is_image).nonzero().flatten()
    rows, cols, prefix = _image_grid(model, len(image))
    return ImageTextAttention(weights, image, text, rows, cols, prefix)


def image_text_views(a: ImageTextAttention, picture: np.ndarray, labels: Sequence[str]) -> list[View]:
    """The explorer's views: the text rows over the image's patches (drawn over ``picture``, the
    (H, W, C) uint8 image as the model saw it), and the whole self-attention. ``labels``: one per
    token of the prompt."""
    H, W = picture.shape[:2]
    cell = (H // a.rows, W // a.cols)
    grid = ImageGrid(png_bytes(np.ascontiguousarray(picture[:a.rows * cell[0], :a.cols * cell[1]])), a.rows, a.cols,
                     cell, a.prefix)
    patches = PatchGrid((a.rows * cell[0], a.cols * cell[1]), cell, ("[image CLS]",) * a.prefix)()
    text = [labels[int(i)] for i in a.text_positions]
    L, heads = a.weights.shape[:2]
    return [View("text-to-image", f"text to image attention ({L} layers, {heads} heads)", a.image_map, text, patches,
                 image=grid),
            View("layers/self", f"language model self-attention ({L} layers, {heads} heads)", a.weights, list(labels),
                 list(labels))]


def draw_image_text_attention(a: ImageTextAttention, picture: np.ndarray, labels: Sequence[str], out: str | Path,
                              layer: int | None = None) -> Path:
    """One PNG: the image; the text positions x image patches heatmap (heads and layers averaged,
    or ``layer``'s from 0); then, per text token (the last :data:`MAX_TOKEN_PANELS`), its attention
    to the patches painted over the image, with the share of its attention that went to the image."""
    if layer is not None and not 0 <= layer < a.weights.size(0):
        raise ValueError(f"--layer must be in 1..{a.weights.size(0)}, got {layer + 1}")
    maps = a.patch_map(layer)                                       # (N_text, rows, cols)
    share = (a.image_share if layer is None else a.image_share[layer:layer + 1]).mean((0, 1))
    text = [labels[int(i)] for i in a.text_positions]
    shown = list(range(len(text)))[-MAX_TOKEN_PANELS:]
    n = 2 + len(shown)
    cols = min(n, 5)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    H, W = picture.shape[:2]
    axes.flat[0].imshow(picture, cmap="gray" if picture.ndim == 2 else None, interpolation="nearest")
    axes.flat[0].set_title("the image", fontsize=9)
    ax = axes.flat[1]
    ax.axis("on")
    ax.imshow(maps.flatten(1).numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(text)), text, fontsize=7)
    ax.set_xticks([])
    ax.set_xlabel(f"image patches ({a.rows}x{a.cols}, row by row)", fontsize=7)
    ax.set_title("text -> image", fontsize=9)
    for k, t in enumerate(shown):
        ax = axes.flat[2 + k]
        ax.imshow(picture, cmap="gray" if picture.ndim == 2 else None, interpolation="nearest")
        ax.imshow(maps[t].numpy(), cmap="inferno", alpha=0.6, extent=(-0.5, W - 0.5, H - 0.5, -0.5),
                  interpolation="nearest")
        ax.set_title(f"{text[t]!r}: {100 * float(share[t]):.0f}% on the image", fontsize=8)
    which = "all layers" if layer is None else f"layer {layer + 1}"
    fig.suptitle(f"where the text looks in the image ({which}, heads averaged)", fontsize=10)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
