"""Mixtral: LLaMA with a sparse mixture of SwiGLU experts in place of the MLP
(Jiang et al. 2024, "Mixtral of Experts", section 2.1).

    each layer: x = x + Attn(RMSNorm(x));  x = x + sum_{e in top-k} g_e(x) * Expert_e(RMSNorm(x))

The router ``gate`` scores X experts per token; the k best (renormalised softmax weights g)
run, so a token costs k expert passes, not X. Everything else is :mod:`attnlab.models.llama`.
``forward`` returns logits only, like every causal LM; each layer's router keeps the routing
of the last forward, and :meth:`Mixtral.aux_loss` turns it into the load-balancing loss
(the fraction of tokens per expert divided by k, the router probabilities averaged over all
experts, padding left out), :meth:`Mixtral.aux_stats` into each expert's share of the routing.

Weights: Hugging Face writes Mixtral checkpoints with one tensor per expert
(``block_sparse_moe.experts.{e}.w1/w3/w2`` = gate/up/down), while transformers 5.x keeps
them fused in memory (``mlp.experts.gate_up_proj`` (X, 2F, E), ``mlp.experts.down_proj``
(X, E, F)). Both load; we save the per-expert form, which every transformers version reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from .convert import Fuse, Rule, split_prefix
from ..nn.cache import LayerCaches
from ..nn.mlp import SparseMoE, expert_counts, load_balancing_loss
from . import llama
from .llama import Llama, LlamaConfig, llama_weight_map
from .registry import FamilyOption, register_family

__all__ = ["MixtralConfig", "Mixtral", "MIXTRAL_WEIGHT_MAP", "MIXTRAL_FUSED_RULES", "MIXTRAL", "build_config"]


@dataclass
class MixtralConfig(LlamaConfig):
    d_ff: int = 14336
    num_kv_heads: int | None = 8
    max_position_embeddings: int = 4096 * 32
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    num_experts: int = 8                      # X
    top_k: int = 2                            # k experts per token
    router_jitter: float = 0.0
    router_aux_loss_coef: float = 0.02        # weight of aux_loss in the training loss
    sliding_window: int | None = None         # not implemented: sequences must fit in it

    def __post_init__(self):
        super().__post_init__()
        if self.attention_bias or self.mlp_bias:
            raise ValueError("MixtralConfig: Mixtral has no biases (attention_bias and mlp_bias must be False)")
        if self.num_experts <= 0 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MixtralConfig: need num_experts > 0 and 1 <= top_k <= num_experts, got "
                             f"{self.num_experts}, {self.top_k}")


class Mixtral(Llama):
    """Mixtral language model. ``Mixtral(MixtralConfig(...))``; forward as :class:`CausalLM`."""

    def feed_forward(self) -> nn.Module:
        c = self.config
        return SparseMoE(c.d_model, c.d_ff, c.num_experts, c.top_k, activation=c.activation,
                         router_jitter=c.router_jitter)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                cache: LayerCaches | None = None) -> Tensor:
        window = self.config.sliding_window
        total = input_ids.size(-1) + (0 if cache is None else cache.length)
        if window is not None and total > window:
            raise ValueError(f"Mixtral: {total} tokens exceed the sliding window of {window}; sliding-window "
                             f"attention is not implemented")
        return super().forward(input_ids, attention_mask, positions, cache)

    def routing(self) -> tuple[list[Tensor], Tensor | None]:
        """The last forward's router logits, one (B*T, X) tensor per layer, and the (B*T,) mask of
        real tokens (None: no padding)."""
        moe = [layer.ff for layer in self.layers]
        if any(m.router_logits is None for m in moe):
            raise RuntimeError("Mixtral: no routing recorded yet; run a forward pass first")
        return [m.router_logits for m in moe], moe[0].router_mask

    @property
    def aux_loss_coef(self) -> float:
        return self.config.router_aux_loss_coef

    def aux_loss(self) -> Tensor:
        """Load-balancing loss of the last forward over all layers, padding excluded (see
        :func:`~attnlab.nn.load_balancing_loss`); the training loss adds ``aux_loss_coef`` times it."""
        logits, mask = self.routing()
        return load_balancing_loss(logits, self.config.num_experts, self.config.top_k, mask)

    def aux_stats(self) -> dict[str, Tensor]:
        """``expert_{e}``: the share of the last forward's top-k assignments that went to expert e,
        over all layers and real tokens (1/X each when balanced; the shares sum to 1)."""
        logits, mask = self.routing()
        counts = expert_counts([r.detach() for r in logits], self.config.top_k, mask).double()
        shares = counts / counts.sum().clamp(min=1.0)
        return {f"expert_{e}": shares[e] for e in range(self.config.num_experts)}


# ----------------------------------------------------------------------------- Hugging Face
_MOE, _FUSED = "model.layers.{i}.block_sparse_moe", "model.layers.{i}.mlp"
# on disk (what transformers writes and the Hub holds): one tensor per expert
MIXTRAL_EXPERT_RULES = [
    Rule("layers.{i}.ff.gate.weight", f"{_MOE}.gate.weight"),
    Rule("layers.{i}.ff.experts.{e}.gate_proj.weight", f"{_MOE}.experts.{{e}}.w1.weight"),
    Rule("layers.{i}.ff.experts.{e}.up_proj.weight", f"{_MOE}.experts.{{e}}.w3.weight"),
    Rule("layers.{i}.ff.experts.{e}.down_proj.weight", f"{_MOE}.experts.{{e}}.w2.weight"),
]
# transformers 5.x modules (MixtralExperts): experts stacked along dim 0, gate and up fused on dim 1
MIXTRAL_FUSED_RULES = [
    Rule("layers.{i}.ff.gate.weight", f"{_FUSED}.gate.weight"),
    Rule(("layers.{i}.ff.experts.{e}.gate_proj.weight", "layers.{i}.ff.experts.{e}.up_proj.weight"),
         f"{_FUSED}.experts.gate_up_proj", Fuse(dim=1, parts=2)),
    Rule("layers.{i}.ff.experts.{e}.down_proj.weight", f"{_FUSED}.experts.down_proj"),
]
# the per-expert rules come first, so saving writes them; the fused ones are accepted on load
MIXTRAL_WEIGHT_MAP = llama_weight_map(MIXTRAL_EXPERT_RULES + MIXTRAL_FUSED_RULES)
MIXTRAL_FUSED_WEIGHT_MAP = llama_weight_map(MIXTRAL_FUSED_RULES)

MIXTRAL_HF_NAMES = {**llama.LLAMA_HF_NAMES, "num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
                    "router_jitter": "router_jitter_noise", "router_aux_loss_coef": "router_aux_loss_coef",
                    "sliding_window": "sliding_window"}


def config_from_hf(c: dict) -> MixtralConfig:
    return llama.config_from_hf(c, MixtralConfig, MIXTRAL_HF_NAMES)


def config_to_hf(cfg: MixtralConfig) -> dict:
    return llama.config_to_hf(cfg, MIXTRAL_HF_NAMES)


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, num_kv_heads: int | None = None,
                 num_experts: int = 8, top_k: int = 2, router_aux_loss_coef: float = 0.02,
                 bos_token_id: int | None = None, eos_token_id: int | None = None) -> MixtralConfig:
    """A Mixtral sized for training: LLaMA's sizes (d_ff per expert) plus the experts."""
    fields = llama.sized_fields(vocab_size=vocab_size, context=context, d_model=d_model, num_heads=num_heads,
                                num_layers=num_layers, d_ff=d_ff, dropout=dropout, num_kv_heads=num_kv_heads,
                                bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return MixtralConfig(**fields, num_experts=num_experts, top_k=top_k, router_aux_loss_coef=router_aux_loss_coef)


PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
                 max_position_embeddings=64, num_experts=4, top_k=2),
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, num_heads=32, num_kv_heads=8, num_layers=32, d_ff=14336,
                         max_position_embeddings=32768, bos_token_id=1, eos_token_id=2),
}

# MIXTRAL_WEIGHT_MAP names the keys of MixtralForCausalLM: the base's sit under "model."
_BASE_RULES, _HEAD_RULES = split_prefix(MIXTRAL_WEIGHT_MAP, "model.")
# the options Mixtral adds to `attnlab train lm`; 4 experts by default fit a CPU (Mixtral's own 8 with --experts 8)
_OPTIONS = (
    FamilyOption("experts", int, "experts per layer", ("lm",), keyword="num_experts", default=4,
                 check=lambda v: None if v > 0 else "must be positive"),
    FamilyOption("top_k", int, "experts per token", ("lm",), check=lambda v: None if v > 0 else "must be positive"),
    FamilyOption("aux_coef", float, "weight of the load-balancing loss", ("lm",), keyword="router_aux_loss_coef",
                 check=lambda v: None if v >= 0 else "must be >= 0"),
)
MIXTRAL = register_family("mixtral", MixtralConfig, base_rules=_BASE_RULES, config_from_hf=config_from_hf,
                          limits=lambda c: {"vocab_size": c.vocab_size, "context": c.max_seq_len},
                          config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                          ignore_on_load=(r"\.rotary_emb\.inv_freq$",), options=_OPTIONS,
                          token_ids={"bos_token_id": "bos", "eos_token_id": "eos"})
MIXTRAL.register("MixtralForCausalLM", Mixtral, kind="causal-lm", prefix="model.", head_rules=_HEAD_RULES)
