"""Whisper: speech recognition as an encoder-decoder over log-mel frames (Radford et al. 2022,
"Robust Speech Recognition via Large-Scale Weak Supervision", section 2.2 and figure 1).

    input_features (B, M, F) -> GELU(Conv1d k3) -> GELU(Conv1d k3, stride 2)      (B, E, F/2)
        -> + sinusoidal positions -> N x [x + Attn(LN(x)); x + FF(LN(x))] -> LN -> memory (B, F/2, E)
    decoder_input_ids (B, T) -> token embedding + learned positions
        -> N x [x + CausalAttn(LN(x)); x + CrossAttn(LN(x), memory); x + FF(LN(x))] -> LN
        -> the token embedding transposed (a tied head) -> logits (B, T, V)

The input is what :class:`attnlab.processors.LogMelFeatureExtractor` makes: M mel bands, F
frames 10 ms of audio apart (3000 for 30 s, Whisper's own hop of 160 samples). The stride-2 convolution halves the frames, so the encoder
takes up to 2 * ``max_source_positions`` frames; its positions are a fixed table, [sin | cos]
over geometrically spaced timescales, stored with the weights as the checkpoints do. Pre-Norm
LayerNorm blocks with GELU feed-forwards; the key projection has no bias (it would add the same
amount to every score of a query, which the softmax cancels). transformers multiplies the
queries by 1/sqrt(D) before the product; the usual scale on the scores is the same number.
Shape letters: see :mod:`attnlab.nn.attention`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from ..nn.block import DecoderLayer, EncoderLayer
from ..nn.cache import LayerCaches
from ..nn.checkpoint import checkpoint
from ..nn.mlp import FeedForward
from ..nn.norm import make_norm
from .convert import Rule
from .keywords import either, padding_mask
from .pretrained import SavePretrained
from .registry import register_family

__all__ = ["WhisperConfig", "WhisperForConditionalGeneration", "WHISPER", "sinusoids", "build_config"]


@dataclass
class WhisperConfig:
    vocab_size: int = 51865
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_layers: int = 4
    decoder_attention_heads: int = 6
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500          # encoder positions: half the input frames
    max_target_positions: int = 448           # the longest decoder sequence
    dropout: float = 0.0                      # on each sublayer's output
    attention_dropout: float = 0.0            # on the attention weights
    activation_dropout: float = 0.0           # after the feed-forward's activation
    activation_function: str = "gelu"
    scale_embedding: bool = False             # token embedding * sqrt(d_model)
    pad_token_id: int = 50257
    bos_token_id: int = 50257
    eos_token_id: int = 50257
    decoder_start_token_id: int = 50258

    def __post_init__(self):
        for name in ("vocab_size", "num_mel_bins", "d_model", "encoder_layers", "encoder_attention_heads",
                     "encoder_ffn_dim", "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim",
                     "max_source_positions", "max_target_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WhisperConfig: {name} must be positive, got {getattr(self, name)}")
        for heads in (self.encoder_attention_heads, self.decoder_attention_heads):
            if self.d_model % heads:
                raise ValueError(f"WhisperConfig: d_model ({self.d_model}) is not divisible by {heads} heads")
        if self.d_model % 2:
            raise ValueError(f"WhisperConfig: d_model must be even (sin and cos halves), got {self.d_model}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"WhisperConfig: {name} must be in [0, 1), got {getattr(self, name)}")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"WhisperConfig: {name} {getattr(self, name)} is outside the vocabulary "
                                 f"({self.vocab_size})")

    @property
    def max_frames(self) -> int:
        """The most input frames the encoder takes (its convolution halves them)."""
        return 2 * self.max_source_positions


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> Tensor:
    """The encoder's position table (length, channels): position p times channels/2 rates
    spaced geometrically from 1 down to 1/max_timescale, sines in the first half, cosines in the second."""
    rates = torch.exp(-math.log(max_timescale) / (channels // 2 - 1) * torch.arange(channels // 2))
    angles = torch.arange(length)[:, None] * rates[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def _attention(c: WhisperConfig, heads: int, causal: bool = False) -> MultiHeadAttention:
    attn = MultiHeadAttention(c.d_model, heads, c.attention_dropout, causal=causal)
    attn.k_proj = nn.Linear(c.d_model, c.d_model, bias=False)      # no key bias (module docstring)
    return attn


def _ff(c: WhisperConfig, d_ff: int) -> FeedForward:
    return FeedForward(c.d_model, d_ff, c.activation_dropout, activation=c.activation_function)


class WhisperForConditionalGeneration(SavePretrained, nn.Module):
    """Whisper with its tied language-model head (transformers' WhisperForConditionalGeneration).

    ``forward(input_features (B, M, F), decoder_input_ids (B, T), decoder_attention_mask=None)
    -> logits (B, T, V)``, teacher-forced: ``decoder_input_ids`` starts with the decoder's start
    id. The padding mask is True (or 1) for real tokens. ``encode`` / ``decode`` / ``new_cache``
    drive :mod:`attnlab.generate` (a KV cache for the decoder, the memory's keys and values
    projected once).
    """

    def __init__(self, config: WhisperConfig):
        super().__init__()
        c = self.config = config
        self.gradient_checkpointing = False
        E = c.d_model
        self.conv1 = nn.Conv1d(c.num_mel_bins, E, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(E, E, kernel_size=3, stride=2, padding=1)
        self.register_buffer("encoder_positions", sinusoids(c.max_source_positions, E))
        self.dropout = nn.Dropout(c.dropout)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(E, c.encoder_attention_heads, c.encoder_ffn_dim, c.dropout, norm_first=True,
                         self_attn=_attention(c, c.encoder_attention_heads), ff=_ff(c, c.encoder_ffn_dim))
            for _ in range(c.encoder_layers))
        self.encoder_norm = make_norm("layernorm", E)
        self.embed_tokens = nn.Embedding(c.vocab_size, E, padding_idx=c.pad_token_id)
        self.decoder_positions = nn.Embedding(c.max_target_positions, E)
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(E, c.decoder_attention_heads, c.decoder_ffn_dim, c.dropout, norm_first=True,
                         self_attn=_attention(c, c.decoder_attention_heads, causal=True),
                         cross_attn=_attention(c, c.decoder_attention_heads), ff=_ff(c, c.decoder_ffn_dim))
            for _ in range(c.decoder_layers))
        self.decoder_norm = make_norm("layernorm", E)
        self.proj_out = nn.Linear(E, c.vocab_size, bias=False)
        self.reset_parameters()
        self.proj_out.weight = self.embed_tokens.weight          # one tensor, stored once

    def reset_parameters(self) -> None:
        """As transformers initialises Whisper: N(0, 0.02) weights, zero biases, unit norms, the
        padding row of the embedding zero."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        with torch.no_grad():
            self.embed_tokens.weight[self.config.pad_token_id].zero_()

    def no_weight_decay(self) -> tuple[str, ...]:
        """The position table is an embedding: rows of long positions, seldom seen, would only shrink."""
        return ("decoder_positions.weight",)

    def _run(self, layer: nn.Module, *args, **kwargs) -> Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and not kwargs.get("cache"):
            return checkpoint(layer, *args, **kwargs)
        return layer(*args, **kwargs)

    def encode(self, input_features: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Log-mel frames (B, M, F), F <= 2 * max_source_positions -> memory (B, ceil(F / 2), E).
        ``attention_mask`` is accepted for the decoding loop's sake and must be None: Whisper's
        encoder sees the padded chunk whole, silence included."""
        c = self.config
        if attention_mask is not None:
            raise ValueError("Whisper.encode: the encoder reads every frame; it takes no attention mask")
        x = input_features
        if not isinstance(x, Tensor) or x.dim() != 3 or not x.is_floating_point() or x.size(1) != c.num_mel_bins:
            raise ValueError(f"Whisper: input_features must be a float (batch, {c.num_mel_bins} mel bins, frames) "
                             f"tensor, got {getattr(x, 'dtype', type(x).__name__)} {tuple(getattr(x, 'shape', ()))}")
        if x.size(2) > c.max_frames:
            raise ValueError(f"Whisper: {x.size(2)} frames, the encoder takes at most {c.max_frames}")
        x = F.gelu(self.conv2(F.gelu(self.conv1(x.to(self.conv1.weight.dtype))))).transpose(1, 2)
        x = self.dropout(x + self.encoder_positions[:x.size(1)].to(x.dtype))
        for layer in self.encoder_layers:
            x = self._run(layer, x)
        return self.encoder_norm(x)

    def new_cache(self) -> LayerCaches:
        """An empty cache for step-by-step decoding with :meth:`decode`."""
        return LayerCaches(len(self.decoder_layers), cross=True)

    def decode(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None,
               tgt_key_padding_mask: Tensor | None = None, *, cache: LayerCaches | None = None) -> Tensor:
        """Token ids (B, T) and memory (B, S, E) -> logits (B, T, V). With ``cache``
        (``new_cache()``) pass only the new tokens: their positions start at the cache length."""
        c, offset, T = self.config, 0 if cache is None else cache.length, tgt.size(1)
        if tgt.dim() != 2 or tgt.is_floating_point() or (tgt.numel() and not 0 <= int(tgt.min()) <= int(tgt.max())
                                                         < c.vocab_size):
            raise ValueError(f"Whisper: decoder_input_ids must be (batch, T) ids in [0, {c.vocab_size})")
        if offset + T > c.max_target_positions:
            raise ValueError(f"Whisper: {offset + T} decoder positions, the model has {c.max_target_positions}")
        if memory.dim() != 3 or memory.size(0) != tgt.size(0) or memory.size(-1) != c.d_model:
            raise ValueError(f"Whisper.decode: memory must be (batch={tgt.size(0)}, S, {c.d_model}), "
                             f"got {tuple(memory.shape)}")
        scale = math.sqrt(c.d_model) if c.scale_embedding else 1.0
        x = self.embed_tokens(tgt) * scale + self.decoder_positions(torch.arange(offset, offset + T, device=tgt.device))
        x = self.dropout(x)
        mask = None if tgt_key_padding_mask is None else tgt_key_padding_mask.bool()
        for i, layer in enumerate(self.decoder_layers):
            layer_cache = None if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = self._run(layer, x, memory, tgt_key_padding_mask=mask, memory_key_padding_mask=memory_key_padding_mask,
                          cache=layer_cache)
        return self.proj_out(self.decoder_norm(x))

    def forward(self, input_features: Tensor, decoder_input_ids: Tensor | None = None,
                decoder_attention_mask: Tensor | None = None, *, tgt: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None) -> Tensor:
        """Frames (B, M, F) and ids (B, T) -> logits (B, T, V) (see the class docstring); ``tgt``
        and ``tgt_key_padding_mask`` are the chapter's names for the decoder's ids and mask."""
        who = "Whisper"
        tgt = either(who, "tgt", tgt, "decoder_input_ids", decoder_input_ids, required=True)
        mask = either(who, "tgt_key_padding_mask", tgt_key_padding_mask, "decoder_attention_mask",
                      padding_mask(who, "decoder_attention_mask", decoder_attention_mask))
        return self.decode(tgt, self.encode(input_features), tgt_key_padding_mask=mask)


# ----------------------------------------------------------------------------- Hugging Face
def _attention_rules(ours: str, theirs: str) -> list[Rule]:
    rules = [Rule(f"{ours}.{p}_proj.weight", f"{theirs}.{p}_proj.weight") for p in ("q", "k", "v", "out")]
    return rules + [Rule(f"{ours}.{p}_proj.bias", f"{theirs}.{p}_proj.bias") for p in ("q", "v", "out")]


def _layer_rules(stack: str) -> list[Rule]:
    """Our ``{stack}_layers.{i}`` <-> transformers' ``{stack}.layers.{i}``."""
    ours, theirs = f"{stack}_layers.{{i}}", f"{stack}.layers.{{i}}"
    pairs = [("self_attn_norm", "self_attn_layer_norm"), ("ff_norm", "final_layer_norm"),
             ("ff.linear1", "fc1"), ("ff.linear2", "fc2")]
    rules = _attention_rules(f"{ours}.self_attn", f"{theirs}.self_attn")
    if stack == "decoder":
        rules += _attention_rules(f"{ours}.cross_attn", f"{theirs}.encoder_attn")
        pairs.append(("cross_attn_norm", "encoder_attn_layer_norm"))
    return rules + [Rule(f"{ours}.{a}.{w}", f"{theirs}.{b}.{w}") for a, b in pairs for w in ("weight", "bias")]


WHISPER_WEIGHT_MAP = [
    *(Rule(f"{conv}.{w}", f"encoder.{conv}.{w}") for conv in ("conv1", "conv2") for w in ("weight", "bias")),
    Rule("encoder_positions", "encoder.embed_positions.weight"),
    *_layer_rules("encoder"),
    *(Rule(f"encoder_norm.{w}", f"encoder.layer_norm.{w}") for w in ("weight", "bias")),
    Rule("embed_tokens.weight", "decoder.embed_tokens.weight"),
    Rule("decoder_positions.weight", "decoder.embed_positions.weight"),
    *_layer_rules("decoder"),
    *(Rule(f"decoder_norm.{w}", f"decoder.layer_norm.{w}") for w in ("weight", "bias")),
]
_HEAD_RULES = [Rule("proj_out.weight", "proj_out.weight")]     # tied: omitted on save, ignored if a checkpoint has it

_FIELDS = [f.name for f in fields(WhisperConfig)]
_ACTIVATIONS = ("gelu", "relu", "silu", "quick_gelu")      # the names both libraries give the same function


def config_from_hf(c: dict) -> WhisperConfig:
    if c.get("tie_word_embeddings", True) is False:
        raise ValueError("Whisper config: an output head apart from the token embedding is not supported")
    if c.get("activation_function", "gelu") not in _ACTIVATIONS:
        raise ValueError(f"Whisper config: activation_function {c['activation_function']!r} is not supported")
    return WhisperConfig(**{name: c[name] for name in _FIELDS if c.get(name) is not None})


def config_to_hf(cfg: WhisperConfig) -> dict:
    return {**{name: getattr(cfg, name) for name in _FIELDS}, "tie_word_embeddings": True, "is_encoder_decoder": True,
            "begin_suppress_tokens": None}


# ----------------------------------------------------------------------------- registration
def build_config(*, num_mel_bins: int, frames: int, vocab_size: int, context: int, d_model: int, num_heads: int,
                 num_layers: int, d_ff: int | None = None, dropout: float = 0.0, pad_token_id: int = 0,
                 bos_token_id: int = 1, eos_token_id: int = 2, decoder_start_token_id: int | None = None
                 ) -> WhisperConfig:
    """A Whisper sized for training: ``frames`` input frames (the encoder gets half as many
    positions), ``context`` decoder positions, ``num_layers`` and ``num_heads`` on each side,
    d_ff 4 d_model unless given. Decoding starts from the BOS id unless told otherwise."""
    d_ff = d_ff if d_ff is not None else 4 * d_model
    return WhisperConfig(vocab_size=vocab_size, num_mel_bins=num_mel_bins, d_model=d_model, encoder_layers=num_layers,
                         encoder_attention_heads=num_heads, encoder_ffn_dim=d_ff, decoder_layers=num_layers,
                         decoder_attention_heads=num_heads, decoder_ffn_dim=d_ff,
                         max_source_positions=(frames + 1) // 2, max_target_positions=context, dropout=dropout,
                         pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         decoder_start_token_id=bos_token_id if decoder_start_token_id is None
                         else decoder_start_token_id)


_OPENAI = dict(vocab_size=51865, num_mel_bins=80, max_source_positions=1500, max_target_positions=448)
PRESETS = {
    "tiny": dict(vocab_size=99, num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=4,
                 encoder_ffn_dim=48, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48,
                 max_source_positions=24, max_target_positions=40, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=1),
    "whisper-tiny": dict(_OPENAI, d_model=384, encoder_layers=4, encoder_attention_heads=6, encoder_ffn_dim=1536,
                         decoder_layers=4, decoder_attention_heads=6, decoder_ffn_dim=1536),        # 37.8M
    "whisper-base": dict(_OPENAI, d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                         decoder_layers=6, decoder_attention_heads=8, decoder_ffn_dim=2048),        # 72.6M
}

WHISPER = register_family("whisper", WhisperConfig, base_rules=WHISPER_WEIGHT_MAP, config_from_hf=config_from_hf,
                          config_to_hf=config_to_hf, presets=PRESETS, build_config=build_config, modality="audio",
                          limits=lambda c: {"num_mel_bins": c.num_mel_bins, "frames": c.max_frames,
                                            "vocab_size": c.vocab_size, "context": c.max_target_positions},
                          token_ids={"pad_token_id": "pad", "bos_token_id": "bos", "eos_token_id": "eos"})
WHISPER.register("WhisperForConditionalGeneration", WhisperForConditionalGeneration, kind="speech-to-text",
                 prefix="model.", head_rules=_HEAD_RULES, default=True)
