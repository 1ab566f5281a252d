"""Mamba: a language model of selective state-space layers, no attention and no positions
(Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State Spaces", section 3.4).

    ids -> token embedding
        -> N x [x = x + Mixer(RMSNorm(x))]
        -> final RMSNorm -> lm_head (tied to the embedding by default) -> logits

    Mixer(x):  u, z = in_proj(x)                              (b, l, d_inner) each, d_inner = expand * d_model
               u = SiLU(causal depthwise conv1d(u))           kernel d_conv, over the sequence
               Δ_low, B, C = x_proj(u), split (dt_rank, d_state, d_state)
               Δ = softplus(dt_proj(Δ_low))                   (b, l, d_inner), the input-dependent step
               y = selective_scan(u, Δ, A = -exp(A_log), B, C, D)   (attnlab.nn.ssm)
               out_proj(y * SiLU(z))

Decoding keeps, per layer, the last d_conv - 1 inputs of the convolution and the (d_inner,
d_state) SSM state in an :class:`attnlab.nn.cache.RecurrentState`: the memory per token is
constant, whatever the length. At a slot whose ``attention_mask`` is False both are carried over
unchanged, so a left-padded row gives what it gives alone. (transformers zeroes the input at
padding but still lets the state decay there, so its padded rows differ from its unpadded ones.)
``A_log`` and ``D`` are declared exempt from weight decay: decay would pull A towards -1 and the
skip towards 0, which are not neutral values for them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.checkpoint import checkpoint
from ..nn.norm import RMSNorm
from ..nn.record import MixerCall, ReportsMixing
from ..nn.ssm import selective_scan, selective_step
from .convert import Rule, split_prefix
from .causal_lm import Headless
from .recurrent import RecurrentLM, causal_conv
from .registry import FamilyOption, register_family

__all__ = ["MambaConfig", "MambaMixer", "Mamba", "MambaModel", "MAMBA"]


@dataclass
class MambaConfig:
    vocab_size: int = 50280
    d_model: int = 768
    num_layers: int = 32
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int | None = None                # default ceil(d_model / 16), as the paper
    rms_norm_eps: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        for field in ("vocab_size", "d_model", "num_layers", "d_state", "d_conv", "expand"):
            if getattr(self, field) <= 0:
                raise ValueError(f"MambaConfig: {field} must be positive, got {getattr(self, field)}")
        if self.dt_rank is None:
            self.dt_rank = math.ceil(self.d_model / 16)
        if self.dt_rank <= 0:
            raise ValueError(f"MambaConfig: dt_rank must be positive, got {self.dt_rank}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model


class MambaMixer(ReportsMixing, nn.Module):
    """One selective state-space layer (the module docstring's Mixer): (b, l, E) -> (b, l, E).

    ``forward(x, real=None, state=None) -> (out, (conv_state (b, d_inner, d_conv - 1), h (b,
    d_inner, d_state) fp32))``. ``real`` (b, l) marks real tokens: the convolution sees zeros
    and the step Δ is 0 at the others, which leaves the state as it was when they all precede a
    row's real tokens from an empty state, or when l == 1 (one decoding step). A scan reports its
    inputs (u, Δ, A, B, C, D) and y to a recorder (attnlab.nn.record), without a map per head."""

    map_per_head = False
    no_map_reason = "Mamba-1's decay differs per channel, so it has no (T, T) matrix per head"

    def __init__(self, c: MambaConfig):
        super().__init__()
        Di, self.c = c.d_inner, c
        self.in_proj = nn.Linear(c.d_model, 2 * Di, bias=c.use_bias)
        self.conv1d = nn.Conv1d(Di, Di, c.d_conv, groups=Di, bias=c.use_conv_bias)
        self.x_proj = nn.Linear(Di, c.dt_rank + 2 * c.d_state, bias=False)
        self.dt_proj = nn.Linear(c.dt_rank, Di)
        self.A_log = nn.Parameter(torch.empty(Di, c.d_state))
        self.D = nn.Parameter(torch.empty(Di))
        self.out_proj = nn.Linear(Di, c.d_model, bias=c.use_bias)
        self.reset_ssm()

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("A_log", "D")

    def reset_ssm(self, dt_min: float = 1e-3, dt_max: float = 0.1) -> None:
        """The paper's initialisation: A = -(1..N) per channel (S4D-real), D = 1, and dt_proj's bias
        the inverse softplus of steps spread log-uniformly over [dt_min, dt_max]."""
        Di, N = self.A_log.shape
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(Di, 1))
            self.D.fill_(1.0)
            self.dt_proj.weight.uniform_(-self.c.dt_rank ** -0.5, self.c.dt_rank ** -0.5)
            dt = torch.exp(torch.rand(Di) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, x: Tensor, real: Tensor | None = None, state: tuple[Tensor, Tensor] | None = None):
        c, (b, l, _) = self.c, x.shape
        u, z = self.in_proj(x).chunk(2, dim=-1)
        if real is not None:
            u = u * real[..., None].to(u.dtype)
        keep = c.d_conv - 1
        prev = u.new_zeros(b, c.d_inner, keep) if state is None else state[0]
        window = torch.cat([prev, u.transpose(1, 2)], dim=-1)                  # (b, d_inner, keep + l)
        u = F.silu(causal_conv(window, self.conv1d)).transpose(1, 2).contiguous()   # rows for x_proj and the scan
        conv_state = window[..., window.size(-1) - keep:]
        dt, B, C = self.x_proj(u).split([c.dt_rank, c.d_state, c.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt))
        if real is not None:
            delta = delta * real[..., None].to(delta.dtype)
        A = -torch.exp(self.A_log.float())
        if l == 1 and state is not None:
            y, h = selective_step(state[1], u[:, 0], delta[:, 0], A, B[:, 0], C[:, 0], self.D)
            y = y[:, None]
            if real is not None:
                conv_state = torch.where(real[:, :, None], conv_state, prev)
        else:
            y, h = selective_scan(u, delta, A, B, C, self.D, None if state is None else state[1])
            self.report(lambda: MixerCall("mamba", (u, delta, A, B, C, self.D), y))
        return self.out_proj(y * F.silu(z)), (conv_state, h)


class MambaLayer(nn.Module):
    """x + Mixer(RMSNorm(x)) (Pre-Norm residual block); ``mixer`` builds the mixer from the config."""

    def __init__(self, c: MambaConfig, mixer=MambaMixer):
        super().__init__()
        self.norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.mixer = mixer(c)

    def forward(self, x: Tensor, real: Tensor | None = None, state=None):
        out, state = self.mixer(self.norm(x), real, state)
        return x + out, state


class Mamba(RecurrentLM):
    """Mamba language model (transformers' MambaForCausalLM). ``forward(input_ids (b, l),
    attention_mask=None (b, cached + l), positions=None, cache=None) -> logits (b, l, V)``;
    ``positions`` are accepted and unused (the order lives in the recurrence)."""

    init_std = 0.02
    state_per_layer = 2          # the convolution's last inputs and the SSM state
    mixer_cls = MambaMixer       # the layers' mixer: Mamba-2 plugs in its own and keeps the rest

    def __init__(self, config: MambaConfig):
        super().__init__()
        self.config, c = config, config
        self.gradient_checkpointing = False
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(MambaLayer(c, self.mixer_cls) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.d_model, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def reset_parameters(self) -> None:
        """Matrices N(0, 0.02) (a small embedding keeps the tied logits small), out_proj scaled by
        1 / sqrt(num_layers) as every layer writes into one residual stream, the SSM as the paper."""
        for name, p in self.named_parameters():
            if p.dim() >= 2 and not name.endswith("conv1d.weight"):
                nn.init.normal_(p, 0.0, self.init_std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for layer in self.layers:
            nn.init.normal_(layer.mixer.out_proj.weight, 0.0, self.init_std / math.sqrt(len(self.layers)))
            layer.mixer.reset_ssm()

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.token_embedding(input_ids)

    def run_layers(self, x: Tensor, real: Tensor | None, states: list) -> tuple[Tensor, list]:
        """Each layer keeps its state unchanged at padding itself (its inputs zeroed, its step 0)."""
        new = []
        for layer, state in zip(self.layers, states):
            x, state = checkpoint(layer, x, real, None) if self.checkpointing(state) else layer(x, real, state)
            new.append(state)
        return x, new


class MambaModel(Headless, Mamba):
    """Mamba without its head (transformers' MambaModel): forward returns the last hidden state
    (b, l, E) after the final RMSNorm."""

    with_head = "MambaForCausalLM"


# ----------------------------------------------------------------------------- Hugging Face
def backbone_weight_map(mixer_keys: tuple[str, ...]) -> list[Rule]:
    """transformers' layout of a Mamba-like LM (MambaForCausalLM, Mamba2ForCausalLM): the same
    backbone around each family's own mixer weights."""
    return [
        Rule("token_embedding.weight", "backbone.embeddings.weight"),
        Rule("layers.{i}.norm.weight", "backbone.layers.{i}.norm.weight"),
        *[Rule(f"layers.{{i}}.mixer.{k}", f"backbone.layers.{{i}}.mixer.{k}") for k in mixer_keys],
        Rule("norm.weight", "backbone.norm_f.weight"),
        Rule("lm_head.weight", "lm_head.weight"),   # tied: omitted on save, ignored if a checkpoint has it
    ]


_MIXER = ("in_proj.{p}", "conv1d.{p}", "x_proj.weight", "dt_proj.{p}", "A_log", "D", "out_proj.{p}")
MAMBA_WEIGHT_MAP = backbone_weight_map(_MIXER)
# our field -> transformers' MambaConfig field
MAMBA_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers", "d_state": "state_size",
    "d_conv": "conv_kernel", "expand": "expand", "dt_rank": "time_step_rank", "rms_norm_eps": "layer_norm_epsilon",
    "use_bias": "use_bias", "use_conv_bias": "use_conv_bias", "tie_word_embeddings": "tie_word_embeddings",
    "pad_token_id": "pad_token_id", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id"}


def config_from_hf(c: dict) -> MambaConfig:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"MambaConfig: hidden_act {c['hidden_act']!r} is not supported (silu)")
    return MambaConfig(**{ours: c[hf] for ours, hf in MAMBA_HF_NAMES.items() if c.get(hf) is not None})


def config_to_hf(cfg: MambaConfig) -> dict:
    return {**{hf: getattr(cfg, ours) for ours, hf in MAMBA_HF_NAMES.items()}, "hidden_act": "silu",
            "intermediate_size": cfg.d_inner}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> MambaConfig:
    """A Mamba sized for training. It has no heads, no feed-forward and no dropout, and no limit on
    the length: ``num_heads`` and ``context`` do not shape it; a ``d_ff`` or ``dropout`` is refused."""
    if d_ff is not None or dropout:
        raise ValueError("mamba: a Mamba has no feed-forward block and no dropout; leave d_ff and dropout unset "
                         "(its width is expand * d_model)")
    return MambaConfig(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, d_state=d_state, d_conv=d_conv,
                       expand=expand, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def _positive(v) -> str | None:
    return None if v > 0 else "must be positive"


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_layers=2, d_state=4, d_conv=4, expand=2, dt_rank=3),
    "mamba-130m": dict(vocab_size=50280, d_model=768, num_layers=24, pad_token_id=0, bos_token_id=0, eos_token_id=0),
}
_OPTIONS = (
    FamilyOption("d_state", int, "state size per channel of the selective scan (N)", ("lm",), check=_positive),
    FamilyOption("d_conv", int, "kernel width of the causal depthwise convolution", ("lm",), check=_positive),
    FamilyOption("expand", int, "inner width as a multiple of d_model", ("lm",), check=_positive),
)
_BASE_RULES, _HEAD_RULES = split_prefix(MAMBA_WEIGHT_MAP, "backbone.")
MAMBA = register_family("mamba", MambaConfig, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                        config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config, options=_OPTIONS,
                        limits=lambda c: {"vocab_size": c.vocab_size, "context": None},
                        token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
MAMBA.register("MambaForCausalLM", Mamba, kind="causal-lm", prefix="backbone.", head_rules=_HEAD_RULES)
MAMBA.register("MambaModel", MambaModel, kind="base")
