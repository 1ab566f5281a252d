"""RWKV-7 "Goose": a language model whose time-mix keeps a matrix state per head and updates it by
a generalised delta rule (Peng et al. 2025, "RWKV-7 'Goose' with Expressive Dynamic State
Evolution", sections 4-5). transformers has no RWKV-7, so the family is attnlab's own layout.

    ids -> token embedding -> LayerNorm (pre_norm, the first block's ln0)
        -> N x [x = x + TimeMix(LN(x));  x = x + ChannelMix(LN(x))]
        -> final LayerNorm -> lm_head -> logits

    token shift:  x^m_t = x_t + mu_m * (x_{t-1} - x_t)        for m in r, w, k, v, a, g
    TimeMix:      r = W_r x^r,  k = W_k x^k,  v = W_v x^v
                  w = exp(-exp(-1/2) sigmoid(w0 + tanh(x^w W_w1) W_w2))   the decay, in (0.545, 1)
                  a = sigmoid(a0 + x^a W_a1 W_a2)                 the in-context learning rate
                  v = v + (v_first - v) sigmoid(v0 + x^v W_v1 W_v2)   (layers > 0; v_first: layer 0's v)
                  g = sigmoid(x^g W_g1) W_g2                      the output gate
                  kappa = normalise_per_head(k * k_k)             the key whose old value is removed
                  k = k * (1 + (a - 1) * k_a)
                  y = wkv7(r, w, k, v, kappa, a)                  (attnlab.nn.wkv: the delta rule)
                  y = GroupNorm_per_head(y) + (sum_head(r * k * r_k)) v
                  out = W_o (y * g)
    ChannelMix:   out = W_v relu(W_k x^k)^2

The W_1 W_2 pairs are low-rank (LoRA-like) projections: a data-dependent correction to a learned
per-channel bias at a fraction of a full matrix's cost. Decoding keeps per layer the two
token-shift inputs and the (b, h, n, n) fp32 state; at a padded slot the decay is 1, the rate 0
and the key 0, which leaves the state exactly as it was.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.checkpoint import checkpoint
from ..nn.norm import LayerNorm
from ..nn.record import MixerCall, ReportsMixing
from ..nn.wkv import token_shift, wkv7, wkv7_step
from .recurrent import RecurrentLM, zero_padding
from .registry import FamilyOption, register_family

__all__ = ["Rwkv7Config", "Rwkv7TimeMix", "Rwkv7ChannelMix", "Rwkv7", "RWKV7"]


def _lora_rank(d_model: int, factor: float) -> int:
    """The paper's suggested rank of a low-rank projection: factor * sqrt(d_model), a multiple of 32."""
    return max(32, int(round(factor * d_model ** 0.5 / 32)) * 32)


@dataclass
class Rwkv7Config:
    vocab_size: int = 65536
    d_model: int = 768
    num_layers: int = 12
    head_size: int = 64
    d_ff: int | None = None                 # channel-mix width; default 4 * d_model
    decay_rank: int | None = None           # the low-rank projections' ranks; default the paper's
    rate_rank: int | None = None
    value_rank: int | None = None
    gate_rank: int | None = None
    layer_norm_eps: float = 1e-5
    group_norm_eps: float = 64e-5           # the per-head output norm's, as the reference has it
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        self.d_ff = self.d_ff or 4 * self.d_model
        for name, factor in (("decay_rank", 2.5), ("rate_rank", 2.5), ("value_rank", 1.7), ("gate_rank", 5.0)):
            if getattr(self, name) is None:
                setattr(self, name, _lora_rank(self.d_model, factor))
        for field in ("vocab_size", "d_model", "num_layers", "head_size", "d_ff", "decay_rank", "rate_rank",
                      "value_rank", "gate_rank"):
            if getattr(self, field) <= 0:
                raise ValueError(f"Rwkv7Config: {field} must be positive, got {getattr(self, field)}")
        if self.d_model % self.head_size:
            raise ValueError(f"Rwkv7Config: d_model {self.d_model} is not a multiple of head_size {self.head_size}")

    @property
    def num_heads(self) -> int:
        return self.d_model // self.head_size


class Rwkv7TimeMix(ReportsMixing, nn.Module):
    """The module docstring's TimeMix. ``forward(x (b, l, C), v_first, real, state) -> (out,
    v_first, (shift (b, C), S (b, h, n, n)))``; layer 0 makes ``v_first``, the others mix it in.
    The delta rule reports its inputs (r, w, k, v, κ, a) and y to a recorder (attnlab.nn.record)."""

    map_per_head = False
    no_map_reason = "RWKV-7's delta rule reports its inputs and outputs; no viewer reads its map yet"

    def __init__(self, c: Rwkv7Config, layer: int):
        super().__init__()
        C, self.c, self.first = c.d_model, c, layer == 0
        self.mix_r, self.mix_w, self.mix_k, self.mix_v, self.mix_a, self.mix_g = (
            nn.Parameter(torch.zeros(C)) for _ in range(6))
        self.w0, self.w1, self.w2 = nn.Parameter(torch.zeros(C)), *self._lora(C, c.decay_rank)
        self.a0, self.a1, self.a2 = nn.Parameter(torch.zeros(C)), *self._lora(C, c.rate_rank)
        if not self.first:
            self.v0, self.v1, self.v2 = nn.Parameter(torch.zeros(C)), *self._lora(C, c.value_rank)
        self.g1, self.g2 = self._lora(C, c.gate_rank)
        self.k_k, self.k_a = nn.Parameter(torch.zeros(C)), nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(C))               # (h, n) as one vector: each head's bonus weights
        self.receptance, self.key, self.value, self.output = (nn.Linear(C, C, bias=False) for _ in range(4))
        self.ln_x = nn.GroupNorm(c.num_heads, C, eps=c.group_norm_eps)

    @staticmethod
    def _lora(C: int, rank: int) -> tuple[nn.Parameter, nn.Parameter]:
        return nn.Parameter(torch.zeros(C, rank)), nn.Parameter(torch.zeros(rank, C))

    def no_weight_decay(self) -> tuple[str, ...]:
        vectors = ("mix_r", "mix_w", "mix_k", "mix_v", "mix_a", "mix_g", "w0", "a0", "k_k", "k_a", "r_k")
        return vectors + (() if self.first else ("v0",))

    def forward(self, x: Tensor, v_first: Tensor | None, real: Tensor | None, state):
        c, (b, l, C) = self.c, x.shape
        H, N = c.num_heads, c.head_size
        dx = token_shift(x, x.new_zeros(b, C) if state is None else state[0]) - x
        xr, xw, xk, xv, xa, xg = (x + dx * m for m in (self.mix_r, self.mix_w, self.mix_k, self.mix_v,
                                                       self.mix_a, self.mix_g))
        r, k, v = self.receptance(xr), self.key(xk), self.value(xv)
        w = torch.exp(-math.exp(-0.5) * torch.sigmoid(self.w0 + torch.tanh(xw @ self.w1) @ self.w2))
        if self.first:
            v_first = v
        else:
            v = v + (v_first - v) * torch.sigmoid(self.v0 + (xv @ self.v1) @ self.v2)
        a = torch.sigmoid(self.a0 + (xa @ self.a1) @ self.a2)
        g = torch.sigmoid(xg @ self.g1) @ self.g2
        kappa = F.normalize((k * self.k_k).view(b, l, H, N), dim=-1).view(b, l, C)
        k = k * (1 + (a - 1) * self.k_a)
        if real is not None:          # decay 1, rate 0, key 0: the state passes a padded slot unchanged
            pad = ~real[..., None]
            w, a, k = w.masked_fill(pad, 1.0), a.masked_fill(pad, 0.0), k.masked_fill(pad, 0.0)
        heads = [t.view(b, l, H, N) for t in (r, w, k, v, kappa, a)]
        if l == 1 and state is not None:
            y, S = wkv7_step(state[1], *(t[:, 0] for t in heads))
            y = y[:, None]
        else:
            y, S = wkv7(*heads, None if state is None else state[1])
            self.report(lambda: MixerCall("rwkv7", tuple(heads), y))
        y = self.ln_x(y.to(x.dtype).reshape(b * l, C)).view(b, l, C)
        bonus = (heads[0] * heads[2] * self.r_k.view(H, N)).sum(-1, keepdim=True) * heads[3]   # (b, l, H, N)
        return self.output((y + bonus.reshape(b, l, C)) * g), v_first, (x[:, -1], S)


class Rwkv7ChannelMix(nn.Module):
    """W_v relu(W_k x^k)^2 with the token shift. ``forward(x, state) -> (out, shift)``."""

    def __init__(self, c: Rwkv7Config):
        super().__init__()
        self.mix_k = nn.Parameter(torch.zeros(c.d_model))
        self.key = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.value = nn.Linear(c.d_ff, c.d_model, bias=False)

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("mix_k",)

    def forward(self, x: Tensor, state: Tensor | None):
        dx = token_shift(x, x.new_zeros(x.size(0), x.size(-1)) if state is None else state) - x
        return self.value(torch.relu(self.key(x + dx * self.mix_k)) ** 2), x[:, -1]


class Rwkv7Block(nn.Module):
    """x + TimeMix(LN(x)), then + ChannelMix(LN(x)). State: (time shift, S, channel shift)."""

    def __init__(self, c: Rwkv7Config, layer: int):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(c.d_model, c.layer_norm_eps), LayerNorm(c.d_model, c.layer_norm_eps)
        self.time_mix, self.channel_mix = Rwkv7TimeMix(c, layer), Rwkv7ChannelMix(c)

    def forward(self, x: Tensor, v_first: Tensor | None, real: Tensor | None, state):
        out, v_first, att = self.time_mix(zero_padding(self.norm1(x), real), v_first, real,
                                          None if state is None else state[:2])
        x = x + out
        out, ffn = self.channel_mix(zero_padding(self.norm2(x), real), None if state is None else state[2])
        return x + out, v_first, (*att, ffn)


class Rwkv7(RecurrentLM):
    """RWKV-7 language model. ``forward(input_ids (b, l), attention_mask=None (b, cached + l),
    positions=None, cache=None) -> logits (b, l, V)``; ``positions`` are accepted and unused."""

    state_per_layer = 3

    def __init__(self, config: Rwkv7Config):
        super().__init__()
        self.config, c = config, config
        self.gradient_checkpointing = False
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.pre_norm = LayerNorm(c.d_model, c.layer_norm_eps)
        self.layers = nn.ModuleList(Rwkv7Block(c, i) for i in range(c.num_layers))
        self.norm = LayerNorm(c.d_model, c.layer_norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def reset_parameters(self) -> None:
        """The reference's initialisation in outline: token-shift mixes that grow with the channel
        index and shrink with depth; decays spread from fast to slow over the channels; the
        projections that write into the residual stream (W_o, the channel mix's W_v) zero, so each
        block starts as the identity; the second low-rank factors small orthogonal; the first zero."""
        c, L, C = self.config, self.config.num_layers, self.config.d_model
        ramp, lin = torch.arange(C) / C, torch.arange(C) / max(C - 1, 1) - 0.5
        n = torch.arange(C) % c.head_size
        zigzag = (n - (c.head_size - 1) / 2) / max((c.head_size - 1) / 2, 1)
        zigzag = zigzag * zigzag.abs()
        nn.init.normal_(self.token_embedding.weight, 0.0, 0.02)
        nn.init.normal_(self.lm_head.weight, 0.0, 0.02)
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                deep, shallow = i / max(L - 1, 1), 1.0 - i / L
                tm, cm = layer.time_mix, layer.channel_mix
                for mix, power in (("r", 0.2), ("w", 0.9), ("k", 0.7), ("v", 0.7), ("a", 0.9), ("g", 0.2)):
                    getattr(tm, f"mix_{mix}").copy_(1.0 - ramp ** (power * shallow))
                decay = -6 + 6 * (torch.arange(C) / max(C - 1, 1)) ** (1 + deep ** 0.3)
                tm.w0.copy_(decay + 0.5 + 2.5 * zigzag)
                tm.a0.copy_(-0.19 + 0.3 * zigzag + 0.4 * lin)
                tm.k_k.copy_(0.71 - 0.1 * lin)
                tm.k_a.fill_(1.02)
                tm.r_k.fill_(-0.04)
                lows = [(tm.w1, tm.w2), (tm.a1, tm.a2), (tm.g1, tm.g2)] + ([] if tm.first else [(tm.v1, tm.v2)])
                for first, second in lows:
                    first.zero_()
                    nn.init.orthogonal_(second, gain=0.1)
                if not tm.first:
                    tm.v0.copy_(0.73 - 0.4 * lin)
                bound = C ** -0.5
                tm.receptance.weight.uniform_(-0.5 * bound, 0.5 * bound)
                tm.key.weight.uniform_(-0.05 * bound, 0.05 * bound)
                tm.value.weight.uniform_(-0.5 * bound, 0.5 * bound)
                tm.output.weight.zero_()
                tm.ln_x.reset_parameters()
                cm.mix_k.copy_(1.0 - ramp ** (shallow ** 4))
                cm.key.weight.uniform_(-0.5 * bound, 0.5 * bound)
                cm.value.weight.zero_()

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.pre_norm(self.token_embedding(input_ids))

    def run_layers(self, x: Tensor, real: Tensor | None, states: list) -> tuple[Tensor, list]:
        v_first, out = None, []
        for layer, state in zip(self.layers, states):
            if self.checkpointing(state):
                x, v_first, state = checkpoint(layer, x, v_first, real, None)
            else:
                x, v_first, state = layer(x, v_first, real, state)
            out.append(state)
        return x, out


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, head_size: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> Rwkv7Config:
    """An RWKV-7 sized for training: ``num_heads`` heads of d_model / num_heads channels unless
    ``head_size`` is given; no dropout and no limit on the length (``context`` does not shape it)."""
    if dropout:
        raise ValueError("rwkv7: an RWKV-7 has no dropout; leave dropout unset")
    if head_size is None:
        if d_model % num_heads:
            raise ValueError(f"rwkv7: d_model {d_model} is not a multiple of num_heads {num_heads}")
        head_size = d_model // num_heads
    return Rwkv7Config(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, head_size=head_size,
                       d_ff=d_ff, bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def _positive(v) -> str | None:
    return None if v is None or v > 0 else "must be positive"


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_layers=2, head_size=8, d_ff=64, decay_rank=4, rate_rank=4,
                 value_rank=4, gate_rank=8),
    "rwkv7-0.1b": dict(vocab_size=65536, d_model=768, num_layers=12, head_size=64),
}
_OPTIONS = (FamilyOption("head_size", int, "channels per head of the delta-rule state (n); default "
                         "d_model / heads", ("lm",), check=_positive),)
RWKV7 = register_family("rwkv7", Rwkv7Config, presets=PRESETS, build_config=build_config, options=_OPTIONS,
                        limits=lambda c: {"vocab_size": c.vocab_size, "context": None},
                        token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
RWKV7.register("Rwkv7ForCausalLM", Rwkv7, kind="causal-lm")
