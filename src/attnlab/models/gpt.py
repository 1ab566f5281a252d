"""GPT-2: a decoder-only Transformer with learned positions (Radford et al. 2019, section 2.3).

    ids -> token embedding + learned position embedding -> dropout
        -> N x [x = x + Attn(LayerNorm(x)); x = x + MLP(LayerNorm(x))]      (Pre-Norm, causal)
        -> final LayerNorm (ln_f) -> lm_head (tied to the token embedding) -> logits

Attention projects Q, K, V with one fused matrix (``qkv_proj``, HF's ``c_attn``); the MLP is
E -> 4E -> E with GELU's tanh approximation. Every matrix starts at N(0, 0.02) and the two
projections that write into the residual stream (attention ``out_proj``, MLP ``linear2``) at
N(0, 0.02 / sqrt(2 N)), GPT-2's scaled residual initialisation (PyTorch's default N(0, 1)
embedding, tied to the head, gives huge logits and a CPU backward slowed by denormal floats).
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .convert import TRANSPOSE, Rule, split_prefix
from ..nn.attention import MultiHeadAttention
from ..nn.block import CausalLayer
from ..nn.mlp import FeedForward
from ..nn.norm import LayerNorm
from ..nn.position import LearnedPositionalEmbedding
from .causal_lm import CausalLM, Headless
from .registry import register_family

__all__ = ["GPTConfig", "GPT", "GPTModel", "GPT2_WEIGHT_MAP", "GPT2", "build_config"]


@dataclass
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024           # context length: the learned position table's rows
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    d_ff: int | None = None           # default 4 * d_model
    dropout: float = 0.1              # embeddings, attention weights, residual branches
    layer_norm_eps: float = 1e-5
    activation: str = "gelu_tanh"
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        for name in ("vocab_size", "n_positions", "d_model", "num_heads", "num_layers", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"GPTConfig: d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout}")
        if self.activation not in FeedForward.ACTIVATIONS:
            raise ValueError(f"GPTConfig: activation must be one of {FeedForward.ACTIVATIONS}, got {self.activation!r}")

    @property
    def max_seq_len(self) -> int:
        return self.n_positions


class GPT(CausalLM):
    """GPT-2 language model. ``GPT(GPTConfig(...))``; forward as :class:`CausalLM`."""

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        E, H, c = config.d_model, config.num_heads, config
        self.token_embedding = nn.Embedding(c.vocab_size, E)
        self.position_embedding = LearnedPositionalEmbedding(c.n_positions, E, c.dropout)
        self.layers = nn.ModuleList(
            CausalLayer(E, H, c.d_ff, c.dropout, norm_first=True, norm="layernorm", eps=c.layer_norm_eps,
                        self_attn=MultiHeadAttention(E, H, c.dropout, fused_qkv=True, causal=True),
                        ff=FeedForward(E, c.d_ff, 0.0, activation=c.activation))
            for _ in range(c.num_layers))
        self.norm = LayerNorm(E, c.layer_norm_eps)
        self.lm_head = nn.Linear(E, c.vocab_size, bias=False)
        self.reset_parameters()
        self.lm_head.weight = self.token_embedding.weight          # tied: one tensor, stored once

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.position_embedding(self.token_embedding(input_ids), positions=positions)

    def residual_projections(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in (layer.self_attn.out_proj.weight, layer.ff.linear2.weight)]


# ----------------------------------------------------------------------------- Hugging Face
def _conv1d(ours: str, theirs: str) -> list[Rule]:
    """HF GPT-2's Conv1D keeps its weight as (in, out), nn.Linear as (out, in)."""
    return [Rule(f"{ours}.weight", f"{theirs}.weight", TRANSPOSE), Rule(f"{ours}.bias", f"{theirs}.bias")]


GPT2_WEIGHT_MAP = [
    Rule("token_embedding.weight", "transformer.wte.weight"),
    Rule("position_embedding.weight", "transformer.wpe.weight"),
    Rule("layers.{i}.self_attn_norm.{p}", "transformer.h.{i}.ln_1.{p}"),
    *_conv1d("layers.{i}.self_attn.qkv_proj", "transformer.h.{i}.attn.c_attn"),
    *_conv1d("layers.{i}.self_attn.out_proj", "transformer.h.{i}.attn.c_proj"),
    Rule("layers.{i}.ff_norm.{p}", "transformer.h.{i}.ln_2.{p}"),
    *_conv1d("layers.{i}.ff.linear1", "transformer.h.{i}.mlp.c_fc"),
    *_conv1d("layers.{i}.ff.linear2", "transformer.h.{i}.mlp.c_proj"),
    Rule("norm.{p}", "transformer.ln_f.{p}"),
    Rule("lm_head.weight", "lm_head.weight"),     # tied: omitted on save, ignored if a checkpoint has it
]

_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}


def config_from_hf(c: dict) -> GPTConfig:
    if c.get("add_cross_attention") or not c.get("scale_attn_weights", True) or \
            c.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("GPT-2 config: cross-attention and non-standard attention scaling "
                         "(scale_attn_weights=False, scale_attn_by_inverse_layer_idx) are not supported")
    if c.get("tie_word_embeddings") is False:
        raise ValueError("GPT-2 config: an lm_head untied from the token embedding is not supported")
    act = c.get("activation_function", "gelu_new")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"GPT-2 config: activation_function {act!r} is not supported ({', '.join(_ACT_FROM_HF)})")
    d_model = c.get("n_embd", 768)
    return GPTConfig(vocab_size=c.get("vocab_size", 50257), n_positions=c.get("n_positions", 1024), d_model=d_model,
                     num_heads=c.get("n_head", 12), num_layers=c.get("n_layer", 12),
                     d_ff=c.get("n_inner") or 4 * d_model, dropout=c.get("resid_pdrop", 0.1),
                     layer_norm_eps=c.get("layer_norm_epsilon", 1e-5), activation=_ACT_FROM_HF[act],
                     bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"))


def config_to_hf(cfg: GPTConfig) -> dict:
    return {"vocab_size": cfg.vocab_size, "n_positions": cfg.n_positions, "n_embd": cfg.d_model,
            "n_head": cfg.num_heads, "n_layer": cfg.num_layers, "n_inner": cfg.d_ff,
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.layer_norm_eps, "activation_function": _ACT_TO_HF[cfg.activation],
            "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "tie_word_embeddings": True}


# ----------------------------------------------------------------------------- registration
class GPTModel(Headless, GPT):
    """GPT-2 without its language-model head (transformers' GPT2Model): forward returns the last
    hidden state (B, T, E), after the final LayerNorm, as GPT2Model's ``last_hidden_state`` does."""

    with_head = "GPT2LMHeadModel"


def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> GPTConfig:
    """A GPT-2 sized for training: ``context`` positions, d_ff 4 d_model unless given."""
    return GPTConfig(vocab_size=vocab_size, n_positions=context, d_model=d_model, num_heads=num_heads,
                     num_layers=num_layers, d_ff=d_ff, dropout=dropout, bos_token_id=bos_token_id,
                     eos_token_id=eos_token_id)


_OPENAI = dict(vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256)
PRESETS = {
    "tiny": dict(vocab_size=96, n_positions=64, d_model=32, num_heads=4, num_layers=2, dropout=0.0),
    "gpt2": dict(_OPENAI, d_model=768, num_heads=12, num_layers=12),             # 124M parameters
    "gpt2-medium": dict(_OPENAI, d_model=1024, num_heads=16, num_layers=24),     # 355M
    "gpt2-large": dict(_OPENAI, d_model=1280, num_heads=20, num_layers=36),      # 774M
    "gpt2-xl": dict(_OPENAI, d_model=1600, num_heads=25, num_layers=48),         # 1.5B
}

# GPT2_WEIGHT_MAP names the keys of GPT2LMHeadModel: the base's sit under "transformer."
_BASE_RULES, _HEAD_RULES = split_prefix(GPT2_WEIGHT_MAP, "transformer.")
GPT2 = register_family("gpt2", GPTConfig, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                       limits=lambda c: {"vocab_size": c.vocab_size, "context": c.n_positions},
                       config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                       ignore_on_load=(r"\.attn\.bias$", r"\.attn\.masked_bias$"),   # causal-mask buffers
                       token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
GPT2.register("GPT2LMHeadModel", GPT, kind="causal-lm", prefix="transformer.", head_rules=_HEAD_RULES,
              default=True)
GPT2.register("GPT2Model", GPTModel, kind="base")
