"""LLaMA: a decoder-only Transformer with RMSNorm, rotary positions and a SwiGLU MLP
(Touvron et al. 2023, section 2.2; grouped-query attention from LLaMA 2, Ainslie et al. 2023).

    ids -> token embedding
        -> N x [x = x + Attn(RMSNorm(x)); x = x + SwiGLU(RMSNorm(x))]   (Pre-Norm, causal, RoPE on q/k)
        -> final RMSNorm -> lm_head (untied unless tie_word_embeddings) -> logits

No biases; H query heads share G key/value heads (H % G == 0). RoPE rotates q and k by
their absolute positions with base ``rope_theta``; ``rope_scaling`` (transformers'
``rope_parameters`` without the base: ``{"rope_type": "llama3", "factor": 8.0, ...}``) picks one
of :data:`attnlab.nn.rope.ROPE_TYPES` (LLaMA 3.1-3.3: llama3; long-context Qwen: yarn;
Phi-3: longrope), and ``partial_rotary_factor`` the fraction of each head that rotates.

RoPE layout (the wrong one loads without error and gives wrong logits): Hugging Face checkpoints
use the half-split layout (channel i pairs
with i + D/2), which is ours by default, so their q/k weights load as they are. Meta's original
checkpoints use the interleaved layout (channels 2i, 2i+1): set ``rope_interleaved=True`` and
the weight map converts q/k rows with :func:`attnlab.hub.permute_rope` (per head, with the
kv-head count for k) on the way to HF and its inverse on the way back.
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from .convert import PermuteRope, Rule, split_prefix
from ..nn.attention import MultiHeadAttention
from ..nn.block import CausalLayer
from ..nn.mlp import GatedMLP
from ..nn.norm import RMSNorm
from ..nn.position import RotaryEmbedding
from ..nn.rope import normalize_rope_scaling
from .causal_lm import CausalLM
from .registry import register_family
from .rope_config import rope_from_hf, rope_to_hf

__all__ = ["LlamaConfig", "Llama", "llama_weight_map", "LLAMA_WEIGHT_MAP", "LLAMA", "build_config", "sized_fields"]


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    d_model: int = 4096
    num_heads: int = 32
    num_layers: int = 32
    d_ff: int = 11008
    num_kv_heads: int | None = None           # default num_heads (no grouping)
    head_dim: int | None = None               # default d_model // num_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None          # {"rope_type": "linear" | "llama3" | "yarn" | ..., "factor": f, ...}
    partial_rotary_factor: float = 1.0        # the first int(head_dim * this) channels of a head rotate
    rope_interleaved: bool = False            # True for Meta-layout weights (see the module docstring)
    activation: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int | None = None         # keys within this many positions, on "sliding_attention" layers
    layer_types: list[str] | None = None      # per layer "full_attention" | "sliding_attention" (None: all full)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        name = type(self).__name__
        for field in ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{name}: {field} must be positive, got {getattr(self, field)}")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.head_dim is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"{name}: d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads})")
            self.head_dim = self.d_model // self.num_heads
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}: num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim <= 0 or not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 \
                or self.rotary_dim == 0:
            raise ValueError(f"{name}: RoPE needs an even, positive rotary dimension, got head_dim {self.head_dim} "
                             f"with partial_rotary_factor {self.partial_rotary_factor}")
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.rotary_dim, name)
        if self.activation not in GatedMLP.ACTIVATIONS:
            raise ValueError(f"{name}: activation must be one of {GatedMLP.ACTIVATIONS}, got {self.activation!r}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or not set(
                self.layer_types) <= {"full_attention", "sliding_attention"}):
            raise ValueError(f"{name}: layer_types must list 'full_attention' or 'sliding_attention' for each of "
                             f"the {self.num_layers} layers, got {self.layer_types}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"{name}: sliding_window must be positive or None, got {self.sliding_window}")
        if not 0.0 <= self.attention_dropout < 1.0:
            raise ValueError(f"{name}: attention_dropout must be in [0, 1), got {self.attention_dropout}")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence: the trained context, stretched by ``dynamic`` RoPE's factor (the one
        kind whose max_position_embeddings is the context before the stretch)."""
        s = self.rope_scaling
        if s is not None and s["rope_type"] == "dynamic":
            return int(self.max_position_embeddings * float(s["factor"]))
        return self.max_position_embeddings


class Llama(CausalLM):
    """LLaMA language model. ``Llama(LlamaConfig(...))``; forward as :class:`CausalLM`."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        c = config
        # one rotary module shared by every layer (it holds no weights, only the cos/sin cache)
        self.rotary_emb = self.rotary(c.rope_theta, c.rope_scaling)
        self.token_embedding = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList(self.layer(i) for i in range(c.num_layers))
        self.norm = self.make_norm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    # the places where the families built on LLaMA differ, each overridden by a model file
    def layer(self, i: int) -> CausalLayer:
        """Layer ``i``: Pre-Norm with RMSNorm around attention and the feed-forward."""
        c = self.config
        return CausalLayer(c.d_model, c.num_heads, c.d_ff, 0.0, norm_first=True, self_attn=self.attention(i),
                           ff=self.feed_forward(), self_attn_norm=self.make_norm(c.d_model),
                           ff_norm=self.make_norm(c.d_model))

    def make_norm(self, d: int) -> nn.Module:
        return RMSNorm(d, self.config.rms_norm_eps)

    def attention(self, i: int, **options) -> MultiHeadAttention:
        """Layer ``i``'s causal attention; ``options`` (q_norm, scale, softcap, ...) from a subclass."""
        c = self.config
        options.setdefault("position", self.position(i))
        options.setdefault("window", self.window(i))
        return MultiHeadAttention(c.d_model, c.num_heads, c.attention_dropout, num_kv_heads=c.num_kv_heads,
                                  head_dim=c.head_dim, bias=c.attention_bias, causal=True, **options)

    def position(self, i: int) -> nn.Module | None:
        """Layer ``i``'s position module: the shared RoPE (None: a layer without positions)."""
        return self.rotary_emb

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding window: ``sliding_window`` on the layers ``layer_types`` marks sliding."""
        c = self.config
        types = c.layer_types
        sliding = c.sliding_window is not None and (types is None or types[i] == "sliding_attention")
        return c.sliding_window if sliding else None

    def rotary(self, base: float, scaling: dict | None) -> RotaryEmbedding:
        """A rotary module of this model's heads with the given base and scaling."""
        c = self.config
        return RotaryEmbedding(c.head_dim, base=base, interleaved=c.rope_interleaved, scaling=scaling,
                               rotary_dim=c.rotary_dim, max_position_embeddings=c.max_position_embeddings)

    def feed_forward(self) -> nn.Module:
        """The position-wise block of each layer: SwiGLU (Shazeer 2020)."""
        c = self.config
        return GatedMLP(c.d_model, c.d_ff, activation=c.activation, bias=c.mlp_bias)


# ----------------------------------------------------------------------------- Hugging Face
def llama_weight_map(mlp: list[Rule]) -> list[Rule]:
    """LlamaForCausalLM's keys around the given feed-forward rules (Mixtral reuses it)."""
    attn = "model.layers.{i}.self_attn"
    return [
        Rule("token_embedding.weight", "model.embed_tokens.weight"),
        Rule("layers.{i}.self_attn.q_proj.{p}", f"{attn}.q_proj.{{p}}", PermuteRope("num_heads")),
        Rule("layers.{i}.self_attn.k_proj.{p}", f"{attn}.k_proj.{{p}}", PermuteRope("num_kv_heads")),
        Rule("layers.{i}.self_attn.v_proj.{p}", f"{attn}.v_proj.{{p}}"),
        Rule("layers.{i}.self_attn.out_proj.{p}", f"{attn}.o_proj.{{p}}"),
        Rule("layers.{i}.self_attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        Rule("layers.{i}.ff_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        *mlp,
        Rule("norm.weight", "model.norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),     # tied: omitted on save, ignored if a checkpoint has it
    ]


LLAMA_WEIGHT_MAP = llama_weight_map(
    [Rule(f"layers.{{i}}.ff.{p}_proj.{{b}}", f"model.layers.{{i}}.mlp.{p}_proj.{{b}}") for p in ("gate", "up", "down")])

# our config field -> the LlamaConfig / MixtralConfig field of transformers
LLAMA_HF_NAMES = {
    "vocab_size": "vocab_size", "d_model": "hidden_size", "num_heads": "num_attention_heads",
    "num_layers": "num_hidden_layers", "d_ff": "intermediate_size", "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
    "attention_bias": "attention_bias", "mlp_bias": "mlp_bias", "attention_dropout": "attention_dropout",
    "tie_word_embeddings": "tie_word_embeddings", "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id"}
_ACT_FROM_HF = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
_ACT_TO_HF = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def config_from_hf(c: dict, cls: type = LlamaConfig, names: dict = LLAMA_HF_NAMES):
    """transformers 5.x keeps RoPE settings in ``rope_parameters`` ({"rope_type", "rope_theta",
    "factor", ...}); 4.x in ``rope_theta`` and ``rope_scaling`` ({"type" or "rope_type", ...})."""
    act = c.get("hidden_act", "silu")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"{cls.__name__}: hidden_act {act!r} is not supported ({', '.join(_ACT_FROM_HF)})")
    kwargs = {ours: c[hf] for ours, hf in names.items() if c.get(hf) is not None}
    return cls(**kwargs, **rope_from_hf(c, cls.__name__), activation=_ACT_FROM_HF[act])


def config_to_hf(cfg: LlamaConfig, names: dict = LLAMA_HF_NAMES) -> dict:
    try:
        rope = rope_to_hf(cfg.rope_theta, cfg.rope_scaling, cfg.partial_rotary_factor)
    except ValueError as e:
        raise ValueError(f"{type(cfg).__name__}: {e}") from None
    return {**{hf: getattr(cfg, ours) for ours, hf in names.items()}, "rope_parameters": rope,
            "rope_theta": cfg.rope_theta, "hidden_act": _ACT_TO_HF[cfg.activation]}


# ----------------------------------------------------------------------------- registration
def sized_fields(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None, dropout: float, num_kv_heads: int | None, bos_token_id: int | None,
                 eos_token_id: int | list[int] | None) -> dict:
    """The LlamaConfig fields a sizing builder sets (Mixtral's builder shares them)."""
    # SwiGLU has three matrices: 8/3 d (rounded up to 32) keeps the parameters of a 4d two-matrix MLP
    d_ff = d_ff if d_ff is not None else 32 * math.ceil(8 * d_model / 3 / 32)
    return dict(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
                num_layers=num_layers, d_ff=d_ff, max_position_embeddings=context, attention_dropout=dropout,
                bos_token_id=bos_token_id, eos_token_id=eos_token_id)


def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_kv_heads: int | None = None,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> LlamaConfig:
    """A LLaMA sized for training: ``context`` positions; num_kv_heads None: no grouping."""
    return LlamaConfig(**sized_fields(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                                      num_layers=num_layers, d_ff=d_ff, dropout=dropout, num_kv_heads=num_kv_heads,
                                      bos_token_id=bos_token_id, eos_token_id=eos_token_id))


_META = dict(vocab_size=32000, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=64,
                 max_position_embeddings=64),
    "tinyllama-1.1b": dict(_META, d_model=2048, num_heads=32, num_kv_heads=4, num_layers=22, d_ff=5632,
                           max_position_embeddings=2048),
    "llama-2-7b": dict(_META, d_model=4096, num_heads=32, num_layers=32, d_ff=11008, max_position_embeddings=4096),
}

# LLAMA_WEIGHT_MAP names the keys of LlamaForCausalLM: the base's sit under "model."
_BASE_RULES, _HEAD_RULES = split_prefix(LLAMA_WEIGHT_MAP, "model.")
LLAMA = register_family("llama", LlamaConfig, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                        limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len},
                        config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                        ignore_on_load=(r"\.rotary_emb\.inv_freq$",),
                        token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
LLAMA.register("LlamaForCausalLM", Llama, kind="causal-lm", prefix="model.", head_rules=_HEAD_RULES)


def register_decoder(model_type: str, config_cls: type, model_cls: type, architecture: str, *,
                     weight_map: list[Rule], config_from_hf, config_to_hf, presets: dict, build_config=None):
    """Register a family built on LLaMA's skeleton (its keys under "model.", RoPE buffers ignored,
    its context ``max_seq_len``; ``build_config`` None: LLaMA's sizing builder with its own config
    class); returns the family."""
    def build(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
              d_ff: int | None = None, dropout: float = 0.0, num_kv_heads: int | None = None,
              bos_token_id: int | None = None, eos_token_id: int | None = None):
        return config_cls(**sized_fields(vocab_size=vocab_size, context=context, d_model=d_model,
                                         num_heads=num_heads, num_layers=num_layers, d_ff=d_ff, dropout=dropout,
                                         num_kv_heads=num_kv_heads, bos_token_id=bos_token_id,
                                         eos_token_id=eos_token_id))
    build.__doc__ = f"A {model_type} sized for training: ``context`` positions; num_kv_heads None: no grouping."
    base, head = split_prefix(weight_map, "model.")
    fam = register_family(model_type, config_cls, base_rules=base, config_from_hf=config_from_hf,
                          limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len},
                          config_to_hf=config_to_hf, presets=presets, build_config=build_config or build,
                          ignore_on_load=(r"\.rotary_emb\.inv_freq$",),
                          token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
    fam.register(architecture, model_cls, kind="causal-lm", prefix="model.", head_rules=head)
    return fam


def hf_names(drop: tuple[str, ...] = (), **add: str) -> dict:
    """LLaMA's config-name map without the ``drop`` fields, with ``add`` (ours=theirs) added."""
    return {**{k: v for k, v in LLAMA_HF_NAMES.items() if k not in drop}, **add}
