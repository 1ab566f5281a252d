"""Images as sequences: patch embedding and a learned position table over the patch grid.

    pixel_values (B, C, H, W) --Conv2d(kernel = stride = p)--> (B, E, H/p, W/p) --flatten--> (B, P, E)

A p x p patch of C channels is p*p*C numbers; one linear map of them to E values per patch is
exactly a convolution whose kernel and stride are both p (Dosovitskiy et al. 2021, "An Image is
Worth 16x16 Words", section 3.1). At 224 px with p = 16 the grid is 14 x 14 = 196 patches.

The position table is learned, one row per prefix token (the class token, DeiT's distillation
token) and one per grid cell. A model trained at one size can read another: the grid part of
the table is resized bicubically to the new grid, the prefix rows kept, as transformers'
``interpolate_pos_encoding`` and timm's ``resample_abs_pos_embed`` do.

A convolutional tokeniser (:class:`ConvTokenizer`, CCT's, Hassani et al. 2021, "Escaping the Big
Data Paradigm with Compact Transformers", section 3.2) stands where the patch embedding stands:
L layers of [3x3 convolution, ReLU, 3x3 max-pool of stride 2] halve the side L times, so the grid is
that of patches of 2^L pixels, with overlapping receptive fields instead of cut-out patches; and
:class:`SequencePooling` (section 3.1) reads a classifier's input as an attention-weighted mean of
the tokens instead of a class token.

Shape letters: B batch, C channels, H x W pixels, p patch side, P patches, E width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PatchEmbedding", "ConvTokenizer", "SequencePooling", "PatchPositionEmbedding", "interpolate_grid_table",
           "patch_grid"]


def _pair(x) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (tuple, list)) else (int(x), int(x))


def patch_grid(height: int, width: int, patch_size: int) -> tuple[int, int]:
    """The (rows, columns) of patches a (height, width) image gives: pixels beyond the last whole
    patch are dropped, as a convolution with stride ``patch_size`` drops them."""
    return height // patch_size, width // patch_size


class PatchEmbedding(nn.Module):
    """Cut an image into p x p patches and map each linearly to ``embed_dim`` values.

    ``PatchEmbedding(img_size, patch_size, in_channels, embed_dim)``: the chapter's names (``bias``
    False: a projection without bias, as CLIP's).
    ``proj`` is the Conv2d(in_channels, embed_dim, kernel_size=p, stride=p); ``grid`` the patch
    grid of an ``img_size`` image and ``num_patches`` its size.

    forward(x (B, C, H, W)) -> (B, P, E), patches in row-major order, P = (H // p) * (W // p);
    any H, W of at least one patch (a model with a position table decides what sizes it reads).
    """

    def __init__(self, img_size: int | tuple[int, int] = 224, patch_size: int = 16, in_channels: int = 3,
                 embed_dim: int = 768, bias: bool = True):
        super().__init__()
        self.img_size = _pair(img_size)
        for name, v in (("patch_size", patch_size), ("in_channels", in_channels), ("embed_dim", embed_dim),
                        ("img_size", min(self.img_size))):
            if v <= 0:
                raise ValueError(f"PatchEmbedding: {name} must be positive, got {v}")
        if self.img_size[0] % patch_size or self.img_size[1] % patch_size:
            raise ValueError(f"PatchEmbedding: img_size {self.img_size} is not a multiple of patch_size {patch_size}")
        self.patch_size, self.in_channels, self.embed_dim = patch_size, in_channels, embed_dim
        self.grid = patch_grid(*self.img_size, patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.size(1) != self.in_channels:
            raise ValueError(f"PatchEmbedding: expected pixel values (batch, {self.in_channels}, height, width), got "
                             f"shape {tuple(x.shape)}")
        if x.size(2) < self.patch_size or x.size(3) < self.patch_size:
            raise ValueError(f"PatchEmbedding: a {x.size(2)}x{x.size(3)} image is smaller than one "
                             f"{self.patch_size}x{self.patch_size} patch")
        return self.proj(x).flatten(2).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, patch_size={self.patch_size}, grid={self.grid}"


class ConvTokenizer(nn.Module):
    """Images to tokens through ``layers`` x [Conv2d(k x k, stride 1, padding k // 2, no bias) ->
    ReLU -> MaxPool2d(3, stride 2, padding 1)], C -> E channels in the first layer, E -> E after it
    (CCT's tokeniser; its wider models keep 64 channels between the layers, here the width is E).

    ``patch_size`` = 2^layers: each pooling halves the side (rounding up), so an image whose side
    ``patch_size`` divides gives the grid :class:`PatchEmbedding` would, and a model's position
    table and image-size checks need not know which tokeniser made the tokens.

    forward(x (B, C, H, W)) -> (B, P, E), tokens in row-major order, P = ceil(H / 2^L) * ceil(W / 2^L).
    """

    def __init__(self, img_size: int | tuple[int, int], layers: int, in_channels: int, embed_dim: int,
                 kernel_size: int = 3):
        super().__init__()
        self.img_size = _pair(img_size)
        for name, v in (("layers", layers), ("in_channels", in_channels), ("embed_dim", embed_dim),
                        ("kernel_size", kernel_size)):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ConvTokenizer: {name} must be a positive integer, got {v!r}")
        if kernel_size % 2 == 0:
            raise ValueError(f"ConvTokenizer: kernel_size must be odd (padding keeps the size), got {kernel_size}")
        self.patch_size, self.in_channels, self.embed_dim = 2 ** layers, in_channels, embed_dim
        if self.img_size[0] % self.patch_size or self.img_size[1] % self.patch_size:
            raise ValueError(f"ConvTokenizer: img_size {self.img_size} is not a multiple of 2^layers = {self.patch_size}")
        self.grid = patch_grid(*self.img_size, self.patch_size)
        self.num_patches = self.grid[0] * self.grid[1]
        self.convs = nn.ModuleList(
            nn.Conv2d(in_channels if i == 0 else embed_dim, embed_dim, kernel_size, padding=kernel_size // 2,
                      bias=False) for i in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or x.size(1) != self.in_channels:
            raise ValueError(f"ConvTokenizer: expected pixel values (batch, {self.in_channels}, height, width), got "
                             f"shape {tuple(x.shape)}")
        if x.size(2) % self.patch_size or x.size(3) % self.patch_size:     # else its grid would not be the patches'
            raise ValueError(f"ConvTokenizer: a {x.size(2)}x{x.size(3)} image; its {len(self.convs)} layers need "
                             f"sides that {self.patch_size} divides")
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), kernel_size=3, stride=2, padding=1)
        return x.flatten(2).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"img_size={self.img_size}, layers={len(self.convs)}, grid={self.grid}"


class SequencePooling(nn.Module):
    """An attention-weighted mean of the tokens, one vector per image: ``w = softmax_t(x_t g + b)``,
    ``pooled = sum_t w_t x_t``, with g (E,) and b learned (``proj``: Linear(E, 1)).

    forward(x (B, T, E)) -> (B, E)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.proj = nn.Linear(embed_dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        weights = torch.softmax(self.proj(x).float(), dim=1).to(x.dtype)      # (B, T, 1)
        return (weights * x).sum(1)


def interpolate_grid_table(table: Tensor, prefix: int, grid: tuple[int, int], new_grid: tuple[int, int]) -> Tensor:
    """A position table (1, prefix + gh * gw, E) for the grid ``grid`` resized to ``new_grid``:
    the first ``prefix`` rows kept, the grid rows laid out as a (gh, gw) image of E channels and
    resized bicubically (align_corners False, no antialiasing), as transformers' ViT and DeiT
    ``interpolate_pos_encoding`` do. The same grid gives the table itself."""
    if tuple(new_grid) == tuple(grid):
        return table
    gh, gw = grid
    if table.size(1) != prefix + gh * gw:
        raise ValueError(f"interpolate_grid_table: a table of {table.size(1)} rows is not {prefix} prefix rows and a "
                         f"{gh}x{gw} grid")
    E = table.size(-1)
    cells = table[:, prefix:].reshape(1, gh, gw, E).permute(0, 3, 1, 2)
    cells = F.interpolate(cells, size=tuple(new_grid), mode="bicubic", align_corners=False)
    return torch.cat([table[:, :prefix], cells.permute(0, 2, 3, 1).reshape(1, -1, E)], dim=1)


class PatchPositionEmbedding(nn.Module):
    """A learned position table: ``prefix`` rows for the prefix tokens, then one per cell of the
    ``grid`` (rows, columns), in the order :class:`PatchEmbedding` lays the patches out.

    forward(x (B, prefix + P, E), grid=None) -> x + table: ``grid`` the (rows, columns) of the
    patches in x when they differ from the table's (another image size); the table is then
    resized to it (:func:`interpolate_grid_table`). ``weight`` (1, prefix + gh * gw, E), initialised
    ~ N(0, 0.02) truncated at two standard deviations, as ViT's and timm's; exempt from weight
    decay (decay would pull the positions together).
    """

    def __init__(self, grid: int | tuple[int, int], embed_dim: int, prefix: int = 1):
        super().__init__()
        self.grid, self.prefix = _pair(grid), prefix
        if min(self.grid) <= 0 or prefix < 0 or embed_dim <= 0:
            raise ValueError(f"PatchPositionEmbedding: need a positive grid and width and prefix >= 0, got grid "
                             f"{self.grid}, embed_dim {embed_dim}, prefix {prefix}")
        self.weight = nn.Parameter(torch.empty(1, prefix + self.grid[0] * self.grid[1], embed_dim))
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.04, b=0.04)

    def table(self, grid: tuple[int, int] | None = None) -> Tensor:
        """The (1, prefix + rows * columns, E) table for ``grid`` (default: the table's own)."""
        return self.weight if grid is None else interpolate_grid_table(self.weight, self.prefix, self.grid, grid)

    def forward(self, x: Tensor, grid: tuple[int, int] | None = None) -> Tensor:
        table = self.table(grid)
        if x.shape[1:] != table.shape[1:]:
            raise ValueError(f"PatchPositionEmbedding: input of shape {tuple(x.shape)} does not match a table of "
                             f"{table.size(1)} rows ({self.prefix} prefix + grid {grid or self.grid}) of width "
                             f"{table.size(-1)}")
        return x + table

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("weight",)

    def extra_repr(self) -> str:
        return f"grid={self.grid}, prefix={self.prefix}, embed_dim={self.weight.size(-1)}"
