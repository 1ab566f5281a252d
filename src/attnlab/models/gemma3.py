"""Gemma 3, text (Gemma Team 2025): Gemma 2's layers with QK-norm in place of score soft-capping,
five local layers for each global one, and a RoPE base per kind of layer (section 2):

    local (sliding-window) layers: RoPE base 10^4;  global layers: base 10^6, often linear-scaled
    q_h, k_h = (1 + w) RMSNorm over each head, before RoPE

transformers 5.x nests ``rope_parameters`` by layer type ({"sliding_attention": {...},
"full_attention": {...}}); older configs give ``rope_theta`` (global) and
``rope_local_base_freq``. Soft-capping stays available (None in the released models).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import llama
from .gemma import act_from_hf
from .gemma2 import Gemma2, Gemma2Config, GEMMA2_HF_NAMES, sandwich_weight_map
from .llama import register_decoder, rope_from_hf, rope_to_hf
from .qwen3 import QK_NORM_RULES

__all__ = ["Gemma3TextConfig", "Gemma3", "GEMMA3"]


@dataclass
class Gemma3TextConfig(Gemma2Config):
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    window_pattern: int = 6
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict | None = None


class Gemma3(Gemma2):
    """Gemma 3's text model. ``Gemma3(Gemma3TextConfig(...))``; forward as :class:`CausalLM`."""

    def attention(self, i: int, **options) -> nn.Module:
        D = self.config.head_dim
        return super().attention(i, q_norm=self.make_norm(D), k_norm=self.make_norm(D), **options)

    def position(self, i: int) -> nn.Module | None:
        c = self.config
        if c.layer_types[i] == "full_attention":
            return self.rotary_emb
        if not hasattr(self, "rotary_local"):          # one module shared by the local layers
            self.rotary_local = self.rotary(c.rope_local_theta, c.rope_local_scaling)
        return self.rotary_local


def config_from_hf(c: dict) -> Gemma3TextConfig:
    rope = c.get("rope_parameters") or {}
    c = act_from_hf({k: v for k, v in c.items() if k != "rope_parameters"})
    name = "Gemma3TextConfig"
    if "full_attention" in rope or "sliding_attention" in rope:
        full = rope_from_hf(c, name, rope.get("full_attention") or {})
        local = rope_from_hf({**c, "rope_theta": None}, name, rope.get("sliding_attention") or {})
    else:                                               # the older flat form
        full = rope_from_hf({**c, "rope_parameters": rope or None}, name)
        local = {"rope_theta": c.get("rope_local_base_freq", 10000.0), "rope_scaling": None}
    cfg = llama.config_from_hf({**c, "rope_parameters": {"rope_type": "default"}}, Gemma3TextConfig, GEMMA2_HF_NAMES)
    cfg.rope_theta, cfg.rope_scaling = full.get("rope_theta", 1e6), full["rope_scaling"]
    cfg.rope_local_theta, cfg.rope_local_scaling = local.get("rope_theta", 10000.0), local["rope_scaling"]
    cfg.__post_init__()
    return cfg


def config_to_hf(cfg: Gemma3TextConfig) -> dict:
    out = llama.config_to_hf(cfg, GEMMA2_HF_NAMES)
    out["hidden_activation"] = out.pop("hidden_act")
    out.pop("rope_theta")
    out["rope_parameters"] = {"full_attention": rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
                              "sliding_attention": rope_to_hf(cfg.rope_local_theta, cfg.rope_local_scaling)}
    return out


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, d_ff=64,
                 max_position_embeddings=64, query_pre_attn_scalar=16, sliding_window=8, window_pattern=2,
                 rope_theta=1e6, rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "gemma-3-1b": dict(vocab_size=262144, d_model=1152, num_heads=4, num_kv_heads=1, head_dim=256, num_layers=26,
                       d_ff=6912, max_position_embeddings=32768, sliding_window=512, rope_theta=1e6,
                       bos_token_id=2, eos_token_id=1),
}
GEMMA3 = register_decoder("gemma3_text", Gemma3TextConfig, Gemma3, "Gemma3ForCausalLM",
                          weight_map=sandwich_weight_map(QK_NORM_RULES), config_from_hf=config_from_hf,
                          config_to_hf=config_to_hf, presets=PRESETS)
