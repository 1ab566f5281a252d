"""SmolLM3 (Hugging Face 2025): LLaMA whose every fourth layer has no position encoding at all
("NoPE" layers, Kazemnejad et al. 2023): those layers attend by content alone, and the model
extrapolates to longer contexts better than with RoPE on every layer.

``no_rope_layers[i]`` is 1 where layer i rotates q and k, 0 where it does not (transformers'
convention; default: 0 on layers 4, 8, ...). Embeddings tied to the head; everything else is
:mod:`attnlab.models.llama`.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from . import llama
from .llama import Llama, LlamaConfig, LLAMA_WEIGHT_MAP, register_decoder
from .qwen2 import window_from_hf

__all__ = ["SmolLM3Config", "SmolLM3", "SMOLLM3"]


@dataclass
class SmolLM3Config(LlamaConfig):
    no_rope_layers: list[int] | None = None       # 1: RoPE on that layer, 0: none
    no_rope_layer_interval: int = 4
    tie_word_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.no_rope_layers is None:
            self.no_rope_layers = [int((i + 1) % self.no_rope_layer_interval != 0) for i in range(self.num_layers)]
        if len(self.no_rope_layers) != self.num_layers or not set(self.no_rope_layers) <= {0, 1}:
            raise ValueError(f"SmolLM3Config: no_rope_layers must give 0 or 1 for each of the {self.num_layers} "
                             f"layers, got {self.no_rope_layers}")


class SmolLM3(Llama):
    """SmolLM3 language model. ``SmolLM3(SmolLM3Config(...))``; forward as :class:`CausalLM`."""

    def position(self, i: int) -> nn.Module | None:
        return self.rotary_emb if self.config.no_rope_layers[i] else None


SMOLLM3_HF_NAMES = llama.hf_names(("head_dim",), sliding_window="sliding_window", layer_types="layer_types",
                                  no_rope_layers="no_rope_layers", no_rope_layer_interval="no_rope_layer_interval")


def config_from_hf(c: dict) -> SmolLM3Config:
    return llama.config_from_hf(window_from_hf(c), SmolLM3Config, SMOLLM3_HF_NAMES)


def config_to_hf(cfg: SmolLM3Config) -> dict:
    # transformers' default pad id (128004) would lie outside a smaller vocabulary; we keep no pad id
    return {**llama.config_to_hf(cfg, SMOLLM3_HF_NAMES), "use_sliding_window": cfg.sliding_window is not None,
            "pad_token_id": None}


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=4, d_ff=64,
                 max_position_embeddings=64),
    "smollm3-3b": dict(vocab_size=128256, d_model=2048, num_heads=16, num_kv_heads=4, num_layers=36, d_ff=11008,
                       max_position_embeddings=65536, rope_theta=5e6, bos_token_id=128000, eos_token_id=128012),
}
SMOLLM3 = register_decoder("smollm3", SmolLM3Config, SmolLM3, "SmolLM3ForCausalLM", weight_map=LLAMA_WEIGHT_MAP,
                           config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
