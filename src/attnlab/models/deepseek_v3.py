"""DeepSeek-V3: LLaMA's Pre-Norm decoder with multi-head latent attention and a mixture of routed
plus shared experts (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", sections 2.1.1-2.1.2).

    each layer: x = x + MLA(RMSNorm(x))
                x = x + FF(RMSNorm(x)),  FF = SwiGLU         in the first ``first_k_dense_replace`` layers
                                         FF = Shared(x) + sum_{e in TopK} g_e(x) Expert_e(x)   after them

Attention (:class:`~attnlab.nn.MultiHeadLatentAttention`): keys and values come from a latent of
``kv_lora_rank`` numbers per token plus one rotary key of ``qk_rope_head_dim``, and the decoding
cache holds only those; decoding steps absorb the up-projections (``kv_b_proj``) into the query and
the output. RoPE runs on the rope part alone, in interleaved pairs (``rope_interleaved``, as
transformers' ``rope_interleave``; the weights are used as stored, no permutation).

Routing (:class:`~attnlab.nn.SigmoidTopK`): sigmoid scores, experts chosen on score +
``e_score_correction_bias`` (the bias-based load balancing that replaces an auxiliary loss) among
the ``topk_group`` best of ``n_group`` expert groups, weights normalised (``norm_topk_prob``) and
scaled by ``routed_scaling_factor``. The router and its bias run in fp32 in transformers; here they
follow the model's dtype (identical in fp32).

Weights: checkpoints hold one tensor per expert (``mlp.experts.{e}.gate_proj.weight``), which
transformers 5.x fuses in memory (``mlp.experts.gate_up_proj`` (X, 2F, E)); both load, we save the
per-expert form that transformers writes. Multi-token-prediction layers are not built.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .convert import Fuse, Rule
from ..nn.block import CausalLayer
from ..nn.latent_attention import MultiHeadLatentAttention
from ..nn.mlp import GatedMLP, SigmoidTopK, SparseMoE
from ..nn.norm import RMSNorm
from ..nn.position import RotaryEmbedding
from ..nn.rope import yarn_mscale
from . import llama
from .causal_lm import CausalLM
from .llama import LlamaConfig, register_decoder

__all__ = ["DeepseekV3Config", "DeepseekV3", "DEEPSEEK_V3_WEIGHT_MAP", "DEEPSEEK_V3", "build_config"]


@dataclass
class DeepseekV3Config(LlamaConfig):
    d_ff: int = 18432                         # the dense layers' SwiGLU width
    num_kv_heads: int | None = None           # MLA has no grouping: must equal num_heads
    rope_interleaved: bool = True             # RoPE on interleaved pairs of the rope channels
    q_lora_rank: int | None = None            # None: one q_proj; else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: int = 512                   # C: the cached latent
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    moe_d_ff: int = 2048                      # each routed expert's width
    num_experts: int = 256                    # X routed experts
    top_k: int = 8
    n_shared_experts: int = 1                 # one shared SwiGLU of n_shared_experts * moe_d_ff
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3

    def __post_init__(self):
        self.head_dim = self.qk_rope_head_dim         # what RoPE rotates (and what transformers calls head_dim)
        super().__post_init__()
        name = type(self).__name__
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"{name}: latent attention has no key/value grouping: num_kv_heads "
                             f"({self.num_kv_heads}) must equal num_heads ({self.num_heads})")
        if self.mlp_bias:
            raise ValueError(f"{name}: DeepSeek-V3's feed-forward blocks have no bias (mlp_bias must be False)")
        for field in ("kv_lora_rank", "v_head_dim", "moe_d_ff", "num_experts", "n_shared_experts"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{name}: {field} must be positive, got {getattr(self, field)}")
        if self.qk_nope_head_dim < 0 or self.first_k_dense_replace < 0:
            raise ValueError(f"{name}: qk_nope_head_dim and first_k_dense_replace must be >= 0, got "
                             f"{self.qk_nope_head_dim}, {self.first_k_dense_replace}")
        try:                                     # the routing rule checks its own settings
            SigmoidTopK(self.num_experts, self.top_k, n_group=self.n_group, topk_group=self.topk_group)
        except ValueError as err:
            raise ValueError(f"{name}: {str(err).removeprefix('SigmoidTopK: ')}") from None


def softmax_scale(c: DeepseekV3Config) -> float:
    """(Dn + Dr)^-1/2, times m^2 when the RoPE scaling names ``mscale_all_dim`` (DeepSeek's YaRN):
    m = 0.1 mscale_all_dim ln(factor) + 1 scales every score, the nope channels too, where YaRN's own
    attention factor (on cos and sin) reaches only the rotary ones."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    s = c.rope_scaling or {}
    if s.get("mscale_all_dim"):
        m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


class DeepseekV3(CausalLM):
    """DeepSeek-V3 language model. ``DeepseekV3(DeepseekV3Config(...))``; forward as :class:`CausalLM`."""

    def __init__(self, config: DeepseekV3Config):
        super().__init__(config)
        c, E = config, config.d_model
        # one rotary module shared by every layer, over the rope channels only
        rope = RotaryEmbedding(c.qk_rope_head_dim, base=c.rope_theta, interleaved=c.rope_interleaved,
                               scaling=c.rope_scaling, max_position_embeddings=c.max_position_embeddings)
        self.token_embedding = nn.Embedding(c.vocab_size, E)
        self.layers = nn.ModuleList(
            CausalLayer(E, c.num_heads, c.d_ff, 0.0, norm_first=True, norm="rmsnorm", eps=c.rms_norm_eps,
                        self_attn=self.latent_attention(rope), ff=self.feed_forward(i))
            for i in range(c.num_layers))
        self.norm = RMSNorm(E, c.rms_norm_eps)
        self.lm_head = nn.Linear(E, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding.weight

    def latent_attention(self, rope: nn.Module) -> MultiHeadLatentAttention:
        c = self.config
        # the two latent norms keep RMSNorm's 1e-6 whatever rms_norm_eps says, as transformers' do
        return MultiHeadLatentAttention(c.d_model, c.num_heads, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
                                        qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                        v_head_dim=c.v_head_dim, position=rope, scale=softmax_scale(c),
                                        bias=c.attention_bias, dropout=c.attention_dropout)

    def feed_forward(self, i: int) -> nn.Module:
        """Layer i's block: a dense SwiGLU in the first ``first_k_dense_replace`` layers, the
        routed + shared experts after them."""
        c = self.config
        if i < c.first_k_dense_replace:
            return GatedMLP(c.d_model, c.d_ff, activation=c.activation)
        routing = SigmoidTopK(c.num_experts, c.top_k, n_group=c.n_group, topk_group=c.topk_group,
                              normalize=c.norm_topk_prob, scale=c.routed_scaling_factor, correction_bias=True)
        shared = GatedMLP(c.d_model, c.n_shared_experts * c.moe_d_ff, activation=c.activation)
        return SparseMoE(c.d_model, c.moe_d_ff, c.num_experts, c.top_k, activation=c.activation, routing=routing,
                         shared_expert=shared)


# ----------------------------------------------------------------------------- Hugging Face
_ATTN, _MLP = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
_SELF = [Rule(f"layers.{{i}}.self_attn.{p}.{{b}}", f"{_ATTN}.{p}.{{b}}")
         for p in ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                   "kv_b_proj")]
_DENSE = [Rule(f"layers.{{i}}.ff.{p}_proj.weight", f"{_MLP}.{p}_proj.weight") for p in ("gate", "up", "down")]
_ROUTER = [Rule("layers.{i}.ff.gate.weight", f"{_MLP}.gate.weight"),
           Rule("layers.{i}.ff.routing.e_score_correction_bias", f"{_MLP}.gate.e_score_correction_bias")]
_SHARED = [Rule(f"layers.{{i}}.ff.shared_expert.{p}_proj.weight", f"{_MLP}.shared_experts.{p}_proj.weight")
           for p in ("gate", "up", "down")]
# on disk: one tensor per expert; in transformers 5.x's memory: stacked, gate and up fused on dim 1
_EXPERTS = [Rule(f"layers.{{i}}.ff.experts.{{e}}.{p}_proj.weight", f"{_MLP}.experts.{{e}}.{p}_proj.weight")
            for p in ("gate", "up", "down")]
_FUSED = [Rule(("layers.{i}.ff.experts.{e}.gate_proj.weight", "layers.{i}.ff.experts.{e}.up_proj.weight"),
               f"{_MLP}.experts.gate_up_proj", Fuse(dim=1, parts=2)),
          Rule("layers.{i}.ff.experts.{e}.down_proj.weight", f"{_MLP}.experts.down_proj")]


def deepseek_weight_map(experts: list[Rule]) -> list[Rule]:
    return [
        Rule("token_embedding.weight", "model.embed_tokens.weight"),
        *_SELF,
        Rule("layers.{i}.self_attn.out_proj.{b}", f"{_ATTN}.o_proj.{{b}}"),
        Rule("layers.{i}.self_attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        Rule("layers.{i}.ff_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
        *_DENSE, *_ROUTER, *_SHARED, *experts,
        Rule("norm.weight", "model.norm.weight"),
        Rule("lm_head.weight", "lm_head.weight"),
    ]


# the per-expert rules come first, so saving writes them; the fused ones are accepted on load
DEEPSEEK_V3_WEIGHT_MAP = deepseek_weight_map(_EXPERTS + _FUSED)
DEEPSEEK_V3_FUSED_WEIGHT_MAP = deepseek_weight_map(_FUSED)

_HF_NAMES = {**{k: v for k, v in llama.LLAMA_HF_NAMES.items() if k != "head_dim"},
             "rope_interleaved": "rope_interleave", "kv_lora_rank": "kv_lora_rank",
             "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
             "v_head_dim": "v_head_dim", "moe_d_ff": "moe_intermediate_size", "num_experts": "n_routed_experts",
             "top_k": "num_experts_per_tok", "n_shared_experts": "n_shared_experts", "n_group": "n_group",
             "topk_group": "topk_group", "norm_topk_prob": "norm_topk_prob",
             "routed_scaling_factor": "routed_scaling_factor", "first_k_dense_replace": "first_k_dense_replace"}


def config_from_hf(c: dict) -> DeepseekV3Config:
    cfg = llama.config_from_hf(c, DeepseekV3Config, _HF_NAMES)
    # None is a value here (a plain q_proj), so it is read apart from the names that skip None
    return replace(cfg, q_lora_rank=c.get("q_lora_rank", 1536))


def config_to_hf(cfg: DeepseekV3Config) -> dict:
    return {**llama.config_to_hf(cfg, _HF_NAMES), "q_lora_rank": cfg.q_lora_rank, "head_dim": cfg.qk_rope_head_dim}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> DeepseekV3Config:
    """A DeepSeek-V3 sized for training: head width d = d_model / num_heads for the nope and value
    parts, d/2 (even) rotary channels, a latent of d_model/2, the first layer dense and 4 routed
    experts (2 per token, one group) of half the dense width beside one shared one."""
    fields = llama.sized_fields(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                                num_layers=num_layers, d_ff=d_ff, dropout=dropout, num_kv_heads=None,
                                bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    d = max(2, d_model // num_heads)
    return DeepseekV3Config(**fields, kv_lora_rank=max(1, d_model // 2), qk_nope_head_dim=d,
                            qk_rope_head_dim=max(2, d // 2 - d // 2 % 2), v_head_dim=d,
                            moe_d_ff=max(1, fields["d_ff"] // 2), num_experts=4, top_k=2, n_group=1, topk_group=1,
                            first_k_dense_replace=min(1, num_layers), routed_scaling_factor=1.0)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_layers=3, d_ff=64, max_position_embeddings=64,
                 q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, moe_d_ff=16,
                 num_experts=8, top_k=2, n_group=4, topk_group=2, first_k_dense_replace=1),
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, num_heads=128, num_layers=61, d_ff=18432,
                        max_position_embeddings=163840, q_lora_rank=1536, bos_token_id=0, eos_token_id=1),
}

DEEPSEEK_V3 = register_decoder("deepseek_v3", DeepseekV3Config, DeepseekV3, "DeepseekV3ForCausalLM",
                               weight_map=DEEPSEEK_V3_WEIGHT_MAP, config_from_hf=config_from_hf,
                               config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config)
