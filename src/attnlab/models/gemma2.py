"""Gemma 2 (Gemma Team 2024b): Gemma with "sandwich" norms, soft-capped scores and logits, its
own score scale and local layers alternating with global ones (section 2):

    x = x + Norm(Attn(Norm(x)));  x = x + Norm(GeGLU(Norm(x)))        (all (1 + w) RMSNorms)
    scores = 50 tanh(q k^T / (50 sqrt(query_pre_attn_scalar)));  logits = 30 tanh(logits / 30)
    layers 0, 2, 4, ...: a sliding window of 4096;  1, 3, 5, ...: global

The scale is ``query_pre_attn_scalar ** -0.5`` (E / H for the 27B, not its head width).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import llama
from .convert import Rule
from .gemma import Gemma, GemmaConfig, act_from_hf
from .llama import llama_weight_map, register_decoder
from ..nn.block import CausalLayer
from ..nn.cache import LayerCaches

__all__ = ["Gemma2Config", "Gemma2", "GEMMA2", "sandwich_weight_map"]


@dataclass
class Gemma2Config(GemmaConfig):
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    sliding_window: int | None = 4096
    window_pattern: int = 2                   # every window_pattern-th layer is global (when layer_types is None)

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None:
            self.layer_types = ["sliding_attention" if (i + 1) % self.window_pattern else "full_attention"
                                for i in range(self.num_layers)]


class Gemma2(Gemma):
    """Gemma 2 language model. ``Gemma2(Gemma2Config(...))``; forward as :class:`CausalLM`."""

    def layer(self, i: int) -> CausalLayer:
        c, norm = self.config, self.make_norm
        E = c.d_model
        return CausalLayer(E, c.num_heads, c.d_ff, 0.0, norm_first=True, self_attn=self.attention(i),
                           ff=self.feed_forward(), self_attn_norm=norm(E), ff_norm=norm(E),
                           self_attn_out_norm=norm(E), ff_out_norm=norm(E))

    def attention(self, i: int, **options) -> nn.Module:
        c = self.config
        return super().attention(i, scale=c.query_pre_attn_scalar ** -0.5, softcap=c.attn_logit_softcapping,
                                 **options)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: LayerCaches | None = None) -> Tensor:
        logits = super().forward(input_ids, attention_mask, positions, cache)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def sandwich_weight_map(extra: list[Rule] = ()) -> list[Rule]:
    """LLaMA's keys with Gemma 2's four norms per layer (Gemma 3 adds its QK-norm rules)."""
    L = "model.layers.{i}"
    mlp = [Rule(f"layers.{{i}}.ff.{p}_proj.{{b}}", f"{L}.mlp.{p}_proj.{{b}}") for p in ("gate", "up", "down")]
    norms = [Rule(f"layers.{{i}}.{ours}.weight", f"{L}.{theirs}.weight") for ours, theirs in (
        ("self_attn_norm", "input_layernorm"), ("self_attn_out_norm", "post_attention_layernorm"),
        ("ff_norm", "pre_feedforward_layernorm"), ("ff_out_norm", "post_feedforward_layernorm"))]
    llama_norms = ("layers.{i}.self_attn_norm.weight", "layers.{i}.ff_norm.weight")
    return [r for r in llama_weight_map(mlp + list(extra)) if r.ours[0] not in llama_norms] + norms


GEMMA2_HF_NAMES = llama.hf_names(("mlp_bias",), query_pre_attn_scalar="query_pre_attn_scalar",
                                 attn_logit_softcapping="attn_logit_softcapping",
                                 final_logit_softcapping="final_logit_softcapping", sliding_window="sliding_window",
                                 layer_types="layer_types", window_pattern="sliding_window_pattern")


def config_from_hf(c: dict) -> Gemma2Config:
    return llama.config_from_hf(act_from_hf(c), Gemma2Config, GEMMA2_HF_NAMES)


def config_to_hf(cfg: Gemma2Config) -> dict:
    out = llama.config_to_hf(cfg, GEMMA2_HF_NAMES)
    out["hidden_activation"] = out.pop("hidden_act")
    return out


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, d_ff=64,
                 max_position_embeddings=64, query_pre_attn_scalar=16, sliding_window=8),
    "gemma-2-2b": dict(vocab_size=256000, d_model=2304, num_heads=8, num_kv_heads=4, head_dim=256, num_layers=26,
                       d_ff=9216, max_position_embeddings=8192, bos_token_id=2, eos_token_id=1),
}
GEMMA2 = register_decoder("gemma2", Gemma2Config, Gemma2, "Gemma2ForCausalLM", weight_map=sandwich_weight_map(),
                          config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
