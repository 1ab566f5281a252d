"""Int8 weight-only quantisation for generation: ``quantize_int8(model)``.

Every ``nn.Linear`` of the model becomes an :class:`Int8Linear` that keeps

    weight_int8  (out, in) int8     round(W / s), clamped to [-127, 127]
    weight_scale (out,)    float32  s = max_j |W[i, j]| / 127   (per output channel, symmetric, no zero point)
    bias         (out,)    float32  unchanged (absent if the Linear had none)

so W ~ weight_int8 * weight_scale[:, None] with an error of at most s / 2 per entry. These three
tensors are the module's whole state (``state_dict`` holds int8 tensors); the original fp32 weight
is dropped. Works with the KV-cache generation loop unchanged: only the Linear layers change.

What is quantised (the choice made here):
- every nn.Linear, **the output head included**: at batch 1 a token reads every weight once, and
  GPT-2 small's head (50257 x 768) is 31 % of its weights, so leaving it in fp32 would keep a third
  of the bytes per token. ``include_head=False`` keeps it in fp32.
- not the embeddings (``nn.Embedding`` / position tables): a token reads one row of them, so they
  cost no time, and an int8 copy would not make generation faster. A head tied to the token
  embedding is quantised as its own int8 copy; the fp32 embedding stays.
- not a mixture-of-experts router (``SparseMoE.gate``, X x E, tiny): routing is a discrete top-k
  choice that a rounding error could flip.
- ``exclude``: fnmatch patterns of qualified module names to keep in fp32 (``"layers.0.*"``).

Memory: a quantised Linear weight takes 1 byte per parameter + 4 bytes per output channel
instead of 4 bytes. GPT-2 small (124.4M parameters, head tied): 498 MB -> 282 MB of parameters
and buffers (-43 %): its 123.5M Linear weights (84.9M in the blocks, 38.6M in the head) become
int8, the fp32 embeddings (38.6M + 0.8M, 157 MB) stay. ``include_head=False`` gives 243 MB (the
tied head then has no int8 twin) but decodes slower; an untied model saves more. ``model_bytes``
measures it.

Kernels (``kernel=``); what each costs against fp32 ``F.linear`` on a GPT-2-small-shaped Linear
and in a whole decoding step was measured on a 2-core AVX2 CPU, and the figures, with the CPU and
the torch build, are in benchmarks/results/code.md (``attnlab.quantize``):

- ``"int8pack"``: ``torch.ops.aten._weight_int8pack_mm(x, w_int8, scales)``, torch's own CPU
  weight-only kernel, x @ (w_int8 * scales).T reading the int8 weight directly. Vectorised for
  bf16 activations (faster than fp32 for one row), not for fp32 or fp16 ones (several times
  *slower*), so the input is rounded to bf16 (relative error ~2e-3, small next to the int8
  weights' own ~1e-2) and the output cast back. Only for in_features % 32 == 0: this build gives
  wrong numbers or crashes for other widths (K = 100: 20 % error, K = 37: a segmentation fault),
  so other layers take the dequantising path. For a few rows it beats fp32; from about 16 rows on
  an fp32 GEMM is as fast or faster. On AVX2 it is compute-bound, reading its int8 weight more
  slowly than fp32 reads four times the bytes, so a whole decoding step gains well under the 4x
  that the bytes suggest.
- ``"fbgemm"``: ``torch.ops.quantized.linear_dynamic`` (what ``torch.ao.quantization.
  quantize_dynamic`` runs): the fastest of the three on that CPU, but it quantises the
  *activations* too, per tensor, to 7 bits (``reduce_range``, needed on AVX2, where 8 bits overflow its int16 accumulation): it is W8A8,
  not weight-only. One large activation anywhere in the call's rows sets the step for all of
  them: with one entry of 100 in one of 16 rows (GPT-2 has such "massive activations") the other
  rows' outputs are 24 % off (68 % with 300), against 0.8 % for the weight-only kernels, which do
  not care. It also keeps its own packed copy of the weight (+1.4 bytes per parameter), and
  torch has deprecated the quantized-tensor API it is built on. fp32 input on CPU only; elsewhere
  the dequantising path. Opt-in for speed, after checking the perplexity on one's own model.
- ``"dequant"``: ``F.linear(x, w_int8.to(x.dtype)) * scale + bias``, in blocks of rows (a bounded
  temporary): exact weight-only arithmetic on any device; as fast as fp32 for many rows (its GEMM
  is fp32), slower for one.
- ``"auto"`` (default): ``int8pack`` for calls of at most :data:`INT8PACK_MAX_ROWS` rows (decoding)
  on CPU when in_features % 32 == 0, ``dequant`` otherwise (prefill, other devices, other
  widths): weight-only, 4x less weight memory, and the fastest weight-only option on that CPU.

Every kernel takes the dequantising path when the input requires a gradient (so gradients reach
the input; the int8 weights themselves are frozen buffers). Quantising twice is idempotent: an
:class:`Int8Linear` is never re-quantised (no double rounding); ``Int8Linear.from_linear`` raises
TypeError for anything but an ``nn.Linear``. A quantised model cannot be written back with
``save_pretrained`` (its weight map knows fp32 weights only): quantise after loading.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from fnmatch import fnmatchcase

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Int8Linear", "quantize_int8", "quantize_weight", "model_bytes", "KERNELS", "INT8PACK_MAX_ROWS"]

KERNELS = ("auto", "int8pack", "fbgemm", "dequant")
INT8PACK_MAX_ROWS = 8            # "auto": above this many rows an fp32 GEMM beats the int8pack kernel here
_DEQUANT_BLOCK = 1 << 22         # weight entries dequantised at a time (a 16 MiB fp32 temporary at most)
_HEAD_NAMES = ("lm_head", "output_projection")


def _has_op(namespace, name: str) -> bool:
    try:
        return hasattr(namespace, name)
    except (RuntimeError, AttributeError):
        return False


_HAS_INT8PACK = _has_op(torch.ops.aten, "_weight_int8pack_mm")
_HAS_FBGEMM = _has_op(torch.ops.quantized, "linear_dynamic") and _has_op(torch.ops.quantized, "linear_prepack") \
    and any(e in torch.backends.quantized.supported_engines for e in ("fbgemm", "x86"))


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) float weight -> (int8 weight (out, in), float32 scales (out,)), per output channel,
    symmetric: scale = max |row| / 127 (1.0 for an all-zero row), q = round(w / scale) in [-127, 127]."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight: expected a 2-D float weight, got {weight.dtype} {tuple(weight.shape)}")
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_weight: the weight has inf or NaN entries")
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale          # contiguous: w may be a column-major view (optimize_for_decoding)


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * weight_scale[:, None]).T + bias: a Linear with int8 weights.

    Build it with :meth:`from_linear`; buffers and kernels as in the module docstring.
    ``weight`` returns the dequantised (out, in) weight as a new tensor, for code that reads a
    Linear's weight directly (slow: use the module's forward).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kernel: str = "auto",
                 device=None):
        super().__init__()
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Int8Linear: in_features ({in_features}) and out_features ({out_features}) "
                             "must be positive")
        if kernel not in KERNELS:
            raise ValueError(f"Int8Linear: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        self.in_features, self.out_features, self.kernel = in_features, out_features, kernel
        self.register_buffer("weight_int8", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._cache: dict = {}       # derived tensors (bf16 scales, fbgemm's packed weight); never saved

    @classmethod
    def from_linear(cls, linear: nn.Module, kernel: str = "auto") -> Int8Linear:
        """Quantise one ``nn.Linear`` (its weight per output channel; the bias stays float32)."""
        if isinstance(linear, Int8Linear):
            raise TypeError("Int8Linear.from_linear: this layer is already int8; quantising it again would "
                            "round twice (quantize_int8 leaves such layers alone)")
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Int8Linear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        q, scale = quantize_weight(w)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, kernel=kernel, device=w.device)
        out.weight_int8.copy_(q)
        out.weight_scale.copy_(scale)
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach().float())
        return out

    @property
    def weight(self) -> Tensor:
        dtype = self.weight_scale.dtype
        return self.weight_int8.to(dtype) * self.weight_scale[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel!r}")

    # ------------------------------------------------------------------ caches
    def _apply(self, fn, recurse=True):          # .to(), .half(), ...: derived tensors are stale
        self._cache = {}
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._cache = {}
        super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):                      # copy.deepcopy / pickle: rebuild the caches on demand
        state = dict(super().__getstate__())
        state["_cache"] = {}
        return state

    def _cached(self, key, make):
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    # ------------------------------------------------------------------ forward
    def _path(self, x2: Tensor) -> str:
        if x2.requires_grad and torch.is_grad_enabled():
            return "dequant"
        cpu = x2.device.type == "cpu"
        if self.kernel == "fbgemm":
            return "fbgemm" if _HAS_FBGEMM and cpu and x2.dtype == torch.float32 else "dequant"
        int8pack_ok = _HAS_INT8PACK and cpu and self.in_features % 32 == 0 and x2.is_floating_point()
        if self.kernel == "int8pack" or (self.kernel == "auto" and x2.size(0) <= INT8PACK_MAX_ROWS):
            return "int8pack" if int8pack_ok else "dequant"
        return "dequant"

    def _int8pack(self, x2: Tensor) -> Tensor:
        act = x2.dtype if x2.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        scale = self._cached(("scale", act), lambda: self.weight_scale.to(act).contiguous())
        y = torch.ops.aten._weight_int8pack_mm(x2.to(act).contiguous(), self.weight_int8, scale).to(x2.dtype)
        return y if self.bias is None else y.add_(self.bias.to(y.dtype))

    def _fbgemm(self, x2: Tensor) -> Tensor:
        def pack():
            n = self.out_features
            with warnings.catch_warnings():              # the quantized-tensor API's deprecation notice
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_channel_quantized_tensor(self.weight_int8, self.weight_scale.double(),
                                                              torch.zeros(n, dtype=torch.long), 0)
                return torch.ops.quantized.linear_prepack(qw, None if self.bias is None else self.bias.float())
        packed = self._cached("fbgemm", pack)
        return torch.ops.quantized.linear_dynamic(x2.contiguous(), packed, True)

    def _dequant(self, x2: Tensor) -> Tensor:
        dt = x2.dtype
        w = self.weight_int8
        rows = max(1, _DEQUANT_BLOCK // self.in_features)
        if rows >= self.out_features:
            y = F.linear(x2, w.to(dt))
        else:
            y = torch.cat([F.linear(x2, w[i:i + rows].to(dt)) for i in range(0, self.out_features, rows)], dim=-1)
        s = self.weight_scale.to(dt)
        return y * s if self.bias is None else torch.addcmul(self.bias.to(dt), y, s)

    def forward(self, x: Tensor) -> Tensor:
        if x.size(-1) != self.in_features:
            raise ValueError(f"Int8Linear: input last dim {x.size(-1)} != in_features {self.in_features} "
                             f"(shape {tuple(x.shape)})")
        x2 = x.reshape(-1, self.in_features)
        path = self._path(x2)
        y = self._int8pack(x2) if path == "int8pack" else self._fbgemm(x2) if path == "fbgemm" else self._dequant(x2)
        return y.reshape(*x.shape[:-1], self.out_features)


def _is_router(parent: nn.Module, child_name: str) -> bool:
    from .nn.mlp import SparseMoE
    return isinstance(parent, SparseMoE) and child_name == "gate"


def quantize_int8(model: nn.Module, *, include_head: bool = True, exclude: Iterable[str] = (),
                  kernel: str = "auto") -> nn.Module:
    """Replace the model's ``nn.Linear`` layers by :class:`Int8Linear`, in place; returns the model.

    ``include_head``: quantise the output head (``lm_head``, or ``output_projection`` of the
    encoder-decoder) too (default; see the module docstring). ``exclude``: fnmatch patterns of
    qualified module names to keep in fp32. ``kernel``: see :data:`KERNELS`. A bare ``nn.Linear``
    returns a new :class:`Int8Linear`. Idempotent: layers already int8 are left as they are.
    Raises TypeError for a non-module and ValueError when there is no Linear to quantise and
    nothing was quantised before.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_int8: expected a torch.nn.Module, got {type(model).__name__}")
    if kernel not in KERNELS:
        raise ValueError(f"quantize_int8: kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if isinstance(model, nn.Linear):
        return Int8Linear.from_linear(model, kernel)
    patterns = [exclude] if isinstance(exclude, str) else list(exclude)
    skip_head = set() if include_head else set(_HEAD_NAMES)
    done: dict[int, Int8Linear] = {}                    # a Linear shared by several parents: one copy
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if name in skip_head or _is_router(parent, child_name) or any(fnmatchcase(name, p) for p in patterns):
                continue
            targets.append((parent, child_name, child))
    for parent, child_name, child in targets:
        if id(child) not in done:
            done[id(child)] = Int8Linear.from_linear(child, kernel)
        setattr(parent, child_name, done[id(child)])
    if not targets and not any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError(f"quantize_int8: {type(model).__name__} has no nn.Linear layer to quantise "
                         "(after include_head / exclude)")
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights once).
    Derived kernel caches (fbgemm's packed copies) are not counted."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
