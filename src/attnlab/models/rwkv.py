"""RWKV-4: a language model of linear attention with a per-channel decay, run as an RNN
(Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era", section 4), as
transformers' RwkvForCausalLM has it.

    ids -> token embedding -> LayerNorm (pre_ln, the first block's)
        -> N x [x = x + TimeMix(LN(x));  x = x + ChannelMix(LN(x))]
        -> final LayerNorm -> head -> logits

    token shift:  x'_t = mu * x_t + (1 - mu) * x_{t-1}          (a learned mix mu per channel)
    TimeMix(x):   k = W_k x'_k,  v = W_v x'_v,  r = sigmoid(W_r x'_r)
                  out = W_o (r * wkv(k, v))                      (attnlab.nn.wkv: the WKV recurrence)
    ChannelMix:   out = sigmoid(W_r x'_r) * W_v relu(W_k x'_k)^2

Decoding keeps, per layer, the two token-shift inputs (b, c) and the WKV triplet (num, den, p)
(b, c) fp32 in an :class:`attnlab.nn.cache.RecurrentState`: constant memory per token. At a slot
whose ``attention_mask`` is False the state is carried over unchanged, so a left-padded row gives
what it gives alone (transformers' RWKV ignores the mask; its reference is each row run alone).

In eval mode, with ``rescale_every`` R > 0, the residual stream is halved after every R-th block
and each block's two outputs are divided by 2^(i // R), so that fp16 inference does not overflow;
transformers divides the output weights in place instead, which gives the same numbers, powers
of two being exact. The LayerNorms make the two modes nearly equal (only their eps sees the
scale). The final LayerNorm has eps 1e-5 whatever ``layer_norm_eps`` is, as transformers builds it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.checkpoint import checkpoint
from ..nn.norm import LayerNorm
from ..nn.record import MixerCall, ReportsMixing
from ..nn.wkv import token_shift, wkv4, wkv4_empty, wkv4_step
from .convert import Op, Rule, split_prefix
from .causal_lm import Headless
from .recurrent import RecurrentLM, zero_padding
from .registry import register_family

__all__ = ["RwkvConfig", "RwkvTimeMix", "RwkvChannelMix", "Rwkv", "RwkvModel", "RWKV"]

_IGNORED = -1e30     # the key of a padded slot: its weight exp(-1e30 - p) in every WKV sum is 0


@dataclass
class RwkvConfig:
    vocab_size: int = 50277
    d_model: int = 4096
    num_layers: int = 32
    attention_hidden_size: int | None = None     # the WKV channels; default d_model
    d_ff: int | None = None                      # channel-mix width; default 4 * d_model
    layer_norm_eps: float = 1e-5
    rescale_every: int = 6
    context_length: int = 1024                   # transformers' CUDA kernel's limit; the RNN has none
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0

    def __post_init__(self):
        self.attention_hidden_size = self.attention_hidden_size or self.d_model
        self.d_ff = self.d_ff or 4 * self.d_model
        for field in ("vocab_size", "d_model", "num_layers", "attention_hidden_size", "d_ff"):
            if getattr(self, field) <= 0:
                raise ValueError(f"RwkvConfig: {field} must be positive, got {getattr(self, field)}")


class RwkvTimeMix(ReportsMixing, nn.Module):
    """Token shift, k/v/r projections, the WKV recurrence, the receptance gate and W_o (the module
    docstring's TimeMix). ``forward(x (b, l, C), real, state, scale) -> (out, (shift, num, den, p))``.
    A recurrence reports its inputs (k, v, w, u) and output to a recorder (attnlab.nn.record)."""

    map_per_head = False
    no_map_reason = "RWKV-4's WKV weighs the tokens per channel, so it has no (T, T) matrix per head"

    def __init__(self, c: RwkvConfig):
        super().__init__()
        C, A = c.d_model, c.attention_hidden_size
        self.time_decay = nn.Parameter(torch.zeros(A))     # w = exp(time_decay): the decay per step
        self.time_first = nn.Parameter(torch.zeros(A))     # u: the bonus of the current token
        self.mix_k, self.mix_v, self.mix_r = (nn.Parameter(torch.full((C,), 0.5)) for _ in range(3))
        self.key, self.value, self.receptance = (nn.Linear(C, A, bias=False) for _ in range(3))
        self.output = nn.Linear(A, C, bias=False)

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("time_decay", "time_first", "mix_k", "mix_v", "mix_r")

    def forward(self, x: Tensor, real: Tensor | None, state, scale: float = 1.0):
        prev = x.new_zeros(x.size(0), x.size(-1)) if state is None else state[0]
        xs = token_shift(x, prev)
        k = self.key(x * self.mix_k + xs * (1 - self.mix_k))
        v = self.value(x * self.mix_v + xs * (1 - self.mix_v))
        r = torch.sigmoid(self.receptance(x * self.mix_r + xs * (1 - self.mix_r)))
        if real is not None:
            k = k.masked_fill(~real[..., None], _IGNORED)
        w = torch.exp(self.time_decay.float())
        triplet = wkv4_empty(k) if state is None else state[1:]
        if x.size(1) == 1 and state is not None:
            out, new = wkv4_step(triplet, k[:, 0], v[:, 0], w, self.time_first)
            out = out[:, None]
        else:
            out, new = wkv4(k, v, w, self.time_first, triplet)
            self.report(lambda: MixerCall("rwkv", (k, v, w, self.time_first), out))
        out = self.output(r * out.to(x.dtype))
        return (out if scale == 1.0 else out / scale), (x[:, -1], *new)


class RwkvChannelMix(nn.Module):
    """sigmoid(W_r x'_r) * W_v relu(W_k x'_k)^2 with the token shift.
    ``forward(x, state, scale) -> (out, shift)``."""

    def __init__(self, c: RwkvConfig):
        super().__init__()
        self.mix_k, self.mix_r = (nn.Parameter(torch.full((c.d_model,), 0.5)) for _ in range(2))
        self.key = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.receptance = nn.Linear(c.d_model, c.d_model, bias=False)
        self.value = nn.Linear(c.d_ff, c.d_model, bias=False)

    def no_weight_decay(self) -> tuple[str, ...]:
        return ("mix_k", "mix_r")

    def forward(self, x: Tensor, state: Tensor | None, scale: float = 1.0):
        xs = token_shift(x, x.new_zeros(x.size(0), x.size(-1)) if state is None else state)
        k = torch.square(torch.relu(self.key(x * self.mix_k + xs * (1 - self.mix_k))))
        r = torch.sigmoid(self.receptance(x * self.mix_r + xs * (1 - self.mix_r)))
        v = self.value(k)
        return r * (v if scale == 1.0 else v / scale), x[:, -1]


class RwkvBlock(nn.Module):
    """x + TimeMix(LN(x)), then + ChannelMix(LN(x)); the LN outputs are zero at padding, so the
    token shift of a row's first real token sees the empty state's zeros.
    State: (time shift, num, den, p, channel shift)."""

    def __init__(self, c: RwkvConfig):
        super().__init__()
        self.norm1, self.norm2 = LayerNorm(c.d_model, c.layer_norm_eps), LayerNorm(c.d_model, c.layer_norm_eps)
        self.time_mix, self.channel_mix = RwkvTimeMix(c), RwkvChannelMix(c)

    def forward(self, x: Tensor, real: Tensor | None, state, scale: float = 1.0):
        out, att = self.time_mix(zero_padding(self.norm1(x), real), real, None if state is None else state[:4], scale)
        x = x + out
        out, ffn = self.channel_mix(zero_padding(self.norm2(x), real), None if state is None else state[4], scale)
        return x + out, (*att, ffn)


class Rwkv(RecurrentLM):
    """RWKV-4 language model (transformers' RwkvForCausalLM). ``forward(input_ids (b, l),
    attention_mask=None (b, cached + l), positions=None, cache=None) -> logits (b, l, V)``;
    ``positions`` are accepted and unused (the order lives in the recurrence)."""

    state_per_layer = 5

    def __init__(self, config: RwkvConfig):
        super().__init__()
        self.config, c = config, config
        self.gradient_checkpointing = False
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.pre_norm = LayerNorm(c.d_model, c.layer_norm_eps)
        self.layers = nn.ModuleList(RwkvBlock(c) for _ in range(c.num_layers))
        self.norm = LayerNorm(c.d_model, 1e-5)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def reset_parameters(self) -> None:
        """The paper's initialisation (section 3.5, as transformers has it): decays spread from
        fast to slow over the channels, more so in deeper layers; mixes from the channel index;
        matrices N(0, 0.02), the outputs that write into the residual stream scaled down by
        1 / sqrt(2 N) and a small embedding."""
        c, L = self.config, self.config.num_layers
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
        ramp = torch.arange(c.d_model) / c.d_model
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                deep, shallow = i / max(L - 1, 1), 1.0 - i / L
                tm, cm = layer.time_mix, layer.channel_mix
                h = torch.arange(c.attention_hidden_size) / max(c.attention_hidden_size - 1, 1)
                tm.time_decay.copy_(-5 + 8 * h ** (0.7 + 1.3 * deep))
                zigzag = 0.5 * ((torch.arange(c.attention_hidden_size) + 1) % 3 - 1)
                tm.time_first.copy_(math.log(0.3) + zigzag)
                tm.mix_k.copy_(ramp ** shallow)
                tm.mix_v.copy_(ramp ** shallow + 0.3 * deep)
                tm.mix_r.copy_(ramp ** (0.5 * shallow))
                cm.mix_k.copy_(ramp ** shallow)
                cm.mix_r.copy_(ramp ** shallow)
                for out in (tm.output.weight, cm.value.weight):
                    nn.init.normal_(out, 0.0, 0.02 / (2 * L) ** 0.5)

    def embed(self, input_ids: Tensor) -> Tensor:
        return self.pre_norm(self.token_embedding(input_ids))

    def _rescaling(self) -> int:
        return self.config.rescale_every if not self.training and self.config.rescale_every > 0 else 0

    def run_layers(self, x: Tensor, real: Tensor | None, states: list) -> tuple[Tensor, list]:
        every, out = self._rescaling(), []
        for i, layer in enumerate(self.layers):
            scale = float(2 ** (i // every)) if every else 1.0
            if self.checkpointing(states[i]):
                x, state = checkpoint(layer, x, real, None, scale)
            else:
                x, state = layer(x, real, states[i], scale)
            if every and (i + 1) % every == 0:
                x = x / 2
            out.append(state)
        return x, out


class RwkvModel(Headless, Rwkv):
    """RWKV-4 without its head (transformers' RwkvModel): forward returns the last hidden state
    (b, l, E) after the final LayerNorm."""

    with_head = "RwkvForCausalLM"


# ----------------------------------------------------------------------------- Hugging Face
class _Vector3d(Op):
    """Our (C,) mix vector <-> transformers' (1, 1, C) parameter."""

    def to_hf(self, tensors, config):
        return [t.reshape(1, 1, -1) for t in tensors]

    def from_hf(self, tensors, config):
        return [t.reshape(-1) for t in tensors]


_V3 = _Vector3d()
RWKV_WEIGHT_MAP = [
    Rule("token_embedding.weight", "rwkv.embeddings.weight"),
    Rule("pre_norm.{p}", "rwkv.blocks.0.pre_ln.{p}"),
    Rule("layers.{i}.norm1.{p}", "rwkv.blocks.{i}.ln1.{p}"),
    Rule("layers.{i}.norm2.{p}", "rwkv.blocks.{i}.ln2.{p}"),
    *[Rule(f"layers.{{i}}.time_mix.{k}", f"rwkv.blocks.{{i}}.attention.{k}") for k in ("time_decay", "time_first")],
    *[Rule(f"layers.{{i}}.time_mix.mix_{x}", f"rwkv.blocks.{{i}}.attention.time_mix_{name}", _V3)
      for x, name in (("k", "key"), ("v", "value"), ("r", "receptance"))],
    *[Rule(f"layers.{{i}}.time_mix.{k}.weight", f"rwkv.blocks.{{i}}.attention.{k}.weight")
      for k in ("key", "value", "receptance", "output")],
    *[Rule(f"layers.{{i}}.channel_mix.mix_{x}", f"rwkv.blocks.{{i}}.feed_forward.time_mix_{name}", _V3)
      for x, name in (("k", "key"), ("r", "receptance"))],
    *[Rule(f"layers.{{i}}.channel_mix.{k}.weight", f"rwkv.blocks.{{i}}.feed_forward.{k}.weight")
      for k in ("key", "receptance", "value")],
    Rule("norm.{p}", "rwkv.ln_out.{p}"),
    Rule("lm_head.weight", "head.weight"),
]
# our field -> transformers' RwkvConfig field
RWKV_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
    "attention_hidden_size": "attention_hidden_size", "d_ff": "intermediate_size",
    "layer_norm_eps": "layer_norm_epsilon", "rescale_every": "rescale_every", "context_length": "context_length",
    "tie_word_embeddings": "tie_word_embeddings", "pad_token_id": "pad_token_id", "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id"}


def config_from_hf(c: dict) -> RwkvConfig:
    return RwkvConfig(**{ours: c[hf] for ours, hf in RWKV_HF_NAMES.items() if hf in c})


def config_to_hf(cfg: RwkvConfig) -> dict:
    return {hf: getattr(cfg, ours) for ours, hf in RWKV_HF_NAMES.items()}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, rescale_every: int = 0,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> RwkvConfig:
    """An RWKV-4 sized for training. It has no heads and no dropout and no limit on the length:
    ``num_heads`` and ``context`` do not shape it; a ``dropout`` is refused. ``rescale_every`` 0
    by default: the halving protects fp16 inference of deep models, and small ones do not need it."""
    if dropout:
        raise ValueError("rwkv: an RWKV has no dropout; leave dropout unset")
    return RwkvConfig(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, d_ff=d_ff,
                      rescale_every=rescale_every, context_length=context, bos_token_id=bos_token_id,
                      eos_token_id=eos_token_id)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_layers=2, d_ff=64, bos_token_id=None, eos_token_id=None),
    "rwkv-4-169m-pile": dict(vocab_size=50277, d_model=768, num_layers=12, context_length=1024),
}
_BASE_RULES, _HEAD_RULES = split_prefix(RWKV_WEIGHT_MAP, "rwkv.")
RWKV = register_family("rwkv", RwkvConfig, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                       config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                       limits=lambda c: {"vocab_size": c.vocab_size, "context": None},
                       token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
RWKV.register("RwkvForCausalLM", Rwkv, kind="causal-lm", prefix="rwkv.", head_rules=_HEAD_RULES)
RWKV.register("RwkvModel", RwkvModel, kind="base")
