"""T5: the text-to-text encoder-decoder with a bucketed relative position bias (Raffel et al.
2020, "Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer",
section 2.1), and T5 v1.1's gated-GELU feed-forward.

    src ids -> shared embedding -> dropout
            -> N x [x = x + Attn(RMSNorm(x) + encoder bias); x = x + FF(RMSNorm(x))]  -> RMSNorm -> memory
    tgt ids -> shared embedding -> dropout
            -> M x [x = x + CausalAttn(RMSNorm(x) + decoder bias); x = x + CrossAttn(RMSNorm(x), memory);
                    x = x + FF(RMSNorm(x))]
            -> RMSNorm -> (* d_model^-1/2 if the head is tied) -> lm_head -> logits

Pre-Norm with T5's LayerNorm, which is RMSNorm (no mean subtraction, no bias); no biases
anywhere; attention scores are q k^T without the 1/sqrt(D) factor (T5's initialisation puts it
in the query weights). Positions enter only as a learned scalar per head and relative-position
bucket (:class:`~attnlab.nn.position.T5RelativePositionBias`), computed once per stack (in
Hugging Face's checkpoints it belongs to the first layer) and added to the self-attention scores of
every layer: bidirectional buckets in the encoder, causal ones in the decoder, whose query
positions start at the cache length while decoding. Cross-attention has no position bias.

One vocabulary, one ``shared`` embedding for the encoder and the decoder. Original T5 ties the
output head to it and scales the decoder output by d_model^-1/2 first; v1.1
(``feed_forward_proj="gated-gelu"``, ``tie_word_embeddings=False``) has its own ``lm_head`` and
no scaling. Heads of ``d_kv`` channels (need not be d_model / num_heads).
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import DecoderLayer, EncoderLayer
from ..nn.cache import LayerCaches
from ..nn.checkpoint import checkpoint
from ..nn.mlp import FeedForward, GatedMLP
from ..nn.norm import RMSNorm
from ..nn.position import T5RelativePositionBias
from .convert import Rule
from .keywords import seq2seq_arguments
from .pretrained import SavePretrained
from .registry import register_family

__all__ = ["T5Config", "T5ForConditionalGeneration", "T5EncoderModel", "T5_WEIGHT_MAP", "T5", "build_config"]

FEED_FORWARD = ("relu", "gated-gelu")


@dataclass
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    num_heads: int = 8
    num_layers: int = 6                       # encoder layers
    num_decoder_layers: int | None = None     # default num_layers
    d_ff: int = 2048
    d_kv: int | None = None                   # head dim; default d_model // num_heads
    dropout: float = 0.1
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"           # "relu" (T5) or "gated-gelu" (T5 v1.1)
    tie_word_embeddings: bool = True          # T5: tied and scaled; v1.1: own lm_head, unscaled
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0           # T5 starts decoding with the pad id

    def __post_init__(self):
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.d_kv is None:
            if self.d_model % self.num_heads:
                raise ValueError(f"T5Config: d_model ({self.d_model}) is not divisible by num_heads "
                                 f"({self.num_heads}); give d_kv")
            self.d_kv = self.d_model // self.num_heads
        for name in ("vocab_size", "d_model", "num_heads", "num_layers", "num_decoder_layers", "d_ff", "d_kv",
                     "relative_attention_num_buckets", "relative_attention_max_distance"):
            if getattr(self, name) <= 0:
                raise ValueError(f"T5Config: {name} must be positive, got {getattr(self, name)}")
        if self.feed_forward_proj not in FEED_FORWARD:
            raise ValueError(f"T5Config: feed_forward_proj must be one of {FEED_FORWARD}, "
                             f"got {self.feed_forward_proj!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"T5Config: dropout must be in [0, 1), got {self.dropout}")

    # the seq2seq contract's names: one vocabulary serves both sides
    @property
    def src_vocab_size(self) -> int:
        return self.vocab_size

    @property
    def tgt_vocab_size(self) -> int:
        return self.vocab_size


def _feed_forward(c: T5Config) -> nn.Module:
    if c.feed_forward_proj == "gated-gelu":
        return GatedMLP(c.d_model, c.d_ff, activation="gelu_tanh", dropout=c.dropout)
    return FeedForward(c.d_model, c.d_ff, c.dropout, activation="relu", bias=False)


def _attention(c: T5Config, causal: bool = False) -> MultiHeadAttention:
    return MultiHeadAttention(c.d_model, c.num_heads, c.dropout, head_dim=c.d_kv, bias=False, causal=causal,
                              scale=1.0)


class _T5Encoder(SavePretrained, nn.Module):
    """The shared embedding and the encoder stack, which both architectures have."""

    def __init__(self, config: T5Config):
        super().__init__()
        c = self.config = config
        self.gradient_checkpointing = False
        self.shared = nn.Embedding(c.vocab_size, c.d_model)
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_bias = T5RelativePositionBias(c.num_heads, c.relative_attention_num_buckets,
                                                   c.relative_attention_max_distance, bidirectional=True)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, norm_first=True, norm="rmsnorm",
                         eps=c.layer_norm_epsilon, self_attn=_attention(c), ff=_feed_forward(c))
            for _ in range(c.num_layers))
        self.encoder_norm = RMSNorm(c.d_model, c.layer_norm_epsilon)

    def reset_parameters(self) -> None:
        """T5's initialisation (Mesh TensorFlow's, as transformers has it): N(0, 1) embedding, every
        matrix N(0, fan_in^-1/2) except the query, N(0, (d_model d_kv)^-1/2), which carries the
        1/sqrt(D) that attention leaves out; the bias tables N(0, d_model^-1/2); norms at 1."""
        c = self.config
        for name, p in self.named_parameters():
            if name.endswith("q_proj.weight"):
                nn.init.normal_(p, 0.0, (c.d_model * c.d_kv) ** -0.5)
            elif name.endswith("relative_attention_bias.weight"):
                nn.init.normal_(p, 0.0, c.d_model ** -0.5)
            elif name == "shared.weight":
                nn.init.normal_(p, 0.0, 1.0)
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, p.size(1) ** -0.5)

    def _run(self, layer: nn.Module, *args, **kwargs) -> Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and not kwargs.get("cache"):
            return checkpoint(layer, *args, **kwargs)
        return layer(*args, **kwargs)

    def _check(self, ids: Tensor, mask: Tensor | None, name: str) -> Tensor | None:
        """Check token ids (B, L); return their padding mask (True or 1 = real token) as bool, or
        None (every token is real). Attention checks the mask's shape."""
        V = self.config.vocab_size
        if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"T5: {name} must be an integer (batch, seq) tensor, got "
                             f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"T5: {name} holds an id out of range [0, vocab_size={V})")
        return None if mask is None else mask.bool()

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """Source ids (B, S) -> memory (B, S, E); the mask (B, S) is True (or 1) for real tokens."""
        mask = self._check(src, src_key_padding_mask, "src")
        pos = torch.arange(src.size(1), device=src.device)
        bias = self.encoder_bias.position_bias(pos, pos)                      # (1, H, S, S), every layer's
        x = self.dropout(self.shared(src))
        for layer in self.encoder_layers:
            x = self._run(layer, x, bias, mask)
        return self.dropout(self.encoder_norm(x))


class T5ForConditionalGeneration(_T5Encoder):
    """T5 with its language-model head (transformers' T5ForConditionalGeneration).

    ``forward(src (B, S), tgt (B, T), src_key_padding_mask=None, tgt_key_padding_mask=None) ->
    logits (B, T, V)``; ``tgt`` is the shifted-right target (it starts with the decoder's start
    id). Padding masks are True (or 1) for real tokens; None means no padding, as in transformers,
    whose names are accepted too: ``input_ids``, ``attention_mask``, ``decoder_input_ids``,
    ``decoder_attention_mask`` (:mod:`attnlab.models.keywords`).
    ``encode`` / ``decode`` / ``new_cache`` drive :mod:`attnlab.generate`.
    """

    def __init__(self, config: T5Config):
        super().__init__(config)
        c = config
        self.decoder_bias = T5RelativePositionBias(c.num_heads, c.relative_attention_num_buckets,
                                                   c.relative_attention_max_distance, bidirectional=False)
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(c.d_model, c.num_heads, c.d_ff, c.dropout, norm_first=True, norm="rmsnorm",
                         eps=c.layer_norm_epsilon, self_attn=_attention(c, causal=True), cross_attn=_attention(c),
                         ff=_feed_forward(c))
            for _ in range(c.num_decoder_layers))
        self.decoder_norm = RMSNorm(c.d_model, c.layer_norm_epsilon)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight          # one tensor, stored once
        else:
            # logits of unit scale at the start (transformers' N(0, 1) here makes them sqrt(d_model)
            # large, a slow denormal-filled CPU backward)
            nn.init.normal_(self.lm_head.weight, 0.0, c.d_model ** -0.5)

    def new_cache(self) -> LayerCaches:
        """An empty cache for step-by-step decoding with :meth:`decode`."""
        return LayerCaches(len(self.decoder_layers), cross=True)

    def decode(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None,
               tgt_key_padding_mask: Tensor | None = None, *, cache: LayerCaches | None = None) -> Tensor:
        """Target ids (B, T) and memory (B, S, E) -> logits (B, T, V). With ``cache``
        (``new_cache()``) pass only the new tokens: the decoder bias takes its query positions
        from the cache length, and the causal mask aligns to them."""
        c, offset, T = self.config, 0 if cache is None else cache.length, tgt.size(1)
        tgt_mask = self._check(tgt, tgt_key_padding_mask, "tgt")          # (B, cached + new tokens)
        if memory.dim() != 3 or memory.size(0) != tgt.size(0) or memory.size(-1) != c.d_model:
            raise ValueError(f"T5.decode: memory must be (batch={tgt.size(0)}, S, {c.d_model}), "
                             f"got {tuple(memory.shape)}")
        memory_mask = None if memory_key_padding_mask is None else memory_key_padding_mask.bool()
        q_pos = torch.arange(offset, offset + T, device=tgt.device)
        bias = self.decoder_bias.position_bias(q_pos, torch.arange(offset + T, device=tgt.device))  # (1, H, T, S)
        x = self.dropout(self.shared(tgt))
        for i, layer in enumerate(self.decoder_layers):
            layer_cache = None if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = self._run(layer, x, memory, tgt_mask=bias, tgt_key_padding_mask=tgt_mask,
                          memory_key_padding_mask=memory_mask, cache=layer_cache)
        x = self.dropout(self.decoder_norm(x))
        if c.tie_word_embeddings:
            x = x * c.d_model ** -0.5
        return self.lm_head(x)

    def forward(self, src: Tensor | None = None, tgt: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None, *,
                input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                decoder_input_ids: Tensor | None = None, decoder_attention_mask: Tensor | None = None) -> Tensor:
        """Ids src (B, S), tgt (B, T) -> logits (B, T, V) (see the class docstring)."""
        who = "T5"
        src, tgt, src_key_padding_mask, tgt_key_padding_mask = seq2seq_arguments(
            who, src, tgt, src_key_padding_mask, tgt_key_padding_mask, input_ids, attention_mask, decoder_input_ids,
            decoder_attention_mask)
        memory = self.encode(src, src_key_padding_mask)
        return self.decode(tgt, memory, src_key_padding_mask, tgt_key_padding_mask)


class T5EncoderModel(_T5Encoder):
    """The encoder alone (transformers' T5EncoderModel): ``forward(input_ids (B, S),
    attention_mask=None) -> the last hidden state (B, S, E)``, after the final norm."""

    def __init__(self, config: T5Config):
        super().__init__(config)
        self.reset_parameters()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.encode(input_ids, attention_mask)


# ----------------------------------------------------------------------------- Hugging Face
def _attention_rules(ours: str, theirs: str) -> list[Rule]:
    return [Rule(f"{ours}.{a}_proj.weight", f"{theirs}.{b}.weight")
            for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"))]


def _gated(config: T5Config) -> bool:
    return config.feed_forward_proj == "gated-gelu"


def _relu(config: T5Config) -> bool:
    return not _gated(config)


def _ff_rules(ours: str, theirs: str) -> list[Rule]:
    """Both feed-forwards' names; ``wo`` is the output of either, so each rule says which it is for."""
    relu = (("linear1", "wi"), ("linear2", "wo"))
    gated = (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
    return [Rule(f"{ours}.ff.{a}.weight", f"{theirs}.DenseReluDense.{b}.weight", when=when)
            for pairs, when in ((relu, _relu), (gated, _gated)) for a, b in pairs]


def _stack_rules(stack: str) -> list[Rule]:
    """Our ``{stack}_*`` keys <-> transformers' ``{stack}.block.{i}.layer.{j}...``: sublayer 0 is
    self-attention, then (decoder) 1 cross-attention, then the feed-forward."""
    ours, theirs = f"{stack}_layers.{{i}}", f"{stack}.block.{{i}}.layer"
    ff = 2 if stack == "decoder" else 1
    rules = [Rule(f"{stack}_bias.relative_attention_bias.weight",
                  f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
             *_attention_rules(f"{ours}.self_attn", f"{theirs}.0.SelfAttention"),
             Rule(f"{ours}.self_attn_norm.weight", f"{theirs}.0.layer_norm.weight")]
    if stack == "decoder":
        rules += [*_attention_rules(f"{ours}.cross_attn", f"{theirs}.1.EncDecAttention"),
                  Rule(f"{ours}.cross_attn_norm.weight", f"{theirs}.1.layer_norm.weight")]
    return rules + [*_ff_rules(ours, f"{theirs}.{ff}"),
                    Rule(f"{ours}.ff_norm.weight", f"{theirs}.{ff}.layer_norm.weight"),
                    Rule(f"{stack}_norm.weight", f"{stack}.final_layer_norm.weight")]


T5_WEIGHT_MAP = [Rule("shared.weight", "shared.weight"), *_stack_rules("encoder"), *_stack_rules("decoder")]
_HEAD_RULES = [Rule("lm_head.weight", "lm_head.weight")]     # tied: omitted on save, ignored if a checkpoint has it


# T5Config's fields carry transformers' names, but for these
_HF_NAMES = {"dropout": "dropout_rate"}
_MAPPED = [f.name for f in fields(T5Config) if f.name != "tie_word_embeddings"]


def config_from_hf(c: dict) -> T5Config:
    if c.get("feed_forward_proj", "relu") not in FEED_FORWARD:
        raise ValueError(f"T5 config: feed_forward_proj {c['feed_forward_proj']!r} is not supported "
                         f"({', '.join(FEED_FORWARD)})")
    given = {name: c[_HF_NAMES.get(name, name)] for name in _MAPPED if c.get(_HF_NAMES.get(name, name)) is not None}
    # transformers >= 5 writes tie_word_embeddings true for every T5 and says in scale_decoder_outputs
    # whether the head is the original tied, scaled one; earlier versions said it in tie_word_embeddings
    tied = c.get("tie_word_embeddings", True) is not False and c.get("scale_decoder_outputs", True) is not False
    return T5Config(**{"d_kv": 64, **given}, tie_word_embeddings=tied)     # transformers' d_kv default is 64


def config_to_hf(cfg: T5Config) -> dict:
    return {**{_HF_NAMES.get(f.name, f.name): getattr(cfg, f.name) for f in fields(T5Config)},
            "is_encoder_decoder": True}


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, tgt_vocab_size: int | None = None,
                 num_decoder_layers: int | None = None, d_kv: int | None = None,
                 feed_forward_proj: str = "gated-gelu", tie_word_embeddings: bool = False, pad_token_id: int = 0,
                 eos_token_id: int = 1, decoder_start_token_id: int = 0) -> T5Config:
    """A T5 sized for training, by default with v1.1's recipe (gated GELU, an own head): trained
    from scratch with AdamW it learns much faster than the original, whose N(0, 1) embedding is
    also its head and moves slowly under AdamW's steps (the embedded translation corpus, 200
    steps: loss 2.22 and BLEU 20.5 against 2.96 and 9.7). ``context`` is not needed (positions
    are relative buckets); one vocabulary serves source and target, so ``tgt_vocab_size`` (if
    given) must equal ``vocab_size``. d_ff 4 d_model unless given; ``num_layers`` each side
    unless ``num_decoder_layers``."""
    if tgt_vocab_size is not None and tgt_vocab_size != vocab_size:
        raise ValueError(f"t5: one vocabulary serves source and target (its embedding is shared), but they have "
                         f"{vocab_size} and {tgt_vocab_size} tokens; train a shared vocabulary (no --separate-vocab)")
    return T5Config(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, num_layers=num_layers,
                    num_decoder_layers=num_decoder_layers, d_ff=d_ff if d_ff is not None else 4 * d_model, d_kv=d_kv,
                    dropout=dropout, feed_forward_proj=feed_forward_proj, tie_word_embeddings=tie_word_embeddings,
                    pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                    decoder_start_token_id=decoder_start_token_id)


_GOOGLE = dict(vocab_size=32128, relative_attention_num_buckets=32, relative_attention_max_distance=128)
_V1_1 = dict(_GOOGLE, feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=64)
PRESETS = {
    "tiny": dict(vocab_size=96, d_model=32, num_heads=4, d_kv=8, num_layers=2, d_ff=64, dropout=0.0,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "t5-small": dict(_GOOGLE, d_model=512, num_heads=8, d_kv=64, num_layers=6, d_ff=2048),        # 60.5M
    "t5-base": dict(_GOOGLE, d_model=768, num_heads=12, d_kv=64, num_layers=12, d_ff=3072),       # 223M
    "t5-v1_1-small": dict(_V1_1, d_model=512, num_heads=6, num_layers=8, d_ff=1024),             # 77M
    "t5-v1_1-base": dict(_V1_1, d_model=768, num_heads=12, num_layers=12, d_ff=2048),            # 248M
}

T5 = register_family("t5", T5Config, base_rules=T5_WEIGHT_MAP, config_from_hf=config_from_hf,
                     limits=lambda c: {"vocab_size": c.vocab_size, "context": None},   # relative positions: no limit
                     config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config,
                     # older checkpoints also store the shared embedding under each stack, and
                     # transformers ignores a cross-attention bias table some carry
                     ignore_on_load=(r"^(encoder|decoder)\.embed_tokens\.weight$",
                                     r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\."),
                     # T5's optimizer, whose steps follow each weight's scale: the N(0, 1) shared
                     # embedding learns ~10x faster than under AdamW (attnlab.train.optim.build_optimizer);
                     # no weight decay, as T5 was trained (torch's Adafactor would scale it by the lr)
                     training={"optimizer": "adafactor", "lr": 5e-2, "weight_decay": 0.0},
                     # the decoder starts from the tokenizer's BOS (the translation task's target
                     # tokenizers have one), where the original vocabulary starts from its pad id
                     token_ids={"pad_token_id": "pad", "eos_token_id": "eos", "decoder_start_token_id": "bos"})
T5.register("T5ForConditionalGeneration", T5ForConditionalGeneration, kind="seq2seq", head_rules=_HEAD_RULES)
T5.register("T5EncoderModel", T5EncoderModel, kind="base")
