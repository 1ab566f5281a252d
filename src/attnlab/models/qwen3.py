"""Qwen3 (Qwen team 2025): LLaMA with QK-norm, an RMSNorm over each head's queries and keys
before RoPE (it keeps attention logits from growing without the Qwen2 biases), and a head
width set on its own (``head_dim`` 128 with d_model 1024 in Qwen3-0.6B, so H * D != E).

    q_h = RoPE(RMSNorm_q(x W_q,h)),  k_h = RoPE(RMSNorm_k(x W_k,h)),  one gain of D per projection

``attention_bias`` puts a bias on all four projections (none in the released models);
sliding-window layers as in :mod:`attnlab.models.qwen2`.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import llama
from .convert import Rule
from .llama import Llama, LlamaConfig, llama_weight_map, register_decoder
from .qwen2 import sliding_layer_types, window_from_hf

__all__ = ["Qwen3Config", "Qwen3", "QWEN3", "QK_NORM_RULES"]


@dataclass
class Qwen3Config(LlamaConfig):
    max_window_layers: int = 28

    def __post_init__(self):
        super().__post_init__()
        sliding_layer_types(self)


class Qwen3(Llama):
    """Qwen3 language model. ``Qwen3(Qwen3Config(...))``; forward as :class:`CausalLM`."""

    def attention(self, i: int, **options) -> nn.Module:
        D = self.config.head_dim
        return super().attention(i, q_norm=self.make_norm(D), k_norm=self.make_norm(D), **options)


_ATTN = "layers.{i}.self_attn"
QK_NORM_RULES = [Rule(f"{_ATTN}.{n}.weight", f"model.{_ATTN}.{n}.weight") for n in ("q_norm", "k_norm")]
QWEN3_WEIGHT_MAP = llama_weight_map(
    [Rule(f"layers.{{i}}.ff.{p}_proj.{{b}}", f"model.layers.{{i}}.mlp.{p}_proj.{{b}}") for p in ("gate", "up", "down")]
    + QK_NORM_RULES)
QWEN3_HF_NAMES = llama.hf_names(("mlp_bias",), sliding_window="sliding_window", layer_types="layer_types",
                                max_window_layers="max_window_layers")


def config_from_hf(c: dict) -> Qwen3Config:
    return llama.config_from_hf(window_from_hf(c), Qwen3Config, QWEN3_HF_NAMES)


def config_to_hf(cfg: Qwen3Config) -> dict:
    return {**llama.config_to_hf(cfg, QWEN3_HF_NAMES), "use_sliding_window": cfg.sliding_window is not None}


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, d_ff=64,
                 max_position_embeddings=64),
    "qwen3-0.6b": dict(vocab_size=151936, d_model=1024, num_heads=16, num_kv_heads=8, head_dim=128, num_layers=28,
                       d_ff=3072, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True,
                       bos_token_id=151643, eos_token_id=151645),
}
QWEN3 = register_decoder("qwen3", Qwen3Config, Qwen3, "Qwen3ForCausalLM", weight_map=QWEN3_WEIGHT_MAP,
                         config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
