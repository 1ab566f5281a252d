"""OLMo 2 (Team OLMo 2024): LLaMA with the norms moved from the input of each sublayer to its
output, inside the residual branch, and QK-norm over the whole projection width:

    x = x + RMSNorm(Attn(x));  x = x + RMSNorm(SwiGLU(x))
    q = RoPE(split(RMSNorm_{H D}(x W_q))),  k = RoPE(split(RMSNorm_{G D}(x W_k)))

(section 3.2: both changes made training stable where the spikes of OLMo 1 were). The query
norm has one gain per channel of all heads, so it is a
:class:`~attnlab.nn.norm.JointHeadsRMSNorm`, not a per-head RMSNorm as in Qwen3.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import llama
from .convert import Rule
from .llama import Llama, LlamaConfig, llama_weight_map, register_decoder
from ..nn.block import CausalLayer
from ..nn.norm import JointHeadsRMSNorm

__all__ = ["Olmo2Config", "Olmo2", "OLMO2"]


@dataclass
class Olmo2Config(LlamaConfig):
    rms_norm_eps: float = 1e-5


class Olmo2(Llama):
    """OLMo 2 language model. ``Olmo2(Olmo2Config(...))``; forward as :class:`CausalLM`."""

    def layer(self, i: int) -> CausalLayer:
        c = self.config
        return CausalLayer(c.d_model, c.num_heads, c.d_ff, 0.0, norm_first=True, self_attn=self.attention(i),
                           ff=self.feed_forward(), self_attn_norm=nn.Identity(), ff_norm=nn.Identity(),
                           self_attn_out_norm=self.make_norm(c.d_model), ff_out_norm=self.make_norm(c.d_model))

    def attention(self, i: int, **options) -> nn.Module:
        c = self.config
        eps, D = c.rms_norm_eps, c.head_dim
        return super().attention(i, q_norm=JointHeadsRMSNorm(c.num_heads * D, eps),
                                 k_norm=JointHeadsRMSNorm(c.num_kv_heads * D, eps), **options)


_L = "model.layers.{i}"
_MLP = [Rule(f"layers.{{i}}.ff.{p}_proj.{{b}}", f"{_L}.mlp.{p}_proj.{{b}}") for p in ("gate", "up", "down")]
OLMO2_WEIGHT_MAP = [r for r in llama_weight_map(_MLP) if "_norm" not in r.ours[0]] + [
    Rule("layers.{i}.self_attn_out_norm.weight", f"{_L}.post_attention_layernorm.weight"),
    Rule("layers.{i}.ff_out_norm.weight", f"{_L}.post_feedforward_layernorm.weight"),
    Rule("layers.{i}.self_attn.q_norm.weight", f"{_L}.self_attn.q_norm.weight"),
    Rule("layers.{i}.self_attn.k_norm.weight", f"{_L}.self_attn.k_norm.weight"),
]
OLMO2_HF_NAMES = llama.hf_names(("mlp_bias", "head_dim"))


def config_from_hf(c: dict) -> Olmo2Config:
    return llama.config_from_hf(c, Olmo2Config, OLMO2_HF_NAMES)


def config_to_hf(cfg: Olmo2Config) -> dict:
    return llama.config_to_hf(cfg, OLMO2_HF_NAMES)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                 max_position_embeddings=64),
    "olmo-2-1b": dict(vocab_size=100352, d_model=2048, num_heads=16, num_layers=16, d_ff=8192,
                      max_position_embeddings=4096, rope_theta=5e5, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=100257),
}
OLMO2 = register_decoder("olmo2", Olmo2Config, Olmo2, "Olmo2ForCausalLM", weight_map=OLMO2_WEIGHT_MAP,
                         config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
