"""Cache kinds: what a layer keeps of the keys and values it has projected.

The full :class:`~attnlab.nn.cache.KVCache` keeps every key and value in full precision, so its
memory grows with every token: 2 G D numbers per token and layer. The kinds here keep less, each
behind the same decoding-state protocol (``length``, ``reorder``, ``can_rewind``, ``mark``,
``rewind``), chosen per call with :class:`KVCacheKind` (``generate(..., kv_cache="int8")``):

- ``sliding`` (:class:`SlidingKVCache`): the last ``window - 1`` slots, so that the next query
  sees ``window`` keys, itself included. Constant memory. On a layer whose attention already has a
  window (a model trained with sliding-window layers) and without a window of its own it
  keeps that layer's window and changes no logit; a layer without one (a global layer) keeps every
  key. A window of its own imposes local attention on every layer.
- ``sink`` (:class:`SinkKVCache`, StreamingLLM, Xiao et al. 2023): the first ``sink_tokens`` slots
  (the "attention sinks" that soak up attention mass) and the last ``window - 1``. It keeps the
  keys *before* the position module and rotates them on every call at their position inside the
  cache (sinks 0 .. s-1, then the window), so that no position exceeds s + window whatever the
  length of the stream: a model reads past its trained context.
- ``int8`` / ``int4`` (:class:`QuantizedKVCache`, KIVI, Liu et al. 2024): keys quantised per
  channel over groups of ``group`` tokens (a key channel has outliers, a token does not), values
  per token over their channels, each with an asymmetric scale and minimum; the most recent
  ``residual`` tokens (at least) stay in full precision. Every element is off by at most half its
  step, (max - min) / (2 (2^bits - 1)) of its group.

Rewinding: every kind truncates, as the full cache does, as far back as what it kept. After
``mark(length)`` (speculative decoding marks each round's start) a sliding or sink cache keeps the
window before ``length`` too, and a quantised cache quantises nothing from ``length`` on, so the
rewind that follows always works; a rewind further back raises :class:`CannotRewindError` in one line.

How the attention layer uses them: a kind whose ``selects`` is True takes over, for one call,
the step between projecting and attending: :meth:`SlidingKVCache.attend` gets the new queries,
keys and values with the call's positions and masks, applies the layer's position module itself,
and returns the keys to attend with their positions and masks cut to the slots it kept. A
quantised cache only changes what ``update`` stores; the layer sees its dequantised keys.

Holes (slots a speculative decoder left for rejected drafts) count as slots: a sliding cache keeps
``window - 1`` slots, so a row with holes among them sees fewer keys than the window allows until
the holes leave it (greedy, sampling and beam search leave none).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import CannotRewindError, KVCache, _check_length

__all__ = ["KVCacheKind", "KV_CACHE_KINDS", "SlidingKVCache", "SinkKVCache", "QuantizedKVCache", "quantize_groups",
           "dequantize_groups", "cache_bytes"]

KV_CACHE_KINDS = ("full", "sliding", "sink", "int8", "int4")


def _bad_int(value, low: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < low


@dataclass(frozen=True)
class KVCacheKind:
    """Which cache every self-attention layer gets: ``kind`` one of :data:`KV_CACHE_KINDS`.

    ``window``: sliding: slots each query sees (None: each layer's own window); sink: the recent
    slots beside the sinks (required). ``sink_tokens``: the first slots a sink cache keeps (default 4).
    ``residual`` / ``group``: a quantised cache's full-precision recent tokens and key group.
    """

    kind: str = "full"
    window: int | None = None
    sink_tokens: int | None = None
    residual: int = 32
    group: int = 32

    def __post_init__(self):
        problem = self.problem(self.kind, self.window, self.sink_tokens)
        if problem is None and (_bad_int(self.residual, 0) or _bad_int(self.group, 1)):
            problem = f"residual must be >= 0 and group >= 1, got {self.residual}, {self.group}"
        if problem is not None:
            raise ValueError(f"kv_cache: {problem}" if not problem.startswith("kv_cache") else problem)

    @staticmethod
    def problem(kind, window, sink_tokens, names: dict | None = None) -> str | None:
        """What is wrong with this choice, in one line naming the options as ``names`` spells them
        (the command line passes its flags), or None."""
        n = {"kind": "kv_cache", "window": "window", "sink_tokens": "sink_tokens", **(names or {})}
        if kind not in KV_CACHE_KINDS:
            return f"{n['kind']}: unknown kind {kind!r}; choose one of {', '.join(KV_CACHE_KINDS)}"
        for name, value, low in (("window", window, 1), ("sink_tokens", sink_tokens, 0)):
            if value is not None and _bad_int(value, low):
                return f"{n[name]}: must be at least {low}, got {value!r}"
        if window is not None and kind not in ("sliding", "sink"):
            return f"{n['window']}: only with {n['kind']} sliding or sink (not {kind})"
        if sink_tokens is not None and kind != "sink":
            return f"{n['sink_tokens']}: only with {n['kind']} sink (not {kind})"
        if kind == "sink" and window is None:
            return f"{n['kind']} sink: needs {n['window']} N, the recent slots kept beside the sinks"
        return None

    @classmethod
    def of(cls, spec) -> "KVCacheKind":
        """A kind from a :class:`KVCacheKind`, a name (``"int8"``) or None (full)."""
        if spec is None:
            return cls()
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, str):
            return cls(spec)
        raise ValueError(f"kv_cache: expected a kind name ({', '.join(KV_CACHE_KINDS)}) or a KVCacheKind, "
                         f"got {type(spec).__name__}")

    def new(self, shared: dict | None = None):
        """An empty cache of this kind for one layer; ``shared``: a dict the layers of one decoding
        state share (a quantised cache dequantises into buffers kept there, one layer at a time)."""
        if self.kind == "sliding":
            return SlidingKVCache(self.window)
        if self.kind == "sink":
            return SinkKVCache(self.window, 4 if self.sink_tokens is None else self.sink_tokens)
        if self.kind in ("int8", "int4"):
            return QuantizedKVCache(8 if self.kind == "int8" else 4, self.residual, self.group, shared)
        return KVCache()


def cache_bytes(cache) -> int:
    """Bytes a decoding state holds in tensors now (a layer's cache, :class:`LayerCaches`, a
    recurrent state): the figure that grows with the context, or does not. A full cache counts
    the slots in use, not its doubling buffer's spare room."""
    if isinstance(cache, (list, tuple)):
        return sum(cache_bytes(c) for c in cache)
    if isinstance(cache, KVCache):
        if cache.k is None:
            return 0
        used = cache.k.size(2) if cache.static else cache.length
        return used * (cache.k[:, :, :1].numel() * cache.k.element_size() +
                       cache.v[:, :, :1].numel() * cache.v.element_size())
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    if hasattr(cache, "self_attn"):
        return cache_bytes(cache.self_attn) + cache_bytes(cache.cross_attn or [])
    if hasattr(cache, "tensors"):
        return sum(t.numel() * t.element_size() for t in cache.tensors if t is not None)
    raise ValueError(f"cache_bytes: not a decoding state: {type(cache).__name__}")


def _cut(t: Tensor | None, kept: Tensor, S: int) -> Tensor | None:
    """``t`` with its last axis cut to the columns ``kept`` when that axis runs over the S slots."""
    return t if t is None or t.dim() == 0 or t.size(-1) != S else t.index_select(-1, kept)


def _appended(owner: str, k_old: Tensor | None, v_old: Tensor | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(k_old ++ k, v_old ++ v) along the slots (dim 2), or (k, v) when nothing is kept yet; a
    ValueError naming ``owner`` when the new keys' batch, heads or dtype differ from the kept ones."""
    if k_old is None:
        return k, v
    if k.shape[:2] != k_old.shape[:2] or k.dtype != k_old.dtype:
        raise ValueError(f"{owner}: new keys {tuple(k.shape)} {k.dtype} do not match the cache "
                         f"{tuple(k_old.shape)} {k_old.dtype}")
    return torch.cat([k_old, k], dim=2), torch.cat([v_old, v], dim=2)


class _WindowCache:
    """Keys and values of the slots [start, length) in full precision (and, for the sink cache,
    of the first slots); subclasses say how many recent slots stay after each call. ``selects``
    tells the attention layer to hand this cache the step (:meth:`SlidingKVCache.attend`)."""

    selects = True
    static = False
    can_rewind = True
    sink_tokens = 0

    def __init__(self):
        self.k: Tensor | None = None          # slots [start, length)
        self.v: Tensor | None = None
        self.sk: Tensor | None = None         # slots [0, min(sink_tokens, start)) (sink cache)
        self.sv: Tensor | None = None
        self.length = 0
        self.start = 0
        self._mark: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.sk, self.sv) if t is not None)

    def update(self, k, v):
        raise ValueError(f"{type(self).__name__}: this layer reads its keys with update(); a {self.kind_name} cache "
                         f"needs an attention layer that hands it the step (MultiHeadAttention)")

    def reorder(self, index: Tensor) -> None:
        for name in ("k", "v", "sk", "sv"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))

    def mark(self, length: int) -> None:
        self._mark = length

    def _need(self) -> int:
        """Recent slots a query needs before its own."""
        return 0

    def _kept(self, device) -> Tensor:
        """(n,) the slot of every key kept, in the order :meth:`_keys` returns them."""
        n_sinks = 0 if self.sk is None else self.sk.size(2)
        return torch.cat([torch.arange(n_sinks, device=device), torch.arange(self.start, self.length, device=device)])

    def _keys(self) -> tuple[Tensor, Tensor]:
        if self.sk is None:
            return self.k, self.v
        return torch.cat([self.sk, self.k], dim=2), torch.cat([self.sv, self.v], dim=2)

    def _append(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = _appended(type(self).__name__, self.k, self.v, k, v)
        self.length += k.size(2)

    def _trim(self) -> None:
        """Drop the recent slots no later query needs (keeping, after a mark, what a rewind to it
        needs); the first ``sink_tokens`` slots move to the sinks instead."""
        need = self._need()
        if need is None:
            return
        upto = self.length if self._mark is None else min(self.length, self._mark)
        start = max(self.start, upto - need)
        if start <= self.start:
            return
        cut = start - self.start
        to_sinks = max(0, min(self.sink_tokens, start) - self.start)
        if to_sinks:
            sk, sv = self.k[:, :, :to_sinks], self.v[:, :, :to_sinks]
            self.sk = sk if self.sk is None else torch.cat([self.sk, sk], dim=2)
            self.sv = sv if self.sv is None else torch.cat([self.sv, sv], dim=2)
        self.k, self.v = self.k[:, :, cut:], self.v[:, :, cut:]
        self.start = start

    def truncate(self, length: int) -> None:
        _check_length(type(self).__name__, length, self.length)
        need = self._need() or 0
        if length < self.length and self.start > 0 and length < self.start + need:
            raise CannotRewindError(
                f"{type(self).__name__} cannot go back from {self.length} to {length} slots: it kept the window "
                f"only from slot {self.start} (call mark(length) before appending to keep what a rewind needs)")
        cut = self.length - length
        if cut:
            self.k, self.v = self.k[:, :, :self.k.size(2) - cut], self.v[:, :, :self.v.size(2) - cut]
        self.length = length
        self._mark = None


def _and(mask: Tensor | None, allowed: Tensor) -> Tensor:
    if mask is None:
        return allowed
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


class SlidingKVCache(_WindowCache):
    """The last ``window - 1`` slots of one layer (see the module docstring); ``window`` None: the
    layer's own window, and every slot on a layer without one."""

    kind_name = "sliding"

    def __init__(self, window: int | None = None):
        super().__init__()
        if window is not None and _bad_int(window, 1):
            raise ValueError(f"SlidingKVCache: window must be None or an int >= 1, got {window!r}")
        self.window = window
        self._layer_window: int | None = None

    def _need(self) -> int | None:
        w = self.window if self.window is not None else self._layer_window
        return None if w is None else w - 1

    def attend(self, layer, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, key_positions: Tensor,
               key_padding_mask: Tensor | None, mask: Tensor | None):
        """Rotate and store this call's keys; return (q, k, v, positions, key_positions,
        key_padding_mask, mask) over the slots kept, from ``self.start`` to the new length."""
        T, S = k.size(-2), self.length + k.size(-2)
        if layer.position is not None:
            q, k = layer.position.transform(q, k, positions, key_positions[..., S - T:])
        self._layer_window = getattr(layer, "window", None)
        self._append(k, v)
        kept = self._kept(k.device)
        k_all, v_all = self._keys()
        key_positions = key_positions.index_select(-1, kept)
        key_padding_mask, mask = _cut(key_padding_mask, kept, S), _cut(mask, kept, S)
        if self.window is not None and T > 1:                     # local attention inside the call
            inside = positions[..., :, None] - key_positions[..., None, :] < self.window
            mask = _and(mask, inside[:, None] if inside.dim() == 3 else inside)
        self._trim()
        return q, k_all, v_all, positions, key_positions, key_padding_mask, mask


class SinkKVCache(_WindowCache):
    """StreamingLLM's cache for one layer: the first ``sink_tokens`` slots and the last
    ``window - 1``, keys kept before rotation and rotated at their place in the cache."""

    kind_name = "sink"
    rebases_positions = True

    def __init__(self, window: int, sink_tokens: int = 4):
        super().__init__()
        if _bad_int(window, 1) or _bad_int(sink_tokens, 0):
            raise ValueError(f"SinkKVCache: window must be >= 1 and sink_tokens >= 0, got {window}, {sink_tokens}")
        self.window, self.sink_tokens = window, sink_tokens

    def _need(self) -> int:
        return self.window - 1

    def attend(self, layer, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, key_positions: Tensor,
               key_padding_mask: Tensor | None, mask: Tensor | None):
        """As :meth:`SlidingKVCache.attend`, the positions being those inside the cache."""
        T, S = k.size(-2), self.length + k.size(-2)
        self._append(k, v)
        kept = self._kept(k.device)
        k_all, v_all = self._keys()
        key_padding_mask, mask = _cut(key_padding_mask, kept, S), _cut(mask, kept, S)
        # positions inside the cache: counted over the real slots kept, per row under padding
        if key_padding_mask is None:
            key_positions = torch.arange(kept.numel(), device=k.device)
            positions = key_positions[-T:]
        else:
            key_positions = (key_padding_mask.long().cumsum(-1) - 1).clamp(min=0)
            positions = key_positions[:, -T:]
        if T > 1:                                   # the sinks and the window, inside the call
            q_slot, k_slot = kept[-T:, None], kept[None, :]
            mask = _and(mask, (k_slot < self.sink_tokens) | (q_slot - k_slot < self.window))
        if layer.position is not None:
            q, k_all = layer.position.transform(q, k_all, positions, key_positions)
        self._trim()
        return q, k_all, v_all, positions, key_positions, key_padding_mask, mask


# --------------------------------------------------------------------------- quantisation

def quantize_groups(x: Tensor, bits: int, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Asymmetric ``bits``-bit quantisation of ``x`` with one scale and minimum per slice along
    ``dim`` (the axis the statistics run over): returns (codes uint8, scale, minimum), codes of
    int4 packed two to a byte along the last axis. ``x ≈ codes * scale + minimum``, off by at most
    ``scale / 2``."""
    levels = 2 ** bits - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((hi - lo) / levels).clamp(min=torch.finfo(x.dtype).tiny)
    codes = ((x - lo) / scale).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale, lo


def dequantize_groups(codes: Tensor, scale: Tensor, lo: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """The inverse of :func:`quantize_groups` (up to the rounding); into ``out`` (a float tensor of
    the unpacked shape, a view of a reused buffer) in two passes and no float temporary."""
    if bits == 4:                     # unpacked as bytes: a quarter of the floats' memory traffic
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
    if out is None:
        return codes.to(scale.dtype) * scale + lo
    torch.mul(codes, scale, out=out).add_(lo)
    return out


class QuantizedKVCache:
    """KIVI's cache for one layer (see the module docstring): ``bits`` 8 or 4; ``residual`` recent
    tokens (at least) in full precision; keys quantised per channel over groups of ``group`` tokens,
    values per token. ``update`` returns the dequantised keys and values of every slot (a
    transient of the call: what stays between calls is the codes, their scales and the residual),
    written in place into ``scratch`` buffers that the layers of one state share: valid until the
    next layer's update, one layer's worth of memory for the whole model, and two passes to
    dequantise instead of allocating and concatenating every step."""

    selects = False
    static = False
    can_rewind = True

    def __init__(self, bits: int = 8, residual: int = 32, group: int = 32, scratch: dict | None = None):
        if bits not in (4, 8):
            raise ValueError(f"QuantizedKVCache: bits must be 8 or 4, got {bits!r}")
        if _bad_int(residual, 0) or _bad_int(group, 1):
            raise ValueError(f"QuantizedKVCache: residual must be >= 0 and group >= 1, got {residual}, {group}")
        self.bits, self.residual, self.group = bits, residual, group
        self.length = 0
        self.quantized = 0                       # slots [0, quantized) are quantised
        self.kq: Tensor | None = None            # (B, G, quantized, D or D/2) uint8
        self.k_scale: Tensor | None = None       # (B, G, quantized / group, D): per channel and group
        self.k_min: Tensor | None = None
        self.vq: Tensor | None = None            # (B, G, quantized, D or D/2) uint8
        self.v_scale: Tensor | None = None       # (B, G, quantized, 1): per token
        self.v_min: Tensor | None = None
        self.rk: Tensor | None = None            # full precision, slots [quantized, length)
        self.rv: Tensor | None = None
        self._mark: int | None = None
        # where update() dequantises: buffers shared with the other layers of the state (KVCacheKind.new)
        self.scratch = {} if scratch is None else scratch

    _names = ("kq", "k_scale", "k_min", "vq", "v_scale", "v_min", "rk", "rv")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in self._names) if t is not None)

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if k is None:
            raise ValueError("QuantizedKVCache: a dynamic cache needs this step's keys and values")
        if self.bits == 4 and (k.size(-1) % 2 or v.size(-1) % 2):
            raise ValueError(f"QuantizedKVCache: int4 packs two channels a byte: head dims {k.size(-1)}, "
                             f"{v.size(-1)} must be even")
        self.rk, self.rv = _appended("QuantizedKVCache", self.rk, self.rv, k, v)
        self.length += k.size(2)
        limit = self.length if self._mark is None else min(self.length, self._mark)
        n = (min(self.rk.size(2) - self.residual, limit - self.quantized) // self.group) * self.group
        if n > 0:
            self._quantize_oldest(n)
        if self.kq is None:
            return self.rk, self.rv
        k_out, v_out = self._buffer("k", self.rk), self._buffer("v", self.rv)
        n = self.quantized
        self.dequantized(k_out[:, :, :n], v_out[:, :, :n])
        k_out[:, :, n:].copy_(self.rk)
        v_out[:, :, n:].copy_(self.rv)
        return k_out, v_out

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        """A contiguous (B, G, length, D) tensor of ``like``'s dtype in the scratch buffer ``name``,
        which the state's layers share (each reads its keys before the next layer writes them)."""
        B, G, _, D = like.shape
        numel = B * G * self.length * D
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            size = numel if buf is None or buf.dtype != like.dtype else max(numel, 2 * buf.numel())
            buf = self.scratch[name] = torch.empty(size, dtype=like.dtype, device=like.device)
        return buf[:numel].view(B, G, self.length, D)

    def _quantize_oldest(self, n: int) -> None:
        """Quantise the oldest ``n`` (a multiple of ``group``) full-precision slots."""
        k, v = self.rk[:, :, :n], self.rv[:, :, :n]
        B, G, _, D = k.shape
        codes, k_scale, k_min = quantize_groups(k.reshape(B, G, n // self.group, self.group, D), self.bits, dim=3)
        kq = codes.flatten(2, 3)
        vq, v_scale, v_min = quantize_groups(v, self.bits, dim=3)
        parts = dict(kq=kq, k_scale=k_scale.squeeze(3), k_min=k_min.squeeze(3), vq=vq, v_scale=v_scale, v_min=v_min)
        for name, t in parts.items():
            old = getattr(self, name)
            setattr(self, name, t if old is None else torch.cat([old, t], dim=2))
        self.rk, self.rv = self.rk[:, :, n:], self.rv[:, :, n:]
        self.quantized += n

    def dequantized(self, k: Tensor | None = None, v: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Keys and values of the quantised slots (B, G, quantized, D), dequantised (into ``k`` and
        ``v`` when given)."""
        B, G, n, _ = self.kq.shape
        codes = self.kq.view(B, G, n // self.group, self.group, -1)
        k_scale, k_min = self.k_scale[:, :, :, None], self.k_min[:, :, :, None]
        if k is None:
            k = dequantize_groups(codes, k_scale, k_min, self.bits).flatten(2, 3)
        else:
            dequantize_groups(codes, k_scale, k_min, self.bits, k.view(B, G, n // self.group, self.group, -1))
        return k, dequantize_groups(self.vq, self.v_scale, self.v_min, self.bits, v)

    def reorder(self, index: Tensor) -> None:
        for name in self._names:
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.index_select(0, index))

    def mark(self, length: int) -> None:
        self._mark = length

    def truncate(self, length: int) -> None:
        _check_length("QuantizedKVCache", length, self.length)
        if length < self.quantized:
            raise CannotRewindError(f"QuantizedKVCache cannot go back from {self.length} to {length} slots: the slots "
                                    f"before {self.quantized} are quantised (mark(length) keeps later ones exact)")
        keep = length - self.quantized
        if self.rk is not None:
            self.rk, self.rv = self.rk[:, :, :keep], self.rv[:, :, :keep]
        self.length = length
        self._mark = None
