"""Group-wise weight-only quantisation: the layouts, round-to-nearest, and the quantised Linear.

A weight matrix W (out, in) is cut along its input dimension into groups of ``group_size``
values; each group g of a row keeps a scale d and an offset m (fp16, as GGUF stores them) and
every weight an unsigned code q of ``bits`` bits:

    w ~ d * q + m,      q in [0, 2**bits - 1]

Three layouts, named after the GGUF block types they become at ``group_size`` 32:

    layout  bits  round-to-nearest (llama.cpp's reference quantiser, reproduced exactly)
    q4_0    4     symmetric: d = v / -8 (v: the group's value of largest |v|), q = min(15, trunc(w/d + 8.5)), m = -8 d
    q4_1    4     d = (max - min) / 15, m = min, q = min(15, trunc((w - min)/d + 0.5))
    q8_0    8     symmetric: d = max|w| / 127, q = roundf(w/d) + 128 (in [1, 255]), m = -128 d

The codes are computed with the fp32 d, as llama.cpp does, and d and m are then stored in fp16;
this is why re-quantising a Q4_1 tensor that was dequantised gives back its very bytes
(tests/test_compress_quant.py checks it on SmolLM2's file). Other group sizes (64, 128, ...) use
the same formulas; only size 32 maps onto a GGUF block (:func:`attnlab.gguf.encode_blocks`).

:class:`QuantLinear` keeps ``qweight`` (4 bits: two codes per byte, (out, in/2) uint8; 8 bits:
(out, in) uint8), ``scales`` and ``offsets`` ((out, in/group) fp16) and an fp32 bias. Its
forward at a few rows (decoding) on CPU runs torch's packed kernels on bf16 activations:
``_weight_int4pack_mm_for_cpu`` for 4 bits (which computes (q - 8) * s + z: z = m + 8 d), and
``_weight_int8pack_mm`` for 8 bits with one group per row; everything else dequantises blocks of
rows to the input's dtype and calls ``F.linear`` (exact weight-only arithmetic). The packed copy
is derived (``_cache``), rebuilt after ``.to()`` or a state-dict load, never saved.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Layout", "LAYOUTS", "layout_for", "quantize_rtn", "dequantize", "codes_for", "QuantLinear",
           "pack_int4", "unpack_int4"]


@dataclass(frozen=True)
class Layout:
    name: str
    bits: int
    symmetric: bool

    @property
    def qtype(self) -> str:
        """The GGUF block type of this layout at group size 32."""
        return self.name.upper()

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


LAYOUTS = {"q4_0": Layout("q4_0", 4, True), "q4_1": Layout("q4_1", 4, False), "q8_0": Layout("q8_0", 8, True)}


def layout_for(bits: int, symmetric: bool | None = None) -> Layout:
    """The layout of ``bits`` (4 or 8); 4 bits are asymmetric (q4_1) unless ``symmetric``; 8 bits
    are symmetric (q8_0: GGUF has no stored asymmetric 8-bit type)."""
    if bits == 4:
        return LAYOUTS["q4_0" if symmetric else "q4_1"]
    if bits == 8:
        if symmetric is False:
            raise ValueError("8-bit quantisation is symmetric only (GGUF's Q8_0)")
        return LAYOUTS["q8_0"]
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def _groups(weight: Tensor, group_size: int) -> Tensor:
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    if group_size <= 0 or weight.size(1) % group_size:
        raise ValueError(f"group size {group_size} does not divide the input width {weight.size(1)}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("the weight has inf or NaN entries")
    return w.reshape(w.size(0), -1, group_size)


def _roundf(x: Tensor) -> Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def quantize_rtn(weight: Tensor, layout: Layout | str, group_size: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Round-to-nearest (the module docstring's formulas): (codes (out, in) uint8, scales and
    offsets (out, in/group_size) fp16)."""
    layout = LAYOUTS[layout] if isinstance(layout, str) else layout
    g = _groups(weight, group_size)
    if layout.name == "q4_1":
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.clamp(torch.trunc((g - lo) * _inverse(d) + 0.5), max=15)
        m = lo
    elif layout.name == "q4_0":
        idx = g.abs().argmax(-1, keepdim=True)             # the first of equal magnitudes, as llama.cpp's loop
        d = torch.gather(g, -1, idx) / -8
        q = torch.clamp(torch.trunc(g * _inverse(d) + 8.5), max=15)
        m = None
    else:                                                  # q8_0
        d = g.abs().amax(-1, keepdim=True) / 127
        q = _roundf(g * _inverse(d)) + 128
        m = None
    d16 = d.squeeze(-1).half()
    m16 = m.squeeze(-1).half() if m is not None else (-float(1 << (layout.bits - 1)) * d16.float()).half()
    return q.reshape(weight.shape).to(torch.uint8), d16, m16


def dequantize(codes: Tensor, scales: Tensor, offsets: Tensor, dtype=torch.float32) -> Tensor:
    """w = d * q + m per group: codes (out, in), scales/offsets (out, in/group) -> (out, in)."""
    n, k = codes.shape
    g = k // scales.size(1)
    w = codes.reshape(n, -1, g).to(dtype) * scales.to(dtype)[..., None] + offsets.to(dtype)[..., None]
    return w.reshape(n, k)


def codes_for(w: Tensor, scales: Tensor, offsets: Tensor, qmax: int) -> Tensor:
    """The nearest codes of ``w`` (out, n) given each row's scale and offset (out,) (fp32 math):
    clamp(round((w - m) / d), 0, qmax). GPTQ quantises one column at a time with it."""
    d, m = scales.float(), offsets.float()
    return torch.clamp(torch.round((w - m) * _inverse(d)), 0, qmax)


def pack_int4(codes: Tensor) -> Tensor:
    """(out, in) codes 0..15 -> (out, in/2) uint8, code 2j in the low nibble, 2j + 1 in the high."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: Tensor) -> Tensor:
    lo, hi = packed & 15, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.size(0), -1)


# ----------------------------------------------------------------------------- the Linear
INT4PACK_GROUPS = (32, 64, 128, 256)     # the group sizes torch's CPU int4 kernel takes
PACKED_MAX_ROWS = 8                       # above this many rows the dequantised fp32 GEMM is as fast
_DEQUANT_BLOCK = 1 << 22


def _has(name: str) -> bool:
    try:
        return hasattr(torch.ops.aten, name)
    except (RuntimeError, AttributeError):
        return False


_HAS_INT4 = _has("_weight_int4pack_mm_for_cpu") and _has("_convert_weight_to_int4pack_for_cpu")
_HAS_INT8 = _has("_weight_int8pack_mm")


class QuantLinear(nn.Module):
    """y = x @ dequantize(qweight, scales, offsets).T + bias: a Linear with group-wise 4- or 8-bit
    weights (see the module docstring). ``weight`` returns the dequantised fp32 weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Layout | str, group_size: int,
                 device=None):
        super().__init__()
        layout = LAYOUTS[layout] if isinstance(layout, str) else layout
        if in_features % group_size or (layout.bits == 4 and in_features % 2):
            raise ValueError(f"QuantLinear: group size {group_size} does not divide in_features {in_features}")
        self.in_features, self.out_features, self.layout, self.group_size = in_features, out_features, layout, group_size
        width = in_features // 2 if layout.bits == 4 else in_features
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=torch.uint8, device=device))
        groups = in_features // group_size
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("offsets", torch.zeros(out_features, groups, dtype=torch.float16, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._cache: dict = {}

    @classmethod
    def from_codes(cls, codes: Tensor, scales: Tensor, offsets: Tensor, layout: Layout | str,
                   bias: Tensor | None = None) -> QuantLinear:
        n, k = codes.shape
        out = cls(k, n, bias is not None, layout, k // scales.size(1), device=codes.device)
        out.qweight.copy_(pack_int4(codes) if out.layout.bits == 4 else codes.to(torch.uint8))
        out.scales.copy_(scales)
        out.offsets.copy_(offsets)
        if bias is not None:
            out.bias.copy_(bias.detach().float())
        return out

    @classmethod
    def from_linear(cls, linear: nn.Linear, layout: Layout | str, group_size: int = 32) -> QuantLinear:
        """Round-to-nearest quantisation of one ``nn.Linear``."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"QuantLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        return cls.from_codes(*quantize_rtn(linear.weight, layout, group_size), layout, linear.bias)

    def codes(self) -> Tensor:
        return unpack_int4(self.qweight) if self.layout.bits == 4 else self.qweight

    @property
    def weight(self) -> Tensor:
        return dequantize(self.codes(), self.scales, self.offsets)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={self.layout.name}, group_size={self.group_size}")

    def _apply(self, fn, recurse=True):
        self._cache = {}
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache = {}
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["_cache"] = {}
        return state

    def _packed_path(self, x2: Tensor) -> str | None:
        if x2.device.type != "cpu" or x2.size(0) > PACKED_MAX_ROWS or (x2.requires_grad and torch.is_grad_enabled()):
            return None
        if self.layout.bits == 4 and _HAS_INT4 and self.group_size in INT4PACK_GROUPS:
            return "int4"
        if self.layout.bits == 8 and _HAS_INT8 and self.group_size == self.in_features and self.in_features % 32 == 0:
            return "int8"
        return None

    def _int4(self, x2: Tensor) -> Tensor:
        if "int4" not in self._cache:
            w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes().to(torch.int32).contiguous(), 1)
            d = self.scales.float()
            zero = self.offsets.float() + 8 * d                       # torch's kernel: (q - 8) * d + zero
            self._cache["int4"] = (w, torch.stack([d.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous())
        w, sz = self._cache["int4"]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(torch.bfloat16).contiguous(), w, self.group_size, sz)
        return y.to(x2.dtype)

    def _int8(self, x2: Tensor) -> Tensor:
        if "int8" not in self._cache:                                # one group per row: w = d (q - 128)
            w = (self.qweight.to(torch.int16) - 128).to(torch.int8).contiguous()
            self._cache["int8"] = (w, self.scales[:, 0].to(torch.bfloat16).contiguous())
        w, s = self._cache["int8"]
        return torch.ops.aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), w, s).to(x2.dtype)

    def _dequant(self, x2: Tensor) -> Tensor:
        rows = max(1, _DEQUANT_BLOCK // self.in_features)
        codes, dt = self.codes(), x2.dtype
        parts = [F.linear(x2, dequantize(codes[i:i + rows], self.scales[i:i + rows], self.offsets[i:i + rows], dt))
                 for i in range(0, self.out_features, rows)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(f"QuantLinear: input last dim {x.size(-1)} != in_features {self.in_features}")
        x2 = x.reshape(-1, self.in_features)
        path = self._packed_path(x2)
        y = self._int4(x2) if path == "int4" else self._int8(x2) if path == "int8" else self._dequant(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)
