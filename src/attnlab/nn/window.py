"""Attention inside windows: the blocks of the Swin Transformer (Liu et al. 2021, "Swin Transformer:
Hierarchical Vision Transformer using Shifted Windows", sections 3.2 and 3.3).

    x (B, H, W, C) --pad to multiples of M--> (B, Hp, Wp, C) --roll by -s (shifted blocks)-->
        --window_partition--> (B * nW, M * M, C) --attention + relative position bias [+ shift mask]-->
        --window_reverse, roll by +s, crop--> (B, H, W, C)

Each token attends only the M * M tokens of its own M x M window, so a layer costs O(n M^2) for n
tokens instead of global attention's O(n^2). Every second block shifts the windows by s = M // 2
(a cyclic roll of the feature map), so that information crosses window borders from one block to
the next. After the roll a window at the border holds pieces of the map that were not neighbours;
the shift mask lets a token attend only the tokens of its own piece (:func:`shifted_window_mask`).

The relative position bias B (added to q k^T / sqrt(D)) comes from a learned table of
(2M - 1)^2 rows, one per offset (dy, dx) between two tokens of a window, and one column per head
(:class:`WindowPositionBias`).

Sizes that do not divide: the feature map is padded with zeros on the right and bottom to a
multiple of M before the roll (the padded tokens are ordinary keys, as in transformers' Swin), the
mask is built for the padded size, and the output is cropped back. A map no larger than the window
is one window: the window shrinks to the map's shorter side and nothing is shifted
(:func:`window_and_shift`).

Shape letters: B batch, H x W feature map, C channels, M window side, nW windows per image,
s shift, h heads.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import MultiHeadAttention, combine_masks, scaled_dot_product_attention
from .norm import LayerNorm
from .position import AttentionPosition
from .record import MixerCall, ReportsMixing

__all__ = ["window_partition", "window_reverse", "window_and_shift", "shifted_window_mask", "relative_position_index",
           "WindowPositionBias", "WindowAttention", "PatchMerging", "DropPath", "pad_to_multiple", "window_order",
           "permute_tokens", "window_groups", "on_the_map"]


def pad_to_multiple(x: Tensor, multiple: int) -> Tensor:
    """(B, H, W, C) padded with zeros on the bottom and the right to multiples of ``multiple``."""
    H, W = x.shape[1:3]
    pad_h, pad_w = -H % multiple, -W % multiple
    return F.pad(x, (0, 0, 0, pad_w, 0, pad_h)) if pad_h or pad_w else x


def window_partition(x: Tensor, window: int) -> Tensor:
    """(B, H, W, C), H and W multiples of ``window`` -> (B * nW, M * M, C): the windows in row-major
    order within each image, each window's tokens in row-major order."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C).transpose(2, 3)
    return x.reshape(-1, window * window, C)


def window_reverse(windows: Tensor, window: int, height: int, width: int) -> Tensor:
    """The inverse of :func:`window_partition`: (B * nW, M * M, C) -> (B, H, W, C)."""
    C = windows.size(-1)
    x = windows.view(-1, height // window, width // window, window, window, C).transpose(2, 3)
    return x.reshape(-1, height, width, C)


def window_and_shift(height: int, width: int, window: int, shift: int) -> tuple[int, int]:
    """The window side and shift a (height, width) map uses: a map whose shorter side is at most the
    window is a single window of that side, unshifted (rolling one window changes nothing but the
    mask); otherwise the block's own."""
    if min(height, width) <= window:
        return min(height, width), 0
    return window, shift


def window_order(height: int, width: int, window: int, shift: int = 0, device=None) -> Tensor:
    """(H * W,) long: for each token of the windows of a (height, width) map rolled by -``shift``
    (the order :func:`window_partition` gives), its index in the unrolled row-major map."""
    grid = torch.arange(height * width, device=device).view(1, height, width, 1)
    if shift:
        grid = torch.roll(grid, (-shift, -shift), (1, 2))
    return window_partition(grid, window).reshape(-1)


class _Permute(torch.autograd.Function):
    """x.index_select(1, order), whose gradient is the inverse permutation's gather (indexing's own
    backward would scatter-add, slower for what is a permutation)."""

    @staticmethod
    def forward(ctx, x, order, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(1, order)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(1, inverse), None, None


def permute_tokens(x: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
    """(B, L, C) -> (B, L, C) with token j taken from ``order[j]``; ``inverse`` is
    ``argsort(order)``, the permutation that undoes it."""
    return _Permute.apply(x, order, inverse)


def shifted_window_mask(height: int, width: int, window: int, shift: int, device=None) -> Tensor:
    """Boolean (nW, M * M, M * M), True where a query may attend a key, for a (height, width) map
    (multiples of ``window``) rolled by -``shift``: two tokens of a window may attend each other
    when they come from the same piece of the unrolled map. Along each axis the roll cuts three
    pieces, [0, L - M), [L - M, L - s) and [L - s, L), so a window holds up to 3 x 3 pieces."""
    def piece(length: int) -> Tensor:
        i = torch.arange(length, device=device)
        return (i >= length - window).long() + (i >= length - shift).long()
    label = piece(height)[:, None] * 3 + piece(width)[None, :]                      # (H, W)
    label = window_partition(label[None, :, :, None], window).squeeze(-1)           # (nW, M * M)
    return label[:, :, None] == label[:, None, :]


def window_groups(height: int, width: int, window: int, shift: int, device=None) -> list[tuple[Tensor, Tensor | None]]:
    """The windows of a (height, width) map rolled by -``shift`` grouped by their shift mask: [(window
    indices (n,), their boolean (M * M, M * M) mask, or None where all may attend all)]. Only the last
    row and column of windows hold several pieces, cut alike along the row (column): the interior,
    last column, last row and corner, in the order of their first window. Unshifted: one group."""
    if not shift:
        return [(torch.arange((height // window) * (width // window), device=device), None)]
    masks = shifted_window_mask(height, width, window, shift, device).flatten(1)          # (nW, T * T)
    unique, which = torch.unique(masks.to(torch.uint8), dim=0, return_inverse=True)
    first = sorted(range(unique.size(0)), key=lambda g: int((which == g).nonzero()[0]))
    shared = [unique[g].view(window * window, -1).bool() for g in first]
    return [((which == g).nonzero().flatten(), None if bool(m.all()) else m) for g, m in zip(first, shared)]


def relative_position_index(window: int, table_window: int | None = None) -> Tensor:
    """(M * M, M * M) long: the row of a (2 Mt - 1)^2-row table for the offset (dy, dx) between
    query and key of an M x M window, ``(dy + Mt - 1) * (2 Mt - 1) + dx + Mt - 1``; ``table_window``
    Mt defaults to M. A smaller window reads the middle of a larger window's table (its offsets
    are a subset)."""
    Mt = window if table_window is None else table_window
    if window > Mt:
        raise ValueError(f"relative_position_index: a {window}x{window} window needs offsets a "
                         f"{Mt}x{Mt} window's table does not hold")
    yx = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    d = yx[:, :, None] - yx[:, None, :] + (Mt - 1)                                 # (2, T, T), offsets >= 0
    return d[0] * (2 * Mt - 1) + d[1]


class WindowPositionBias(AttentionPosition):
    """The learned relative position bias of window attention, plugged into
    :class:`~attnlab.nn.MultiHeadAttention` as its position module.

    ``table`` ((2M - 1)^2, h), initialised to zeros as in transformers' Swin (timm: N(0, 0.02));
    ``bias(q, ...)`` -> (1, h, T, T) for windows of T = m * m tokens, m <= M read from q's length
    (a map smaller than the window uses the middle of the table). The table is exempt from
    weight decay: it is a learned additive score, like a position table."""

    def __init__(self, num_heads: int, window: int):
        super().__init__()
        if num_heads <= 0 or window <= 0:
            raise ValueError(f"WindowPositionBias: num_heads ({num_heads}) and window ({window}) must be positive")
        self.num_heads, self.window = num_heads, window
        self.table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("index", relative_position_index(window), persistent=False)

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        T = q.size(-2)
        m = math.isqrt(T)
        if m * m != T or k.size(-2) != T:
            raise ValueError(f"WindowPositionBias: attention over {T} queries and {k.size(-2)} keys is not one "
                             f"square window")
        index = self.index if m == self.window else relative_position_index(m, self.window).to(self.index.device)
        return self.table[index.view(-1)].view(T, T, -1).permute(2, 0, 1).unsqueeze(0)

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("table",)

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, window={self.window}"


class WindowAttention(ReportsMixing, nn.Module):
    """(Shifted-)window multi-head self-attention over a feature map.

    ``WindowAttention(dim, num_heads, window, shift=0, dropout=0.0, qkv_bias=True)``: ``attn`` is a
    :class:`~attnlab.nn.MultiHeadAttention` (one fused Q/K/V projection) whose position module is
    a :class:`WindowPositionBias`, so attention records (attnlab.viz.record_attention) see each
    call's (B * nW, h, T, T) weights.

    The windows that share a shift mask are attended together (:func:`window_groups`): gathered
    group by group (every image's interior windows, then the last column's, ...), each group is
    one slice of the batch of windows with one (T, T) mask broadcast over it, where a mask per
    window would be (B * nW, h, T, T) scores' worth to build and check each block (the interior
    windows, most of them, need none). While attention is recorded, one call over all the windows
    in image order keeps the record's layout (transformers'), as does ``grouped = False``.

    forward(x (B, H, W, C)) -> (B, H, W, C), any H and W (see the module docstring for padding
    and for maps no larger than the window).

    To a mixer recorder (attnlab.nn.record) it reports its weights put back on the map: (B, h, N, N)
    over the N = H * W tokens in row-major order, ``grid`` (H, W); a query has weights on the
    tokens of its own (shifted) window and zero elsewhere, and keys of the padding are left out (so
    the rows of a padded window sum to less than 1)."""

    returns_new_tensor = True           # forward's output (attnlab.nn.inplace)
    tiles_map = True                    # its reports say the map (attnlab.nn.record)
    grouped = True                      # attend the windows group by group (False: one call through self.attn)

    def __init__(self, dim: int, num_heads: int, window: int, shift: int = 0, dropout: float = 0.0,
                 qkv_bias: bool = True):
        super().__init__()
        if not 0 <= shift < window:
            raise ValueError(f"WindowAttention: shift must be in [0, window) = [0, {window}), got {shift}")
        self.window, self.shift = window, shift
        self.attn = MultiHeadAttention(dim, num_heads, dropout, bias=qkv_bias, out_bias=True, fused_qkv=True,
                                       position=WindowPositionBias(num_heads, window))
        self._cache: dict[tuple, tuple] = {}

    def _layout(self, batch: int, height: int, width: int, window: int, shift: int, grouped: bool, device):
        """(order, inverse, groups), built once: ``order`` (B * H * W,) the token of the flattened maps
        each windowed row takes, ``groups`` [(windows, mask or None)] in that order; by shift mask,
        image after image within a group, or (recording) image by image with the (B * nW, 1, T, T) mask."""
        key = (batch, height, width, window, shift, grouped, str(device))
        if key not in self._cache:
            if len(self._cache) >= 4:           # a few batch sizes at most (a last, smaller batch)
                self._cache.pop(next(iter(self._cache)))
            start = torch.arange(batch, device=device)[:, None, None] * (height * width)
            base = window_order(height, width, window, shift, device).view(-1, window * window)   # (nW, T)
            if grouped:
                groups = window_groups(height, width, window, shift, device)
                order = torch.cat([(start + base[ids]).flatten() for ids, _ in groups])
                groups = [(batch * len(ids), mask) for ids, mask in groups]
            else:
                mask = shifted_window_mask(height, width, window, shift, device).repeat(batch, 1, 1)[:, None] \
                    if shift else None
                order, groups = (start + base).flatten(), [(batch * base.size(0), mask)]
            self._cache[key] = (order, torch.argsort(order), groups)
        return self._cache[key]

    def _attend(self, windows: Tensor, groups) -> Tensor:
        """Attention over (N, T, C) windows, each slice of ``groups`` with its own mask: the
        projections once, the attention function per group, the output projection once."""
        mha, (N, T, C) = self.attn, windows.shape
        q, k, v = mha._project(windows, windows, windows, None)
        bias = mha.position.bias(q, k, None, None)
        dropout = mha.dropout if self.training else 0.0
        # split, not sliced: a split's gradient is one concatenation, a slice's a zero-filled batch each
        sizes, outs = [n for n, _ in groups], []
        for qg, kg, vg, (_, allowed) in zip(q.split(sizes), k.split(sizes), v.split(sizes), groups):
            mask = combine_masks(allowed, bias, dtype=q.dtype)
            out, _ = scaled_dot_product_attention(qg, kg, vg, mask, dropout, scale=mha.scale)
            outs.append(out.transpose(1, 2))
        return mha.out_proj(torch.cat(outs).reshape(N, T, -1))

    def forward(self, x: Tensor) -> Tensor:
        B, H, W, C = x.shape
        M, s = window_and_shift(H, W, self.window, self.shift)
        x = pad_to_multiple(x, M)
        Hp, Wp = x.shape[1:3]
        captured, outer = self._listen() if self.recording else (None, None)
        one_call = self.attn.attention_record is not None or not self.grouped
        order, inverse, groups = self._layout(B, Hp, Wp, M, s, not one_call, x.device)
        # roll and partition in one gather (window_order); the inverse gather undoes both
        windows = permute_tokens(x.reshape(1, B * Hp * Wp, C), order, inverse).view(-1, M * M, C)
        try:
            out = self.attn(windows, mask=groups[0][1])[0] if one_call else self._attend(windows, groups)
        finally:
            if captured is not None:
                self.attn.attention_record = outer
        out = permute_tokens(out.view(1, -1, C), inverse, order).view(B, Hp, Wp, C)
        out = out[:, :H, :W] if (Hp, Wp) != (H, W) else out
        if captured:
            w = captured[0]
            self.report(lambda: MixerCall("window attention", (x[:, :H, :W],), out, kind="attention", grid=(H, W),
                                          title="window attention",
                                          matrix=lambda: on_the_map(w, B, H, W, M, s)))
        return out

    def _listen(self) -> tuple[list, object]:
        """([], the attention's listener before): while reported, the inner attention's weights are
        kept (as the attention records them, beside the usual kernel: the output is unchanged)."""
        captured, outer = [], self.attn.attention_record

        def listener(weights, query_start, mask):
            captured.append(weights)
            if outer is not None:
                outer(weights, query_start, mask)
        self.attn.attention_record = listener
        return captured, outer

    def extra_repr(self) -> str:
        return f"window={self.window}, shift={self.shift}"


def on_the_map(weights: Tensor, batch: int, height: int, width: int, window: int, shift: int) -> Tensor:
    """(B, h, N, N) fp32, N = height * width: the windows' (B * nW, h, M², M²) weights (image by image,
    in :func:`window_order`'s order) put back at each token's place on the map; the padding's keys
    and queries (a map padded to multiples of M) are left out."""
    Hp, Wp = -(-height // window) * window, -(-width // window) * window
    slots = window_order(Hp, Wp, window, shift, weights.device).view(-1, window * window)     # (nW, M²)
    w = weights.float().view(batch, slots.size(0), *weights.shape[1:])                      # (B, nW, h, M², M²)
    full = w.new_zeros(batch, w.size(2), Hp * Wp, Hp * Wp)
    full[:, :, slots[:, :, None], slots[:, None, :]] = w.permute(0, 2, 1, 3, 4)
    real = (torch.arange(Hp)[:, None] < height) & (torch.arange(Wp)[None, :] < width)
    keep = real.flatten().nonzero().squeeze(1).to(w.device)
    return full[:, :, keep][:, :, :, keep]


class PatchMerging(nn.Module):
    """Halve the map and double the width (Swin, section 3.1): each 2 x 2 group of tokens is
    concatenated (4C) -> LayerNorm -> linear 4C -> 2C (no bias). An odd side is padded with a
    zero row or column first. Concatenation order: (0, 0), (1, 0), (0, 1), (1, 1) as (row, column)
    offsets, the order of transformers' and the original weights.

    forward(x (B, H, W, C)) -> (B, ceil(H / 2), ceil(W / 2), 2C)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.norm = LayerNorm(4 * dim, eps=eps)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = pad_to_multiple(x, 2)
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x))


class DropPath(nn.Module):
    """Stochastic depth (Huang et al. 2016): in training, each sample's residual branch is zeroed
    with probability p and the kept ones scaled by 1 / (1 - p); identity in eval mode or at p = 0.

    forward(x (B, ...)) -> (B, ...)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"DropPath: p must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if self.p == 0.0 or not self.training:
            return x
        keep = torch.empty((x.size(0),) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
