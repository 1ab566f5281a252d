"""Faster Linear layers for inference on CPU.

A decoding step multiplies one row per sequence by every weight matrix of the model: it is bound
by how fast the weights stream from memory, not by arithmetic. On AMD CPUs oneDNN's matmul
primitive (``torch.ops.mkldnn._linear_pointwise``, what PyTorch's own CPU inference paths use
under ``torch.compile``/IPEX) streams a weight for one row nearly twice as fast as PyTorch's fp32
``F.linear`` (an MKL GEMM), and is level or ahead up to 64 rows (batched decoding) -- for weights of a few MB and up; small ones stay on ``F.linear`` (see
:data:`MIN_WEIGHT_ELEMENTS`), and so do products of many rows (prefill, an encoder's batch), where
the arithmetic, not the weight's streaming, sets the pace (:data:`MAX_FP32_ONEDNN_ROWS`). On
Intel CPUs MKL is as fast, so fp32 stays on ``F.linear`` there (:func:`fp32_onednn` decides by the
CPU's vendor), except for products of a narrow input on AVX-512, whose bias oneDNN adds inside the
product (:func:`narrow_onednn`). A feed-forward block whose first product takes oneDNN has its
activation fused into it (:func:`fused_activation`: one pass over the hidden tensor instead of
two). :class:`InferenceLinear` is an
``nn.Linear`` that takes that path when nothing needs a gradient, and :func:`optimize_for_inference`
swaps every ``nn.Linear`` of a model for one (same ``Parameter`` objects: tied weights stay tied,
``state_dict`` keys do not change).

The result equals ``F.linear``'s up to the summation order of the dot products (relative
differences ~1e-7, tests/test_linear.py). Anything else (a gradient required, short of the training
route below; another dtype or device, a torch without oneDNN, a oneDNN that fails its first-use
self-check) falls back to
``F.linear``, so an optimised model still trains, moves to CUDA and exports as before.
``attnlab.from_pretrained`` and the inference loaders apply :func:`optimize_for_inference`
themselves: the fast path is the default. A model switched to ``train()`` trains as one with
``nn.Linear`` layers: bit for bit where its products have at most :data:`MAX_FP32_ONEDNN_ROWS`
rows or the CPU lacks the compute-bound route (tests/test_precision.py), and to the order of the
sums (~1e-7 relative) where :func:`compute_bound_onednn` sends a training product's forward and
input gradient to oneDNN (:class:`_OneDNNLinear`, tests/test_linear_training.py).

The measurements behind each threshold and choice below are in benchmarks/results/code.md
("attnlab.nn.linear").

bf16. On a CPU with AVX512-BF16 or AMX, :func:`set_inference_dtype` lets the large layers compute
gradient-free calls from a cached bf16 copy of their weight (half the bytes per decoding step),
packed once into oneDNN's blocked layout, with fp32 activations around each product; the fp32
parameters stay the only state (``state_dict``, training, saving). ``attnlab generate``, ``eval``
and ``translate`` do this under ``--dtype auto`` (:func:`prepare_for_inference`). A model that is
itself bf16 (``from_pretrained(dir, dtype=torch.bfloat16)``) also gets packed copies of its large
weights. The copies are rebuilt whenever a parameter changes (its version counter moves).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

from .inplace import hooked

__all__ = ["InferenceLinear", "optimize_for_inference", "set_inference_dtype", "inference_dtype",
           "prepare_for_inference", "onednn_available", "narrow_onednn", "post_op", "fused_activation",
           "fp32_onednn", "compute_bound_onednn", "MIN_WEIGHT_ELEMENTS", "MAX_FP32_ONEDNN_ROWS",
           "MAX_NARROW_ONEDNN_FEATURES", "packed_bf16_available", "StackedLinear"]

_ONEDNN: bool | None = None            # decided on first use by _self_check
_FP32_ONEDNN: bool | None = None       # whether fp32 products take oneDNN: decided once by fp32_onednn()
_AVX512: bool | None = None            # whether torch's CPU kernels run AVX-512 (compute_bound_onednn)
_PACKED_BF16: bool | None = None       # whether oneDNN packs bf16 weights here: decided once by packed_bf16_available()
_AUTOCAST_INPUTS = (torch.float32, torch.bfloat16)

# oneDNN costs more per call than MKL; it pays off once the weight is large enough for its faster
# streaming to matter (a 256 x 256 weight is 3x slower on it, 1024 x 256 level, larger ones faster).
MIN_WEIGHT_ELEMENTS = 1 << 19          # 2 MB of fp32: smaller weights stay on F.linear
# ... and it pays off only while the product streams the weight (few rows): from ~128 rows on, the
# product is compute-bound and MKL's GEMM is as fast or faster on AVX2 (a BERT-base forward of
# 1024 tokens was slower than transformers' with oneDNN for every product). So fp32 calls of more
# rows stay on F.linear, except on AVX-512 CPUs (compute_bound_onednn).
MAX_FP32_ONEDNN_ROWS = 64
# ... except on AVX-512 CPUs (compute_bound_onednn), and, on any AVX-512 CPU, Intel's too, for
# products of a narrow input: with an inner dimension this small MKL's addmm spends a large share
# of the call writing the bias into the output before the GEMM adds to it, where oneDNN adds the
# bias inside the product (faster up to 192 inputs, level or slower from 384, so wider inputs stay
# on MKL).
MAX_NARROW_ONEDNN_FEATURES = 192


def _dnn_linear(x: Tensor, weight: Tensor, bias: Tensor | None, post: tuple[str, str] | None = None) -> Tensor:
    """oneDNN's matmul; ``post`` (attr, algorithm) fuses an activation into it (:func:`post_op`)."""
    attr, algorithm = post or ("none", "")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)


def post_op(act: nn.Module) -> tuple[str, str] | None:
    """The oneDNN post-op (attr, algorithm) that computes ``act`` inside the product, for the
    activation modules attnlab builds (ReLU, SiLU, GELU exact or tanh); None for any other module.
    Fused, the activation runs on each block of the product while it is in cache, where a separate
    call reads and writes the whole hidden tensor again (Swin-T's first-stage product with its GELU
    took about half the time of the two calls). Values: those of ``act(F.linear(...))`` up to the order
    of the sums (tests/test_linear_fused.py)."""
    kind = type(act)
    if kind is nn.ReLU:
        return ("relu", "")
    if kind is nn.SiLU:
        return ("swish", "")
    if kind is nn.GELU and act.approximate in ("none", "tanh"):
        return ("gelu", act.approximate)
    return None


def _pack_bf16(weight: Tensor) -> tuple[Tensor, bool]:
    """(weight in oneDNN's blocked bf16 layout, True), or (weight, False) where that fails.

    Packing once matters: given a plain (out, in) bf16 weight, oneDNN's AMX/AVX512-BF16 kernels
    reorder it on every call, which made 8-row bf16 products slower than fp32; packed, they are
    about three times as fast as fp32's."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.linspace(-1, 1, 3 * weight.size(1)).reshape(3, -1).to(weight.dtype)
        if torch.allclose(_dnn_linear(probe, packed, None).float(), F.linear(probe, weight).float(),
                          rtol=1e-2, atol=1e-2):
            return packed, True
    except Exception:                   # noqa: BLE001 - no packing: the plain bf16 product
        pass
    return weight, False


def packed_bf16_available() -> bool:
    """Whether gradient-free bf16 products use a weight packed once into oneDNN's blocked layout
    (:func:`_pack_bf16` succeeds on this CPU and its product agrees with F.linear). On a CPU
    without native bf16 (an AVX2-only one, or ``ONEDNN_MAX_CPU_ISA=AVX2``) the packing is refused
    and bf16 layers keep their plain bf16 weight for F.linear: the same result, no packed speed."""
    global _PACKED_BF16
    if _PACKED_BF16 is None:
        with torch.autocast("cpu", enabled=False):
            probe = torch.linspace(-1, 1, 64 * 32).reshape(64, 32).to(torch.bfloat16)
            _PACKED_BF16 = onednn_available() and _pack_bf16(probe)[1]
    return _PACKED_BF16


def _self_check() -> bool:
    """Whether this torch has the oneDNN linear op and it agrees with F.linear (checked once).
    Autocast is turned off around the check: the first call may come under it, and F.linear would
    then answer in bf16 and fail the comparison for good."""
    with torch.autocast("cpu", enabled=False):
        return _compare_with_f_linear()


def _compare_with_f_linear() -> bool:
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return False
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((3, 2, 40), (24, 40), (24,)))
        ok = torch.allclose(_dnn_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        return ok and torch.allclose(_dnn_linear(x[0, :1], w, None), F.linear(x[0, :1], w), rtol=1e-5, atol=1e-5)
    except Exception:                   # noqa: BLE001 - any failure means: do not use it
        return False


def onednn_available() -> bool:
    """True when :class:`InferenceLinear` will use oneDNN for fp32 CPU inference."""
    global _ONEDNN
    if _ONEDNN is None:
        _ONEDNN = _self_check()
    return _ONEDNN


def _cpu_vendor() -> str:
    """The CPU's vendor_id from /proc/cpuinfo ("GenuineIntel", "AuthenticAMD", ...), "" if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id") and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _avx512() -> bool:
    global _AVX512
    if _AVX512 is None:
        _AVX512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    return _AVX512


def narrow_onednn(in_features: int) -> bool:
    """Whether a gradient-free compute-bound fp32 product of ``in_features`` inputs runs oneDNN on
    this CPU: where :func:`compute_bound_onednn` holds, or the CPU has AVX-512 (of any vendor) and
    the input is at most :data:`MAX_NARROW_ONEDNN_FEATURES` wide (oneDNN fuses the bias there)."""
    if compute_bound_onednn():
        return True
    return in_features <= MAX_NARROW_ONEDNN_FEATURES and _avx512() and onednn_available()


def compute_bound_onednn() -> bool:
    """Whether gradient-free fp32 products of many rows (more than :data:`MAX_FP32_ONEDNN_ROWS`:
    an encoder's or a ViT's batch, compute-bound) run oneDNN too, whatever the weight's size: where
    :func:`fp32_onednn` holds and the CPU has AVX-512. There MKL's GEMM is the slower one (on
    ViT-S/16's products at 1,576 rows), where on AVX2 it was the faster (the measurement behind :data:`MAX_FP32_ONEDNN_ROWS`)."""
    return _avx512() and fp32_onednn()


def fp32_onednn() -> bool:
    """Whether gradient-free fp32 products of large weights run oneDNN's matmul instead of
    ``F.linear`` (MKL). MKL is Intel's library and streams a one-row product as fast as oneDNN on
    an Intel CPU (GPT-2 small's greedy decoding was faster with ``F.linear`` than with oneDNN there),
    while on AMD CPUs it takes slower generic paths and oneDNN streams the weights faster. So: oneDNN on any other x86
    vendor, ``F.linear`` on Intel and wherever the vendor is unknown. ``ATTNLAB_FP32_LINEAR=onednn``
    or ``=mkl`` overrides the choice (a benchmark comparing both). bf16 products always use
    oneDNN (its packed AMX/AVX512-BF16 kernels; :func:`set_inference_dtype`)."""
    global _FP32_ONEDNN
    if _FP32_ONEDNN is None:
        forced = os.environ.get("ATTNLAB_FP32_LINEAR", "").strip().lower()
        if forced not in ("", "onednn", "mkl"):
            raise ValueError(f"ATTNLAB_FP32_LINEAR must be 'onednn' or 'mkl', got {forced!r}")
        vendor = _cpu_vendor()
        wanted = forced == "onednn" if forced else vendor not in ("GenuineIntel", "")
        _FP32_ONEDNN = wanted and onednn_available()
    return _FP32_ONEDNN


class _OneDNNLinear(torch.autograd.Function):
    """``F.linear`` for a training step's compute-bound fp32 products (:func:`compute_bound_onednn`):
    the forward and the input's gradient (``grad @ weight``, a product of as many rows as the
    forward's) on oneDNN's matmul, the weight's gradient (``grad^T @ x``, whose long side is the
    summed one) on MKL's GEMM as autograd computes it. Measured one thread, ViT-S/16 at batch 4
    (788 rows), milliseconds MKL -> oneDNN: forward 13.1 -> 8.2 (384 -> 1152), 15.4 -> 11.1
    (384 -> 1536), 15.1 -> 10.2 (1536 -> 384); input gradient 10.8 -> 7.9, 15.2 -> 9.6, 16.8 -> 10.9;
    the weight gradient was level or slower on oneDNN (slower by up to 1.8x at Swin-T's first stage,
    12,544 rows), so it stays with MKL. Values equal F.linear's up to the order of the sums (~1e-7
    relative). Under ``create_graph=True`` the backward runs differentiable products instead, so
    that a second derivative exists."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _dnn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        if not ctx.needs_input_grad[0]:
            gx = None
        elif torch.is_grad_enabled():           # create_graph: oneDNN's op has no derivative of its own
            gx = grad.matmul(weight)
        else:
            gx = _dnn_linear(grad, weight.t(), None)
        flat = grad.reshape(-1, grad.size(-1))
        gw = flat.t().mm(x.reshape(-1, x.size(-1))) if ctx.needs_input_grad[1] else None
        gb = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


class InferenceLinear(nn.Linear):
    """``nn.Linear`` whose gradient-free fp32 CPU calls run oneDNN's matmul where :func:`fp32_onednn`
    says it is faster, and whose bf16 calls use packed weights (see the module docstring).

    Build one with :meth:`from_linear` (it shares the original's parameters) or directly like an
    ``nn.Linear``. The oneDNN path is taken when autograd is off or nothing involved requires a
    gradient, input and weight are fp32 on the CPU and the weight is contiguous; a training call of
    many rows takes :class:`_OneDNNLinear` where :func:`compute_bound_onednn` holds; otherwise forward
    is exactly ``nn.Linear.forward``. Weights under :data:`MIN_WEIGHT_ELEMENTS` elements also stay on
    ``F.linear`` (oneDNN's fixed cost per call outweighs its faster streaming there), and so do
    products of more than :data:`MAX_FP32_ONEDNN_ROWS` rows (compute-bound: MKL's GEMM is as fast),
    short of :func:`narrow_onednn`. :meth:`forward_activated` fuses an activation into the product.
    """

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> InferenceLinear:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"InferenceLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight                 # the same Parameter objects: ties and optimizers survive
        new.bias = linear.bias
        new.train(linear.training)
        return new

    # a bf16 (say) copy of the weight for gradient-free calls; None: compute in the weight's own dtype.
    # Set by set_inference_dtype; a class default, so that layers built before it existed still load.
    compute_dtype: torch.dtype | None = None

    def _no_grad(self, x: Tensor) -> bool:
        return not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad
                                                  or (self.bias is not None and self.bias.requires_grad))

    def _fast(self, x: Tensor) -> bool:
        w = self.weight
        if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or not w.is_contiguous():
            return False
        if x.numel() > MAX_FP32_ONEDNN_ROWS * x.size(-1):          # compute-bound
            return self._no_grad(x) and narrow_onednn(self.in_features)
        return w.numel() >= MIN_WEIGHT_ELEMENTS and self._no_grad(x) and fp32_onednn()

    def _train_fast(self, x: Tensor) -> bool:
        """A call that autograd will differentiate, fp32 on the CPU and compute-bound where
        :func:`compute_bound_onednn` holds: :class:`_OneDNNLinear`. Not under autocast, whose
        F.linear computes in bf16."""
        w = self.weight
        return (x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.is_contiguous()
                and x.numel() > MAX_FP32_ONEDNN_ROWS * x.size(-1) and not self._no_grad(x)
                and not torch.is_autocast_enabled("cpu") and compute_bound_onednn())

    def _autocast_bf16(self, x: Tensor) -> bool:
        """A gradient-free fp32 layer called under CPU bf16 autocast: it computes from its cached
        packed bf16 weight what autocast's F.linear computes from a fresh cast of the weight on
        every call (the same bf16 product, returned in bf16 as autocast returns it)."""
        return (x.device.type == "cpu" and self.weight.dtype == torch.float32 and x.dtype in _AUTOCAST_INPUTS
                and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
                and self._no_grad(x) and onednn_available())

    def _low_precision(self, x: Tensor) -> torch.dtype | None:
        """The dtype of a gradient-free call's cached weight copy, or None for the plain path: the
        ``compute_dtype`` of an fp32 layer, or bf16 for a bf16 layer on the CPU (packed once)."""
        w = self.weight
        if not self._no_grad(x):
            return None
        if self.compute_dtype is not None and x.dtype == w.dtype == torch.float32:
            return self.compute_dtype
        if x.dtype == w.dtype == torch.bfloat16 and x.device.type == "cpu" and w.numel() >= MIN_WEIGHT_ELEMENTS \
                and onednn_available():
            return torch.bfloat16
        return None

    def _low_precision_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor | None, bool]:
        """(weight, bias, packed) in ``compute_dtype``, cached; rebuilt whenever the parameters change
        (an optimizer step or load_state_dict bumps their version, .to() moves their storage).
        ``packed``: the weight is in oneDNN's blocked layout (bf16 on CPU), for :func:`_dnn_linear`."""
        w, b = self.weight, self.bias
        key = (dtype, w.device, w.data_ptr(), w._version) + ((b.data_ptr(), b._version) if b is not None else ())
        cached = self.__dict__.get("_low_precision_cache")
        if cached is None or cached[0] != key:
            with torch.no_grad():
                low, packed = w.detach().to(dtype).contiguous(), False
                if dtype == torch.bfloat16 and w.device.type == "cpu" and onednn_available():
                    low, packed = _pack_bf16(low)
                cached = (key, low, None if b is None else b.detach().to(dtype), packed)
            self.__dict__["_low_precision_cache"] = cached
        return cached[1], cached[2], cached[3]

    def forward(self, x: Tensor) -> Tensor:
        return self._forward(x, None)

    def forward_activated(self, x: Tensor, act: nn.Module) -> Tensor | None:
        """``act(self(x))`` with the activation fused into oneDNN's product (:func:`post_op`), for a
        call that takes oneDNN (gradient-free: the fp32 route, packed bf16 weights, bf16 autocast)
        and an activation it can fuse; None otherwise (the caller then calls the two itself).
        Bypasses forward hooks: callers check that none is registered (:func:`fused_activation`)."""
        post = post_op(act)
        return None if post is None else self._forward(x, post)

    def _forward(self, x: Tensor, post: tuple[str, str] | None) -> Tensor | None:
        """The product, with ``post`` fused where the route is oneDNN's; None where ``post`` is
        given and the route is another (or the input is empty)."""
        if x.size(-1) != self.in_features:                 # oneDNN's own message would be obscure
            raise ValueError(f"{type(self).__name__}: input last dim {x.size(-1)} != in_features "
                             f"{self.in_features} (shape {tuple(x.shape)})")
        if post is not None and x.numel() == 0:
            return None
        if self._autocast_bf16(x):
            if x.numel() == 0:
                return x.new_zeros(*x.shape[:-1], self.out_features, dtype=torch.bfloat16)
            w, b, packed = self._low_precision_weights(torch.bfloat16)
            x = x.to(torch.bfloat16)
            if packed:
                return _dnn_linear(x.contiguous(), w, b, post)
            return None if post is not None else F.linear(x, w, b)
        low = self._low_precision(x)
        if low is not None:
            if x.numel() == 0:
                return x.new_zeros(*x.shape[:-1], self.out_features)
            w, b, packed = self._low_precision_weights(low)
            x_low = x.to(low)
            if packed:
                return _dnn_linear(x_low.contiguous(), w, b, post).to(x.dtype)
            return None if post is not None else F.linear(x_low, w, b).to(x.dtype)
        if self._fast(x) and x.numel() > 0:
            return _dnn_linear(x.contiguous(), self.weight, self.bias, post)
        if post is not None:
            return None
        if self._train_fast(x):
            return _OneDNNLinear.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def __getstate__(self):                             # deepcopy / pickle: the cache is derived, never copied
        return {k: v for k, v in self.__dict__.items() if k != "_low_precision_cache"}


def fused_activation(owner: nn.Module, linear: nn.Module, act: nn.Module, x: Tensor) -> Tensor | None:
    """``act(linear(x))`` in one oneDNN call (:meth:`InferenceLinear.forward_activated`) where
    ``linear`` is an :class:`InferenceLinear` whose call takes oneDNN and no forward hook could miss
    the two calls (no forward hook or pre-hook on ``owner``, the module calling both, on its
    submodules, nor a global one); None otherwise."""
    if type(linear) is not InferenceLinear or hooked(owner, pre=True):
        return None
    return linear.forward_activated(x, act)


class StackedLinear:
    """Several ``nn.Linear`` layers that read the same input, computed as one product: their
    weights (and biases) are copied once into one stacked tensor, and each layer's parameter then
    becomes a view of its rows, so the parameters stay the same objects, hold the same values and
    take no extra memory, and an in-place update of one (an optimizer step, ``load_state_dict``)
    is seen by the stacked product. A decoding step multiplies one row by each weight: one call of
    E -> (q + k + v) instead of three (or gate + up instead of two) saves the fixed cost of the
    calls, and the larger weight streams faster (:class:`InferenceLinear`'s oneDNN route).

    Not a module (its owner keeps it outside the module tree: no state-dict key, no ``.to()``):
    ``usable(x)`` says whether the stacked product may stand for the layers' own calls -- the
    owner still holds them, unhooked, as plain Linear layers whose parameters still view the
    stacked tensor (``.to()``, a LoRA or quantized layer put in their place, a deep copy all end
    that), and no gradient is wanted; ``stack(x)`` then returns each layer's output, in order.
    Values: those of the separate products up to the order of the sums (~1e-7 relative).
    """

    def __init__(self, layers: Sequence[nn.Linear]):
        first = layers[0]
        if len(layers) < 2 or any(type(l) not in (nn.Linear, InferenceLinear) for l in layers):
            raise TypeError("StackedLinear: needs two or more nn.Linear layers")
        w = first.weight
        if any(l.in_features != first.in_features or l.weight.dtype != w.dtype or l.weight.device != w.device
               or (l.bias is None) != (first.bias is None) for l in layers):
            raise ValueError("StackedLinear: the layers must share in_features, dtype, device and bias")
        self.layers, self.sizes = tuple(layers), [l.out_features for l in layers]
        with torch.no_grad():
            weight = torch.cat([l.weight.detach() for l in layers])
            bias = None if first.bias is None else torch.cat([l.bias.detach() for l in layers])
        start = 0
        for l, n in zip(layers, self.sizes):
            l.weight.data = weight[start:start + n]
            if bias is not None:
                l.bias.data = bias[start:start + n]
            start += n
        self.linear = InferenceLinear(first.in_features, start, bias=bias is not None, device="meta")
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        self.linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._ptrs = self._pointers()
        self._versions = self._counters()

    def _pointers(self) -> tuple:
        return tuple((l.weight.data_ptr(), None if l.bias is None else l.bias.data_ptr()) for l in self.layers)

    def _counters(self) -> tuple:
        return tuple((l.weight._version, None if l.bias is None else l.bias._version) for l in self.layers)

    def intact(self) -> bool:
        """Whether every layer's parameters still view the stacked tensor."""
        return self._pointers() == self._ptrs

    def usable(self, x: Tensor, *layers: nn.Module) -> bool:
        """Whether ``stack(x)`` may stand for calling ``layers`` (the owner's current ones) on x."""
        if len(layers) != len(self.layers) or any(a is not b for a, b in zip(layers, self.layers)):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or any(
                l.weight.requires_grad or l.bias is not None and l.bias.requires_grad for l in layers)):
            return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        w = self.linear.weight
        if any(l._forward_hooks or l._forward_pre_hooks or l.weight.dtype != w.dtype for l in layers) \
                or not self.intact():
            return False
        dtypes = {getattr(l, "compute_dtype", None) for l in layers}
        if len(dtypes) != 1:
            return False
        self.linear.compute_dtype = dtypes.pop()
        versions = self._counters()
        if versions != self._versions:          # a layer changed in place: its low-precision copy is stale
            self.linear.__dict__.pop("_low_precision_cache", None)
            self._versions = versions
        return True

    def stack(self, x: Tensor) -> list[Tensor]:
        """Each layer's output on ``x``: (..., out_i) views of one product."""
        return list(self.linear(x).split(self.sizes, dim=-1))


def optimize_for_inference(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``model`` (the model itself included) by an
    :class:`InferenceLinear` sharing its parameters; returns the model (a new module only when
    ``model`` itself is an ``nn.Linear``). Idempotent; subclasses of ``nn.Linear`` other than
    plain ones (e.g. a user's custom layer) are left alone, as are non-Linear layers such as
    :class:`attnlab.quantize.Int8Linear`. Modules with a ``stack_projections()`` method (attention's
    q/k/v, a gated MLP's gate/up) then stack those layers' weights (:class:`StackedLinear`)."""
    if type(model) is nn.Linear:
        return InferenceLinear.from_linear(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, InferenceLinear.from_linear(child))
    for m in model.modules():                  # layers reading one input: one product (StackedLinear)
        stack = getattr(m, "stack_projections", None)
        if callable(stack):
            stack()
    return model


def set_inference_dtype(model: nn.Module, dtype: torch.dtype | None, min_elements: int | None = None) -> nn.Module:
    """Let every :class:`InferenceLinear` of ``model`` with at least ``min_elements`` weight
    elements compute its gradient-free calls in ``dtype`` (e.g. ``torch.bfloat16``) from a cached
    copy of its weight, casting the input to ``dtype`` and the output back; ``None`` turns it off.

    The parameters stay as they are (fp32): training, ``state_dict`` and ``save_pretrained`` see
    no difference, and a call that needs a gradient computes in fp32 exactly as ``nn.Linear``.
    The activations between layers (residual stream, norms, softmax) stay fp32 too; only the
    matrix products round their inputs to ``dtype``. Smaller weights keep fp32: for them the two
    casts cost more than the halved weight traffic saves (``min_elements`` defaults to
    :data:`MIN_WEIGHT_ELEMENTS`). Call :func:`optimize_for_inference` first (``from_pretrained``
    does). Returns the model.
    """
    min_elements = MIN_WEIGHT_ELEMENTS if min_elements is None else min_elements
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"set_inference_dtype: expected a floating torch dtype or None, got {dtype!r}")
    for m in model.modules():
        if isinstance(m, InferenceLinear):
            m.compute_dtype = dtype if dtype is not None and m.weight.numel() >= min_elements else None
            m.__dict__.pop("_low_precision_cache", None)
    return model


def inference_dtype(model: nn.Module) -> torch.dtype | None:
    """The ``compute_dtype`` that :func:`set_inference_dtype` gave ``model``'s layers (None if none)."""
    return next((m.compute_dtype for m in model.modules()
                 if isinstance(m, InferenceLinear) and m.compute_dtype is not None), None)


def prepare_for_inference(model: nn.Module, dtype: str = "auto") -> tuple[nn.Module, str]:
    """What the inference loaders (``attnlab generate``, ``translate``, ``eval``) do to a loaded
    model: :func:`optimize_for_inference`, then :func:`set_inference_dtype` with the ``--dtype``
    choice ("auto": bf16 where the model's device computes bf16 natively, else fp32; "fp32";
    "bf16"). Returns (the model, a line saying what was chosen and why)."""
    from .precision import resolve_inference_dtype
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    low, why = resolve_inference_dtype(dtype, device)
    set_inference_dtype(optimize_for_inference(model), low)
    large = sum(isinstance(m, InferenceLinear) and m.compute_dtype is not None for m in model.modules())
    chosen = ("fp32" if low is None else f"fp32 (no Linear layer is large enough for {low} to pay)" if not large
              else f"{str(low).removeprefix('torch.')} weight copies for the {large} largest Linear layers")
    return model, f"inference dtype: {chosen} ({why})"
