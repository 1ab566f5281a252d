"""Mistral 7B (Jiang et al. 2023): LLaMA with grouped-query attention and a sliding window, each
token attending the ``sliding_window`` positions up to its own (section 2: W = 4096; stacked
layers still carry information from up to k * W tokens back).

Everything else is :mod:`attnlab.models.llama`; the KV cache keeps every key and the window is
a mask (counted in true positions, so left padding does not shift it).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import llama
from .llama import Llama, LlamaConfig, LLAMA_WEIGHT_MAP, register_decoder

__all__ = ["MistralConfig", "Mistral", "MISTRAL"]


@dataclass
class MistralConfig(LlamaConfig):
    sliding_window: int | None = 4096

    def __post_init__(self):
        super().__post_init__()
        if self.attention_bias or self.mlp_bias or self.layer_types is not None:
            raise ValueError("MistralConfig: Mistral has no biases and one window for every layer "
                             "(attention_bias, mlp_bias False; layer_types None)")


class Mistral(Llama):
    """Mistral language model. ``Mistral(MistralConfig(...))``; forward as :class:`CausalLM`."""


MISTRAL_HF_NAMES = llama.hf_names(("attention_bias", "mlp_bias"), sliding_window="sliding_window")


def config_from_hf(c: dict) -> MistralConfig:
    return llama.config_from_hf(c, MistralConfig, MISTRAL_HF_NAMES)


def config_to_hf(cfg: MistralConfig) -> dict:
    return llama.config_to_hf(cfg, MISTRAL_HF_NAMES)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                 max_position_embeddings=64, sliding_window=8),
    "mistral-7b": dict(vocab_size=32000, d_model=4096, num_heads=32, num_kv_heads=8, num_layers=32, d_ff=14336,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2),
}
MISTRAL = register_decoder("mistral", MistralConfig, Mistral, "MistralForCausalLM", weight_map=LLAMA_WEIGHT_MAP,
                           config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
