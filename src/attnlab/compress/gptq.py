"""GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", §3-4) and HQQ (Badri & Shaji 2023, "Half-Quadratic Quantization of
Large Machine Learning Models"), each for one weight matrix, in the layouts of :mod:`.quant`.

GPTQ quantises the columns (input features) of W (out, in) one after another and spreads each
column's rounding error over the columns not yet quantised, so as to keep the layer's output on
calibration inputs X (tokens, in) close: it minimises ||X W^T - X Q^T||^2 greedily, with the
Hessian H = 2 X^T X of that error. After column i is rounded (error e = w_i - q_i), the optimal
update of the remaining columns F is (the OBS step, the paper's eq. 3)

    W[:, F] -= e / [H_F^-1]_ii  *  [H_F^-1]_{i, F}

and H_F^-1 loses row and column i (one step of Gaussian elimination). The rows of the upper
Cholesky factor U of H^-1 hold exactly those eliminated rows, scaled by sqrt([H_F^-1]_ii), so the
update is ``W[:, i:] -= (e / U_ii) U_{i, i:}`` (§4, step 3), applied lazily in blocks of columns.
Dampening adds ``damp`` x mean(diag H) to the diagonal; a column no input ever reached (H_ii = 0)
is set to zero. A group's scale and offset are computed, by the layout's round-to-nearest rule,
from that group's weights as updated when its first column comes up.

HQQ needs no data: for a group it keeps the scale of round-to-nearest and searches the offset
(zero point) that minimises the l_p error (p < 1, robust to the few large weights) of the
dequantised weights, by half-quadratic splitting: alternately shrink the error
W_e = shrink_p(W - dequant(W_q)) and set the zero to the mean that fits W - W_e, with the penalty
beta growing by kappa every step; the best zero seen is kept. Asymmetric layout (q4_1) only.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .quant import LAYOUTS, Layout, codes_for, quantize_rtn

__all__ = ["gptq", "hqq"]


def _group_params(w: Tensor, layout: Layout) -> tuple[Tensor, Tensor]:
    """(d, m) (out,) fp16 of one group's current weights (out, g), by the layout's RTN rule."""
    _, d, m = quantize_rtn(w, layout, w.size(1))
    return d[:, 0], m[:, 0]


def gptq(weight: Tensor, hessian: Tensor, layout: Layout | str, group_size: int = 32, *, damp: float = 0.01,
         block_size: int = 128, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor]:
    """GPTQ of ``weight`` (out, in) with ``hessian`` (in, in) = sum of x x^T over calibration
    inputs (any positive multiple: the updates do not depend on the factor) -> (codes (out, in)
    uint8, scales, offsets (out, in/group_size) fp16), as :func:`.quant.quantize_rtn` returns."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"gptq: the Hessian is {tuple(hessian.shape)}, the weight has {k} input features")
    if k % group_size:
        raise ValueError(f"gptq: group size {group_size} does not divide the input width {k}")
    block_size = max(group_size, block_size // group_size * group_size)     # a group never straddles two blocks
    W = weight.detach().to(dtype).clone()
    H = hessian.detach().to(dtype).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * torch.diagonal(H).mean() * torch.eye(k, dtype=dtype)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // group_size, dtype=torch.float16)
    offsets = torch.empty_like(scales)
    for b0 in range(0, k, block_size):
        b1 = min(b0 + block_size, k)
        W1, E1, U1 = W[:, b0:b1], torch.zeros(n, b1 - b0, dtype=dtype), U[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group_size == 0:
                d, m = _group_params(W1[:, j:j + group_size], layout)
                scales[:, col // group_size], offsets[:, col // group_size] = d, m
                df, mf = d.to(dtype), m.to(dtype)
            w = W1[:, j]
            q = codes_for(w, d, m, layout.qmax).to(dtype)
            codes[:, col] = q.to(torch.uint8)
            err = (w - (df * q + mf)) / U1[j, j]
            W1[:, j:] -= err[:, None] * U1[j, j:][None, :]
            E1[:, j] = err
        W[:, b1:] -= E1 @ U[b0:b1, b1:]
    return codes, scales, offsets


def _shrink(x: Tensor, beta: float, p: float) -> Tensor:
    """The proximal step of the l_p penalty: sign(x) * relu(|x| - |x|^(p-1) / beta)."""
    return torch.sign(x) * torch.relu(x.abs() - x.abs().clamp_min(1e-12).pow(p - 1) / beta)


def hqq(weight: Tensor, layout: Layout | str = "q4_1", group_size: int = 64, *, iters: int = 20, p: float = 0.7,
        beta: float = 10.0, kappa: float = 1.01) -> tuple[Tensor, Tensor, Tensor]:
    """HQQ of ``weight`` (out, in) (no calibration data; see the module docstring) -> (codes,
    scales, offsets) as :func:`.quant.quantize_rtn` returns, in the asymmetric layout q4_1."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    if layout.symmetric:
        raise ValueError(f"hqq: searches the offset of an asymmetric layout (q4_1), not {layout.name}")
    n, k = weight.shape
    _, d16, m16 = quantize_rtn(weight, layout, group_size)             # start: RTN's scale and offset
    w = weight.detach().float().reshape(n, -1, group_size)
    s = 1.0 / d16.float().clamp_min(1e-8)[..., None]                    # HQQ's form: w ~ (w_q - z) / s
    z = -m16.float()[..., None] * s
    best_z, best = z.clone(), torch.full(z.shape, float("inf"))
    for _ in range(iters):
        wq = torch.clamp(torch.round(w * s + z), 0, layout.qmax)
        error = w - (wq - z) / s
        loss = error.abs().pow(p).mean(-1, keepdim=True)
        better = loss < best
        best, best_z = torch.where(better, loss, best), torch.where(better, z, best_z)
        we = _shrink(error, beta, p)
        z = (wq - (w - we) * s).mean(-1, keepdim=True)
        beta *= kappa
    d = (1.0 / s).squeeze(-1).half()
    m = (-best_z / s).squeeze(-1).half()
    q = codes_for(w.reshape(n, -1, group_size), d[..., None], m[..., None], layout.qmax)
    return q.reshape(n, k).to(torch.uint8), d, m
