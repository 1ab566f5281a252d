"""Qwen2 and Qwen2.5 (Qwen team 2024): LLaMA with a bias on the query, key and value projections
but none on the output projection, and optional sliding-window attention on the upper layers.

    each layer: x = x + Attn(RMSNorm(x));  x = x + SwiGLU(RMSNorm(x)),   q/k/v = x W + b, o = a W_o

Everything else is :mod:`attnlab.models.llama` (long-context checkpoints use YaRN RoPE, which
it reads). transformers' ``use_sliding_window`` turns the window on for the layers from
``max_window_layers`` up (``layer_types`` lists them).
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import llama
from .llama import Llama, LlamaConfig, LLAMA_WEIGHT_MAP, register_decoder

__all__ = ["Qwen2Config", "Qwen2", "QWEN2", "sliding_layer_types"]


def sliding_layer_types(cfg) -> None:
    """transformers' default for Qwen-style configs: sliding on the layers from max_window_layers up."""
    if cfg.layer_types is None and cfg.sliding_window is not None:
        cfg.layer_types = ["sliding_attention" if i >= cfg.max_window_layers else "full_attention"
                           for i in range(cfg.num_layers)]


@dataclass
class Qwen2Config(LlamaConfig):
    attention_bias: bool = True               # on q, k and v; the output projection never has one
    max_window_layers: int = 28

    def __post_init__(self):
        super().__post_init__()
        sliding_layer_types(self)


class Qwen2(Llama):
    """Qwen2 language model. ``Qwen2(Qwen2Config(...))``; forward as :class:`CausalLM`."""

    def attention(self, i: int, **options) -> nn.Module:
        return super().attention(i, out_bias=False, **options)


QWEN2_HF_NAMES = llama.hf_names(("attention_bias", "mlp_bias", "head_dim"), sliding_window="sliding_window",
                                layer_types="layer_types", max_window_layers="max_window_layers")


def window_from_hf(c: dict) -> dict:
    """A config.json whose sliding_window counts only with use_sliding_window (Qwen2, Qwen3, SmolLM3)."""
    return c if c.get("use_sliding_window") else {**c, "sliding_window": None}


def config_from_hf(c: dict) -> Qwen2Config:
    return llama.config_from_hf(window_from_hf(c), Qwen2Config, QWEN2_HF_NAMES)


def config_to_hf(cfg: Qwen2Config) -> dict:
    return {**llama.config_to_hf(cfg, QWEN2_HF_NAMES), "use_sliding_window": cfg.sliding_window is not None}


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                 max_position_embeddings=64),
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, num_heads=14, num_kv_heads=2, num_layers=24, d_ff=4864,
                         max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                         bos_token_id=151643, eos_token_id=151643),
}
QWEN2 = register_decoder("qwen2", Qwen2Config, Qwen2, "Qwen2ForCausalLM", weight_map=LLAMA_WEIGHT_MAP,
                         config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
