"""Mamba-2: Mamba with the state-space duality layer (Dao & Gu 2024, "Transformers are SSMs",
section 7): a scalar decay per head, B and C shared by groups of heads, one input projection.

    ids -> token embedding
        -> N x [x = x + Mixer(RMSNorm(x))]
        -> final RMSNorm -> lm_head -> logits

    Mixer(x):  z, xBC, Δ_raw = in_proj(x), split (d_inner, d_inner + 2 g n, h)
               xBC = SiLU(causal depthwise conv1d(xBC))      kernel d_conv, over the sequence
               x, B, C = xBC, split (d_inner, g n, g n)        x as h heads of p = head_dim channels
               Δ = softplus(Δ_raw + dt_bias)                   (b, l, h), one step per head
               y = ssd_scan(x, Δ, A = -exp(A_log), B, C, D)    (attnlab.nn.ssd)
               out_proj(GatedRMSNorm(y, z))                    RMSNorm(y * SiLU(z)), per group

Against Mamba-1 the layer moves Δ, B and C into the one input projection (computed from the
layer input, not from the convolved x), convolves B and C together with x, and shares them
across the heads of a group; the decay being a scalar per head is what lets the SSD compute a
chunk as a masked matrix product. The residual stack, the decoding state (per layer the last
d_conv - 1 convolution inputs and the (h, p, n) SSM state, in a RecurrentState that rewinds for
speculative decoding), the handling of padding (the state carried over unchanged where
``attention_mask`` is False) and generation are Mamba-1's: :class:`Mamba2` is
:class:`attnlab.models.mamba.Mamba` with this mixer. ``A_log``, ``D`` and ``dt_bias`` do not decay.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.norm import GatedRMSNorm
from ..nn.record import MixerCall, ReportsMixing
from ..nn.ssd import ssd_matrix, ssd_scan, ssd_step
from .convert import split_prefix
from .mamba import Mamba, backbone_weight_map
from .causal_lm import Headless
from .recurrent import causal_conv
from .registry import FamilyOption, register_family

__all__ = ["Mamba2Config", "Mamba2Mixer", "Mamba2", "Mamba2Model", "MAMBA2"]


@dataclass
class Mamba2Config:
    vocab_size: int = 50288
    d_model: int = 768
    num_layers: int = 24
    d_state: int = 128
    d_conv: int = 4
    expand: int = 2
    head_dim: int = 64
    num_heads: int | None = None              # default d_inner / head_dim
    n_groups: int = 1
    chunk_size: int = 256                     # transformers' chunk (its kernels' tile); see Mamba2Mixer
    rms_norm_eps: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "num_layers", "d_state", "d_conv", "expand", "head_dim", "n_groups",
                      "chunk_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Mamba2Config: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads is None:
            self.num_heads = self.d_inner // self.head_dim
        if self.num_heads * self.head_dim != self.d_inner:
            raise ValueError(f"Mamba2Config: num_heads * head_dim ({self.num_heads} * {self.head_dim}) must equal "
                             f"expand * d_model ({self.d_inner})")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2Config: n_groups ({self.n_groups}) must divide num_heads ({self.num_heads})")
        self.time_step_limit = tuple(float(v) for v in self.time_step_limit)

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def conv_dim(self) -> int:
        """The convolved channels: x, then B and C of every group."""
        return self.d_inner + 2 * self.n_groups * self.d_state


class Mamba2Mixer(ReportsMixing, nn.Module):
    """One SSD layer (the module docstring's Mixer): (b, l, E) -> (b, l, E).

    ``forward(x, real=None, state=None) -> (out, (conv_state (b, conv_dim, d_conv - 1), h (b, h,
    p, n) fp32))``, ``real`` (b, l) marking real tokens as :class:`attnlab.models.mamba.MambaMixer`'s:
    the convolution sees zeros and Δ is 0 at the others. The scan runs with the SSD's own chunk
    (attnlab.nn.ssd), not ``chunk_size``, which is transformers' tile for its GPU kernels, kept so
    that a checkpoint's config round-trips: the chunk changes the rounding, not the result, and
    the masked products of a chunk of 256 cost a CPU 4x the work per position of one of 64."""

    def __init__(self, c: Mamba2Config):
        super().__init__()
        self.c, H = c, c.num_heads
        self.in_proj = nn.Linear(c.d_model, c.d_inner + c.conv_dim + H, bias=c.use_bias)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.d_conv, groups=c.conv_dim, bias=c.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(c.d_inner, c.n_groups, c.rms_norm_eps)
        self.out_proj = nn.Linear(c.d_inner, c.d_model, bias=c.use_bias)
        self.reset_ssm()

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("A_log", "D", "dt_bias")

    def reset_ssm(self, dt_min: float = 1e-3, dt_max: float = 0.1, dt_floor: float = 1e-4) -> None:
        """The paper's initialisation: A = -(1..h) over the heads, D = 1, and dt_bias the inverse
        softplus of steps spread log-uniformly over [dt_min, dt_max] (at least dt_floor)."""
        H = self.A_log.numel()
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))
            self.D.fill_(1.0)
            dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _steps(self, dt: Tensor, real: Tensor | None) -> Tensor:
        """Δ = softplus(Δ_raw + dt_bias), clamped to time_step_limit, 0 where ``real`` is False."""
        dt = F.softplus(dt + self.dt_bias)
        lo, hi = self.c.time_step_limit
        if (lo, hi) != (0.0, math.inf):
            dt = dt.clamp(lo, hi)
        return dt if real is None else dt * real[..., None].to(dt.dtype)

    def forward(self, x: Tensor, real: Tensor | None = None, state: tuple[Tensor, Tensor] | None = None):
        c, (b, l, _) = self.c, x.shape
        H, G = c.num_heads, c.n_groups
        z, xBC, dt = self.in_proj(x).split([c.d_inner, c.conv_dim, H], dim=-1)
        if real is not None:
            xBC = xBC * real[..., None].to(xBC.dtype)
        keep = c.d_conv - 1
        prev = xBC.new_zeros(b, c.conv_dim, keep) if state is None else state[0]
        window = torch.cat([prev, xBC.transpose(1, 2)], dim=-1)               # (b, conv_dim, keep + l)
        xBC = F.silu(causal_conv(window, self.conv1d)).transpose(1, 2)
        conv_state = window[..., window.size(-1) - keep:]
        u, B, C = xBC.split([c.d_inner, G * c.d_state, G * c.d_state], dim=-1)
        u, B, C = u.unflatten(-1, (H, c.head_dim)), B.unflatten(-1, (G, c.d_state)), C.unflatten(-1, (G, c.d_state))
        dt = self._steps(dt, real)
        A = -torch.exp(self.A_log.float())
        if l == 1 and state is not None:
            y, h = ssd_step(state[1], u[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.D)
            y = y[:, None]
            if real is not None:
                conv_state = torch.where(real[:, :, None], conv_state, prev)
        else:
            y, h = ssd_scan(u, dt, A, B, C, self.D, None if state is None else state[1])
            self.report(lambda: _scan_call((u, dt, A, B, C, self.D), y, state is not None))
        return self.out_proj(self.norm(y.flatten(-2), z)), (conv_state, h)


def _scan_call(inputs: tuple, y: Tensor, carried: bool) -> MixerCall:
    """What a recorder sees of one scan (attnlab.nn.record): its inputs (x, Δ, A, B, C, D), its y
    (the D skip included) and its implicit attention, ``ssd_matrix`` (y = M x + D x per head)."""
    def matrix() -> Tensor:
        if carried:
            raise ValueError("implicit attention: the mamba2 scan ran from a carried state; record a whole "
                             "sequence from the start (no cache)")
        return ssd_matrix(*inputs[:5])
    return MixerCall("mamba2", inputs, y, matrix=matrix, title="implicit attention |C·B × decay × step|")


class Mamba2(Mamba):
    """Mamba-2 language model (transformers' Mamba2ForCausalLM): :class:`attnlab.models.mamba.Mamba`
    with :class:`Mamba2Mixer` layers; the same ``forward(input_ids, attention_mask=None,
    positions=None, cache=None) -> logits (b, l, V)``, decoding state and generation."""

    mixer_cls = Mamba2Mixer


class Mamba2Model(Headless, Mamba2):
    """Mamba-2 without its head (transformers' Mamba2Model): forward returns the last hidden
    state (b, l, E) after the final RMSNorm."""

    with_head = "Mamba2ForCausalLM"


# ----------------------------------------------------------------------------- Hugging Face
_MIXER = ("in_proj.{p}", "conv1d.{p}", "dt_bias", "A_log", "D", "norm.weight", "out_proj.{p}")
MAMBA2_WEIGHT_MAP = backbone_weight_map(_MIXER)
# our field -> transformers' Mamba2Config field
MAMBA2_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers", "d_state": "state_size",
    "d_conv": "conv_kernel", "expand": "expand", "head_dim": "head_dim", "num_heads": "num_heads",
    "n_groups": "n_groups", "chunk_size": "chunk_size", "rms_norm_eps": "layer_norm_epsilon", "use_bias": "use_bias",
    "use_conv_bias": "use_conv_bias", "time_step_limit": "time_step_limit",
    "tie_word_embeddings": "tie_word_embeddings", "pad_token_id": "pad_token_id", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id"}
# transformers' Mamba2Config defaults where ours differ (a config.json may omit a field)
_HF_DEFAULTS = {"tie_word_embeddings": False, "n_groups": 8, "num_heads": 128, "state_size": 128,
                "hidden_size": 4096, "num_hidden_layers": 64, "vocab_size": 32768}


def _json_float(v) -> float:
    """A number of a config.json: transformers writes infinity as {"__float__": "Infinity"}, strict JSON having none."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def config_from_hf(c: dict) -> Mamba2Config:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Mamba2Config: hidden_act {c['hidden_act']!r} is not supported (silu)")
    c = {**_HF_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    if "time_step_limit" in c:
        c["time_step_limit"] = tuple(_json_float(v) for v in c["time_step_limit"])
    return Mamba2Config(**{ours: c[hf] for ours, hf in MAMBA2_HF_NAMES.items() if hf in c})


def config_to_hf(cfg: Mamba2Config) -> dict:
    out = {hf: getattr(cfg, ours) for ours, hf in MAMBA2_HF_NAMES.items()}
    return {**out, "time_step_limit": list(cfg.time_step_limit), "hidden_act": "silu"}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, d_state: int = 64, d_conv: int = 4, expand: int = 2,
                 n_groups: int = 1, bos_token_id: int | None = None, eos_token_id: int | None = None) -> Mamba2Config:
    """A Mamba-2 sized for training: ``num_heads`` SSD heads of expand * d_model / num_heads channels
    each. It has no feed-forward, no dropout and no limit on the length: ``context`` does not shape
    it; a ``d_ff`` or ``dropout`` is refused."""
    if d_ff is not None or dropout:
        raise ValueError("mamba2: a Mamba-2 has no feed-forward block and no dropout; leave d_ff and dropout unset "
                         "(its width is expand * d_model)")
    if (expand * d_model) % num_heads:
        raise ValueError(f"mamba2: the heads ({num_heads}) must divide the inner width expand * d_model "
                         f"({expand * d_model})")
    return Mamba2Config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, d_state=d_state,
                        d_conv=d_conv, expand=expand, head_dim=expand * d_model // num_heads, num_heads=num_heads,
                        n_groups=n_groups, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def _positive(v) -> str | None:
    return None if v > 0 else "must be positive"


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_layers=2, d_state=8, d_conv=4, expand=2, head_dim=16, n_groups=2),
    "mamba2-130m": dict(vocab_size=50288, d_model=768, num_layers=24, d_state=128, head_dim=64, n_groups=1,
                        pad_token_id=0, bos_token_id=0, eos_token_id=0),
}
_OPTIONS = (
    FamilyOption("d_state", int, "state size per channel of the selective scan (N)", ("lm",), check=_positive),
    FamilyOption("d_conv", int, "kernel width of the causal depthwise convolution", ("lm",), check=_positive),
    FamilyOption("expand", int, "inner width as a multiple of d_model", ("lm",), check=_positive),
    FamilyOption("n_groups", int, "groups of Mamba-2 heads that share B and C (divides --heads)", ("lm",),
                 check=_positive),
)
_BASE_RULES, _HEAD_RULES = split_prefix(MAMBA2_WEIGHT_MAP, "backbone.")
MAMBA2 = register_family("mamba2", Mamba2Config, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                         config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config, options=_OPTIONS,
                         limits=lambda c: {"vocab_size": c.vocab_size, "context": None},
                         token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
MAMBA2.register("Mamba2ForCausalLM", Mamba2, kind="causal-lm", prefix="backbone.", head_rules=_HEAD_RULES)
MAMBA2.register("Mamba2Model", Mamba2Model, kind="base")
