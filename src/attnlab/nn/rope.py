"""The RoPE variants that released checkpoints use: how each turns its parameters into the
inverse frequencies theta_i of :class:`attnlab.nn.position.RotaryEmbedding` and into the
factor by which it scales cos and sin (and so the attention scores, by its square).

A scaling is a dict in the vocabulary of Hugging Face's ``rope_parameters`` (the same keys,
without ``rope_theta`` and ``partial_rotary_factor``, which the rotary module takes as
``base`` and ``rotary_dim``), ``{"rope_type": KIND, ...}``:

===========  ================================================================  ===================
kind         inverse frequencies (d rotated channels, i < d/2, b = base)       cos/sin scaled by
===========  ================================================================  ===================
default      b^(-2i/d)                                                         1
linear       b^(-2i/d) / factor (position interpolation, Chen et al. 2023)    1
ntk          (b f^(d/(d-2)))^(-2i/d), static "NTK-aware" base (attnlab's own)  1
dynamic      as ntk with f = factor L / L0 - (factor - 1), L the current       1
             length (max position + 1) when L > L0 = max_position_embeddings
llama3       by wavelength 2 pi / theta_i: longer than L0 / low_freq_factor:   1
             theta_i / factor; shorter than L0 / high_freq_factor: theta_i;
             between: a smooth blend (L0 = original_max_position_embeddings)
yarn         interpolated (theta_i / factor) and extrapolated (theta_i)        0.1 ln(factor) + 1
             channels joined by a linear ramp between the dimensions that      (or mscale ratios,
             turn beta_fast and beta_slow times in L0 (Peng et al. 2023)       attention_factor)
longrope     theta_i / short_factor[i] while L <= L0, theta_i / long_factor[i]  sqrt(1 + ln f /
             beyond (Ding et al. 2024)                                         ln L0)
===========  ================================================================  ===================

Only ``dynamic`` and ``longrope`` depend on the current length; a KV cache keeps each key as it
was rotated when it was computed, so a cached decode gives what transformers' does (whose rotary
module, unlike this stateless one, also keeps the frequencies of the longest call it has seen
until a call falls back under L0).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["ROPE_TYPES", "normalize_rope_scaling", "rope_frequencies", "yarn_mscale"]

ROPE_TYPES = ("default", "linear", "ntk", "dynamic", "llama3", "yarn", "longrope")
_REQUIRED = {"linear": ("factor",), "ntk": ("factor",), "dynamic": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
             "yarn": ("factor", "original_max_position_embeddings"),
             "longrope": ("short_factor", "long_factor", "original_max_position_embeddings")}


def normalize_rope_scaling(scaling: dict | None, rotary_dim: int, who: str = "RotaryEmbedding") -> dict | None:
    """The scaling dict with its kind under ``rope_type`` (``type``, the older key, is accepted),
    checked; None for plain RoPE. ValueError naming ``who`` and the problem otherwise."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"{who}: rope scaling must be a dict {{'rope_type': ..., ...}} or None, got {scaling!r}")
    out = {k: v for k, v in scaling.items() if k != "type"}
    kind = out.setdefault("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"{who}: RoPE type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return None
    absent = [k for k in _REQUIRED[kind] if out.get(k) is None]
    if absent:
        raise ValueError(f"{who}: RoPE type {kind!r} needs {', '.join(absent)}")
    if "factor" in _REQUIRED[kind] and not float(out["factor"]) > 0:
        raise ValueError(f"{who}: RoPE factor must be > 0, got {out['factor']}")
    if kind in ("ntk", "dynamic") and rotary_dim <= 2:
        raise ValueError(f"{who}: RoPE type {kind!r} needs rotary_dim > 2, got {rotary_dim}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(out[key]) != rotary_dim // 2:
                raise ValueError(f"{who}: longrope {key} has {len(out[key])} entries, rotary_dim / 2 = "
                                 f"{rotary_dim // 2} expected")
    if kind == "llama3" and not float(out["high_freq_factor"]) > float(out["low_freq_factor"]):
        raise ValueError(f"{who}: llama3 RoPE needs high_freq_factor > low_freq_factor, got "
                         f"{out['high_freq_factor']} and {out['low_freq_factor']}")
    return out


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1); Peng et al.
    2023, eq. 21."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _exponents(dim: int, device=None) -> Tensor:
    """2i / d for i < d/2, fp32."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _llama3(inv_freq: Tensor, s: dict) -> Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (they never completed a turn in training) are interpolated, short ones kept
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, blended, scaled)


def _yarn(dim: int, base: float, s: dict, max_position_embeddings: int | None) -> tuple[Tensor, float]:
    old = s["original_max_position_embeddings"]
    factor = s.get("factor")
    factor = max_position_embeddings / old if factor is None else float(factor)
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def turns_dim(turns: float) -> float:      # the channel pair that turns `turns` times in `old` positions
        return dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = turns_dim(beta_fast), turns_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                           # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** _exponents(dim)
    keep = 1 - ramp                             # 1: extrapolate (high frequencies), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention)


def _longrope(dim: int, base: float, s: dict, max_position_embeddings: int | None,
              seq_len: int | None) -> tuple[Tensor, float]:
    old = s["original_max_position_embeddings"]
    factor = s.get("factor")
    if factor is None:
        if max_position_embeddings is None:
            raise ValueError("rope_frequencies: longrope without a factor needs max_position_embeddings")
        factor = max_position_embeddings / old
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    ext = torch.tensor(s["long_factor"] if seq_len and seq_len > old else s["short_factor"], dtype=torch.float32)
    return 1.0 / (ext * base ** _exponents(dim)), float(attention)


def rope_frequencies(dim: int, base: float, scaling: dict | None, max_position_embeddings: int | None = None,
                     seq_len: int | None = None) -> tuple[Tensor, float]:
    """(inverse frequencies (d/2,) fp32, the factor on cos and sin) of a scaling (see the module
    docstring) for ``dim`` rotated channels. ``seq_len``: the current length (max position + 1),
    read by ``dynamic`` and ``longrope`` only; ``max_position_embeddings``: the trained context,
    which ``dynamic`` scales from and ``yarn`` / ``longrope`` take their factor from when none is given.
    """
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "yarn":
        return _yarn(dim, base, scaling, max_position_embeddings)
    if kind == "longrope":
        return _longrope(dim, base, scaling, max_position_embeddings, seq_len)
    if kind == "ntk":
        base = base * float(scaling["factor"]) ** (dim / (dim - 2))
    elif kind == "dynamic":
        if max_position_embeddings is None:
            raise ValueError("rope_frequencies: dynamic RoPE needs max_position_embeddings")
        # computed in fp32 from the length, as transformers does from its position tensor at run time
        length = torch.tensor(float(max(seq_len or 0, max_position_embeddings)))
        factor = float(scaling["factor"])
        base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** _exponents(dim))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0
