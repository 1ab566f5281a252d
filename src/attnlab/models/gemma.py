"""Gemma (Gemma Team 2024): LLaMA with three changes that a checkpoint's numbers depend on.

    RMSNorm gain 1 + w (weights stored around 0), computed in fp32 and rounded once
    token embedding * sqrt(E), the factor first rounded to the weights' dtype
    GeGLU: gelu_tanh(x W_gate) * (x W_up), heads of D = 256 whatever E; embedding tied to the head

(bf16 rounds sqrt(3072) to 55.5: a model that scales in fp32 differs from the trained one.)
Gemma 2 and 3 (:mod:`attnlab.models.gemma2`, :mod:`attnlab.models.gemma3`) build on this file.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import llama
from .llama import Llama, LlamaConfig, LLAMA_WEIGHT_MAP, register_decoder
from ..nn.norm import RMSNorm

__all__ = ["GemmaConfig", "Gemma", "GEMMA", "act_from_hf"]


@dataclass
class GemmaConfig(LlamaConfig):
    activation: str = "gelu_tanh"
    tie_word_embeddings: bool = True


class Gemma(Llama):
    """Gemma language model. ``Gemma(GemmaConfig(...))``; forward as :class:`CausalLM`."""

    def make_norm(self, d: int) -> nn.Module:
        return RMSNorm(d, self.config.rms_norm_eps, unit_offset=True)

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.token_embedding(input_ids)
        return x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)


GEMMA_HF_NAMES = llama.hf_names(("mlp_bias",))


def act_from_hf(c: dict) -> dict:
    """Gemma 2 and 3 name the activation ``hidden_activation``; Gemma 1 ``hidden_act``."""
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    return {**c, "hidden_act": "gelu_pytorch_tanh" if act == "gelu" else act}   # Gemma's "gelu" meant tanh


def config_from_hf(c: dict) -> GemmaConfig:
    return llama.config_from_hf(act_from_hf(c), GemmaConfig, GEMMA_HF_NAMES)


def config_to_hf(cfg: GemmaConfig) -> dict:
    return llama.config_to_hf(cfg, GEMMA_HF_NAMES)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, head_dim=16, num_layers=2, d_ff=64,
                 max_position_embeddings=64),
    "gemma-2b": dict(vocab_size=256000, d_model=2048, num_heads=8, num_kv_heads=1, head_dim=256, num_layers=18,
                     d_ff=16384, max_position_embeddings=8192, bos_token_id=2, eos_token_id=1),
}
GEMMA = register_decoder("gemma", GemmaConfig, Gemma, "GemmaForCausalLM", weight_map=LLAMA_WEIGHT_MAP,
                         config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
