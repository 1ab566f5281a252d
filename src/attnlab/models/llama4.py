"""Llama 4 (text): LLaMA's decoder with mixture-of-experts layers interleaved with dense ones, layers
without RoPE, chunked attention and QK-norm (Meta 2025, "The Llama 4 herd"; transformers'
Llama4ForCausalLM).

    each layer: x = x + Attn(RMSNorm(x));  x = x + FF(RMSNorm(x))
    FF = SwiGLU (width d_ff_mlp), or every ``interleave_moe_layer_step``-th layer
    FF = Shared(x) + Expert_e(sigmoid(l_e) * x),  e = argmax of the router logits l (top-1)

Attention is grouped-query with two kinds of layers (``no_rope_layers[i]``: 1 = RoPE, 0 = none):

- RoPE layers rotate q and k in interleaved channel pairs (Meta's complex-number layout, which
  transformers keeps in its weights: used as stored), L2-normalise every head of q and k
  (``use_qk_norm``, an RMSNorm without weight; it commutes with the rotation) and attend only
  inside chunks of ``attention_chunk_size`` positions (p // chunk equal), on top of the causal mask.
- no-RoPE layers attend the whole past with no positional signal, the queries scaled by the
  temperature 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)) (``attn_temperature_tuning``),
  which sharpens attention far into a long context.

Positions are true token positions (counted over real tokens under left padding), for the chunks
as in transformers; for the temperature transformers counts slots (padding included), so a
left-padded row differs from transformers there once a prompt passes ``floor_scale`` tokens.
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from .convert import Fuse, Op, Rule
from ..nn.attention import MultiHeadAttention
from ..nn.block import CausalLayer
from ..nn.mlp import GatedMLP, SigmoidTopK, SparseMoE
from ..nn.norm import RMSNorm
from ..nn.position import AttentionPosition, RotaryEmbedding
from . import llama
from .causal_lm import CausalLM
from .llama import LlamaConfig, register_decoder

__all__ = ["Llama4Config", "Llama4", "Llama4Position", "LLAMA4_WEIGHT_MAP", "LLAMA4", "build_config"]


@dataclass
class Llama4Config(LlamaConfig):
    d_ff: int = 8192                          # each expert's (and the shared expert's) width
    d_ff_mlp: int = 16384                     # the dense layers' width
    num_kv_heads: int | None = 8
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_interleaved: bool = True             # interleaved pairs, weights used as stored
    num_experts: int = 16
    top_k: int = 1
    interleave_moe_layer_step: int = 1
    moe_layers: list[int] | None = None       # default: every interleave_moe_layer_step-th layer
    no_rope_layers: list[int] | None = None   # 1 = RoPE, 0 = none; default: every 4th layer has none
    attention_chunk_size: int | None = 8192   # None: RoPE layers attend the whole past too
    use_qk_norm: bool = True
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    router_aux_loss_coef: float = 0.001       # read and written back; attnlab trains Llama 4 without it
    layer_types: list[str] | None = None      # "chunked_attention" | "full_attention"; default: RoPE layers chunked

    def __post_init__(self):
        kinds, self.layer_types = self.layer_types, None    # LLaMA's check knows no chunked layers: ours below
        super().__post_init__()
        self.layer_types = kinds
        name, L = type(self).__name__, self.num_layers
        if self.moe_layers is None:
            self.moe_layers = list(range(self.interleave_moe_layer_step - 1, L, self.interleave_moe_layer_step))
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % 4 != 0) for i in range(L)]
        if len(self.no_rope_layers) != L or any(v not in (0, 1) for v in self.no_rope_layers):
            raise ValueError(f"{name}: no_rope_layers must be {L} values of 0 or 1, got {self.no_rope_layers}")
        if any(not 0 <= i < L for i in self.moe_layers):
            raise ValueError(f"{name}: moe_layers {self.moe_layers} must be layer indices below {L}")
        for f in ("d_ff_mlp", "num_experts", "floor_scale"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{name}: {f} must be positive, got {getattr(self, f)}")
        if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
            raise ValueError(f"{name}: attention_chunk_size must be None or positive, got {self.attention_chunk_size}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"{name}: need 1 <= top_k <= num_experts, got {self.top_k}, {self.num_experts}")
        if self.mlp_bias:
            raise ValueError(f"{name}: Llama 4's feed-forward blocks have no bias (mlp_bias must be False)")
        if self.layer_types is None:
            self.layer_types = ["chunked_attention" if r and self.attention_chunk_size is not None else "full_attention"
                                for r in self.no_rope_layers]
        if len(self.layer_types) != L or not set(self.layer_types) <= {"chunked_attention", "full_attention"} \
                or ("chunked_attention" in self.layer_types and self.attention_chunk_size is None):
            raise ValueError(f"{name}: layer_types must be {L} of 'chunked_attention' (with an attention_chunk_size) "
                             f"or 'full_attention', got {self.layer_types}")


class Llama4Position(AttentionPosition):
    """What one Llama 4 attention layer does with positions (see the module docstring): RoPE then
    L2 norm of each head (``rope``, ``qk_norm_eps``), chunks (``chunk``: a -inf bias outside a
    query's chunk), or the query temperature (``temperature`` = (floor_scale, attn_scale))."""

    def __init__(self, rope: RotaryEmbedding | None = None, qk_norm_eps: float | None = None,
                 chunk: int | None = None, temperature: tuple[int, float] | None = None):
        super().__init__()
        self.rope, self.qk_norm_eps, self.chunk, self.temperature = rope, qk_norm_eps, chunk, temperature

    def _l2(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.qk_norm_eps)).to(x.dtype)

    def transform(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if self.rope is not None:
            q, k = self.rope.transform(q, k, q_pos, k_pos)
        if self.qk_norm_eps is not None:
            q, k = self._l2(q), self._l2(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            t = torch.log1p(torch.floor((q_pos.float() + 1.0) / floor_scale)) * attn_scale + 1.0   # (T,) or (B, T)
            t = t[:, None, :, None] if t.dim() == 2 else t[:, None]                    # over (B, H, T, D)
            q = (q * t).to(q.dtype)
        return q, k

    def bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        if self.chunk is None or int(k_pos.max()) < self.chunk:      # one chunk: the causal mask is all
            return None
        qc, kc = q_pos // self.chunk, k_pos // self.chunk
        if qc.dim() == kc.dim() == 1:
            same = qc[:, None] == kc[None, :]                                         # (T, S)
        else:
            same = (qc if qc.dim() == 2 else qc[None])[:, :, None] == (kc if kc.dim() == 2 else kc[None])[:, None, :]
            same = same[:, None]                                                      # (B, 1, T, S)
        return torch.zeros(same.shape, dtype=q.dtype, device=q.device).masked_fill_(~same, float("-inf"))


class Llama4(CausalLM):
    """Llama 4 text model. ``Llama4(Llama4Config(...))``; forward as :class:`CausalLM`."""

    def __init__(self, config: Llama4Config):
        super().__init__(config)
        c, E = config, config.d_model
        rope = RotaryEmbedding(c.head_dim, base=c.rope_theta, interleaved=c.rope_interleaved, scaling=c.rope_scaling,
                               max_position_embeddings=c.max_position_embeddings)
        self.token_embedding = nn.Embedding(c.vocab_size, E)
        self.layers = nn.ModuleList(
            CausalLayer(E, c.num_heads, c.d_ff, 0.0, norm_first=True, norm="rmsnorm", eps=c.rms_norm_eps,
                        self_attn=MultiHeadAttention(E, c.num_heads, c.attention_dropout, num_kv_heads=c.num_kv_heads,
                                                     head_dim=c.head_dim, bias=c.attention_bias,
                                                     position=self.position(i, rope), causal=True),
                        ff=self.feed_forward(i))
            for i in range(c.num_layers))
        self.norm = RMSNorm(E, c.rms_norm_eps)
        self.lm_head = nn.Linear(E, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def position(self, i: int, rope: RotaryEmbedding) -> Llama4Position:
        c = self.config
        if c.no_rope_layers[i]:
            return Llama4Position(rope, c.rms_norm_eps if c.use_qk_norm else None,
                                  c.attention_chunk_size if c.layer_types[i] == "chunked_attention" else None)
        return Llama4Position(temperature=(c.floor_scale, c.attn_scale) if c.attn_temperature_tuning else None)

    def feed_forward(self, i: int) -> nn.Module:
        c = self.config
        if i not in c.moe_layers:
            return GatedMLP(c.d_model, c.d_ff_mlp, activation=c.activation)
        return SparseMoE(c.d_model, c.d_ff, c.num_experts, c.top_k, activation=c.activation,
                         routing=SigmoidTopK(c.num_experts, c.top_k), weights_on="inputs",
                         shared_expert=GatedMLP(c.d_model, c.d_ff, activation=c.activation))


# ----------------------------------------------------------------------------- Hugging Face
class SwapLast(Op):
    """Stacked expert matrices between our (X, out, in) and transformers' (X, in, out), after
    ``inner`` (a Fuse of gate and up) on our side."""

    def __init__(self, inner: Op | None = None):
        self.inner, self.name = inner, f"swap_last({inner!r})" if inner else "swap_last"

    def to_hf(self, tensors, config):
        tensors = self.inner.to_hf(tensors, config) if self.inner else tensors
        return [t.transpose(-1, -2).contiguous() for t in tensors]

    def from_hf(self, tensors, config):
        tensors = [t.transpose(-1, -2).contiguous() for t in tensors]
        return self.inner.from_hf(tensors, config) if self.inner else tensors


_ATTN, _FF = "model.layers.{i}.self_attn", "model.layers.{i}.feed_forward"
LLAMA4_WEIGHT_MAP = [
    Rule("token_embedding.weight", "model.embed_tokens.weight"),
    *[Rule(f"layers.{{i}}.self_attn.{p}_proj.{{b}}", f"{_ATTN}.{p}_proj.{{b}}") for p in ("q", "k", "v")],
    Rule("layers.{i}.self_attn.out_proj.{b}", f"{_ATTN}.o_proj.{{b}}"),
    Rule("layers.{i}.self_attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    Rule("layers.{i}.ff_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    *[Rule(f"layers.{{i}}.ff.{p}_proj.weight", f"{_FF}.{p}_proj.weight") for p in ("gate", "up", "down")],
    Rule("layers.{i}.ff.gate.weight", f"{_FF}.router.weight"),
    *[Rule(f"layers.{{i}}.ff.shared_expert.{p}_proj.weight", f"{_FF}.shared_expert.{p}_proj.weight")
      for p in ("gate", "up", "down")],
    # experts stacked: gate_up_proj (X, E, 2F), gate columns first; down_proj (X, F, E)
    Rule(("layers.{i}.ff.experts.{e}.gate_proj.weight", "layers.{i}.ff.experts.{e}.up_proj.weight"),
         f"{_FF}.experts.gate_up_proj", SwapLast(Fuse(dim=1, parts=2))),
    Rule("layers.{i}.ff.experts.{e}.down_proj.weight", f"{_FF}.experts.down_proj", SwapLast()),
    Rule("norm.weight", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
]

_HF_NAMES = {**llama.LLAMA_HF_NAMES, "d_ff_mlp": "intermediate_size_mlp", "num_experts": "num_local_experts",
             "top_k": "num_experts_per_tok", "interleave_moe_layer_step": "interleave_moe_layer_step",
             "moe_layers": "moe_layers", "no_rope_layers": "no_rope_layers", "use_qk_norm": "use_qk_norm",
             "attn_temperature_tuning": "attn_temperature_tuning", "floor_scale": "floor_scale",
             "attn_scale": "attn_scale", "router_aux_loss_coef": "router_aux_loss_coef", "layer_types": "layer_types"}


def config_from_hf(c: dict) -> Llama4Config:
    cfg = llama.config_from_hf(c, Llama4Config, _HF_NAMES)
    # None is a value here (no chunks), so it is read apart from the names that skip None
    return replace(cfg, attention_chunk_size=c.get("attention_chunk_size", 8192), layer_types=c.get("layer_types"))


def config_to_hf(cfg: Llama4Config) -> dict:
    return {**llama.config_to_hf(cfg, _HF_NAMES), "attention_chunk_size": cfg.attention_chunk_size}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_kv_heads: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> Llama4Config:
    """A Llama 4 sized for training: LLaMA's sizes, the dense layers d_ff wide and every second
    layer 4 top-1 experts of half that width beside a shared one; every 4th layer without RoPE;
    chunks of a quarter of the context."""
    f = llama.sized_fields(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                           num_layers=num_layers, d_ff=d_ff, dropout=dropout, num_kv_heads=num_kv_heads,
                           bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return Llama4Config(**{**f, "d_ff": max(1, f["d_ff"] // 2)}, d_ff_mlp=f["d_ff"], num_experts=4,
                        interleave_moe_layer_step=2, attention_chunk_size=max(1, context // 4),
                        floor_scale=max(1, context))


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=4, d_ff=16,
                 d_ff_mlp=48, num_experts=4, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 0],
                 attention_chunk_size=4, floor_scale=2, max_position_embeddings=64),
    "llama-4-scout-17b-16e": dict(vocab_size=202048, d_model=5120, num_heads=40, head_dim=128, num_layers=48,
                                  max_position_embeddings=10485760, bos_token_id=200000, eos_token_id=200008),
}

LLAMA4 = register_decoder("llama4_text", Llama4Config, Llama4, "Llama4ForCausalLM",
                          weight_map=LLAMA4_WEIGHT_MAP, config_from_hf=config_from_hf,
                          config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config)
