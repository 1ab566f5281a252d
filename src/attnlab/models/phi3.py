"""Phi-3 and Phi-4-mini (Microsoft 2024-25): LLaMA with the query, key and value projections
fused into one matrix and the gate and up projections into another, LongRoPE for the long
context, and (Phi-4-mini) RoPE on a fraction of each head only.

    qkv_proj: E -> (H + 2G) D, cut into H D | G D | G D (unequal when G < H)
    gate_up_proj: E -> 2F, cut into gate | up;  SwiGLU = down(silu(gate) * up)

Our attention keeps the fused matrix (``MultiHeadAttention(fused_qkv=True)``); the MLP's two
halves are cut on load and joined on save. ``original_max_position_embeddings`` sits at the top
of Phi-3's config.json and wins over the RoPE dict's (transformers reads it so); transformers
renames the older "su" and "yarn" types of Phi-3 configs to longrope, and so do we.

LongRoPE switches from the short to the long factors once the sequence passes the original
context. A cache keeps each key as rotated when it was computed, with the short factors; at the
switch transformers' Phi-3 ``generate`` drops its cache and recomputes the whole sequence with the
long ones (every key, and so every later layer's input, changes). Phi-3 does the same: its cache
(:meth:`Phi3.new_cache`) also keeps the token ids it has consumed, and the cached call that
crosses the switch runs the whole sequence again into an emptied cache, so a greedy decode that
crosses it gives transformers' tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import llama
from ..nn.cache import KVCache, LayerCaches
from .convert import Fuse, Rule
from .llama import Llama, LlamaConfig, register_decoder

__all__ = ["Phi3Config", "Phi3", "PHI3", "PHI3_WEIGHT_MAP"]


@dataclass
class Phi3Config(LlamaConfig):
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        super().__post_init__()
        if self.attention_bias or self.mlp_bias or self.head_dim * self.num_heads != self.d_model:
            raise ValueError("Phi3Config: Phi-3 has no biases and head_dim = d_model / num_heads")
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] != "longrope":
            raise ValueError(f"Phi3Config: RoPE type must be default or longrope, got {self.rope_scaling}")


class Phi3Cache(LayerCaches):
    """Phi-3's KV cache: :class:`LayerCaches` that also keeps the token ids of the slots it holds
    (B, S), following its reorder and truncation, so that the LongRoPE switch can recompute them."""

    def __init__(self, num_layers: int):
        super().__init__(num_layers, cross=False)
        self.ids: Tensor | None = None

    def reorder(self, index: Tensor) -> None:
        super().reorder(index)
        if self.ids is not None:
            self.ids = self.ids.index_select(0, index.to(self.ids.device))

    def truncate(self, length: int) -> None:
        super().truncate(length)
        if self.ids is not None:
            self.ids = self.ids[:, :length]

    def clear(self) -> None:
        """Forget every slot (the layers' caches are made anew)."""
        self.self_attn = [KVCache() for _ in self.self_attn]
        self.ids = None


class Phi3(Llama):
    """Phi-3 language model. ``Phi3(Phi3Config(...))``; forward as :class:`CausalLM`."""

    def attention(self, i: int, **options) -> nn.Module:
        return super().attention(i, fused_qkv=True, **options)

    def new_cache(self) -> Phi3Cache:
        return Phi3Cache(len(self.layers))

    def _switch(self) -> int | None:
        """The length past which LongRoPE takes its long factors (None: no switch)."""
        s = self.config.rope_scaling
        return None if s is None else s["original_max_position_embeddings"]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: LayerCaches | None = None) -> Tensor:
        switch = self._switch()
        if not isinstance(cache, Phi3Cache) or switch is None or positions is not None:
            return super().forward(input_ids, attention_mask, positions, cache)
        past, T = cache.length, input_ids.size(1)
        if 0 < past <= switch < past + T and cache.ids is not None and cache.ids.size(1) == past:
            # the call that crosses the switch: the whole sequence again, every key with the long factors
            everything = torch.cat([cache.ids, input_ids], dim=1)
            cache.clear()
            logits = super().forward(everything, attention_mask, None, cache)[:, -T:]
        else:
            logits = super().forward(input_ids, attention_mask, None, cache)
            everything = input_ids if cache.ids is None or past == 0 else torch.cat([cache.ids, input_ids], dim=1)
        cache.ids = everything
        return logits


_L = "model.layers.{i}"
PHI3_WEIGHT_MAP = [
    Rule("token_embedding.weight", "model.embed_tokens.weight"),
    Rule("layers.{i}.self_attn.qkv_proj.weight", f"{_L}.self_attn.qkv_proj.weight"),
    Rule("layers.{i}.self_attn.out_proj.weight", f"{_L}.self_attn.o_proj.weight"),
    Rule("layers.{i}.self_attn_norm.weight", f"{_L}.input_layernorm.weight"),
    Rule("layers.{i}.ff_norm.weight", f"{_L}.post_attention_layernorm.weight"),
    Rule(("layers.{i}.ff.gate_proj.weight", "layers.{i}.ff.up_proj.weight"), f"{_L}.mlp.gate_up_proj.weight",
         Fuse(dim=0, parts=2)),
    Rule("layers.{i}.ff.down_proj.weight", f"{_L}.mlp.down_proj.weight"),
    Rule("norm.weight", "model.norm.weight"),
    Rule("lm_head.weight", "lm_head.weight"),
]
PHI3_HF_NAMES = llama.hf_names(("attention_bias", "mlp_bias", "head_dim"))


def config_from_hf(c: dict) -> Phi3Config:
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):     # Phi-3's older names of LongRoPE
        rope.pop("type", None)
        c = {**c, "rope_parameters": {**rope, "rope_type": "longrope"}}
    return llama.config_from_hf(c, Phi3Config, PHI3_HF_NAMES)


def config_to_hf(cfg: Phi3Config) -> dict:
    out = llama.config_to_hf(cfg, PHI3_HF_NAMES)
    s = cfg.rope_scaling
    out["original_max_position_embeddings"] = cfg.max_position_embeddings if s is None else \
        s["original_max_position_embeddings"]
    out["partial_rotary_factor"] = cfg.partial_rotary_factor
    out["pad_token_id"] = None        # transformers' default (32000) would lie outside a smaller vocabulary
    return out


_SHORT = [1.0, 1.25]
PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                 max_position_embeddings=64, partial_rotary_factor=0.5,
                 rope_scaling={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": [2 * f for f in _SHORT],
                               "original_max_position_embeddings": 16}),
    "phi-4-mini": dict(vocab_size=200064, d_model=3072, num_heads=24, num_kv_heads=8, num_layers=32, d_ff=8192,
                       max_position_embeddings=131072, partial_rotary_factor=0.75, rope_theta=1e4,
                       tie_word_embeddings=True, bos_token_id=199999, eos_token_id=199999),
}
PHI3 = register_decoder("phi3", Phi3Config, Phi3, "Phi3ForCausalLM", weight_map=PHI3_WEIGHT_MAP,
                        config_from_hf=config_from_hf, config_to_hf=config_to_hf, presets=PRESETS)
