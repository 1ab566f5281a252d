"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017).

    src ids -> Embedding * sqrt(E) + sinusoidal PE -> N x EncoderLayer -> memory
    tgt ids -> Embedding * sqrt(E) + sinusoidal PE -> N x DecoderLayer(memory) -> Linear -> logits

Masks take ``torch.nn.Transformer``'s names and order, with attnlab's one convention:

- attention masks ``src_mask`` (S, S), ``tgt_mask`` (T, T), ``memory_mask`` (T, S), or
  (B or 1, H or 1, rows or 1, cols): a float mask is *added* to the scores (the chapter's
  ``generate_square_subsequent_mask(T)``: 0 allowed, -inf blocked), a boolean mask is True
  where attention is *allowed*. Float masks mean the same as in torch; a torch boolean mask
  (True = blocked) must be inverted first: ``~mask``.
- padding masks ``src_key_padding_mask`` (B, S), ``tgt_key_padding_mask`` (B, T),
  ``memory_key_padding_mask`` (B, S): booleans, True for *real* tokens, the opposite of
  torch's (True = ignore): pass ``~torch_mask``. ``memory_key_padding_mask`` defaults to the
  source's, so cross-attention ignores padded source positions without being told.

transformers' keyword names are accepted too (``input_ids``, ``attention_mask``,
``decoder_input_ids``, ``decoder_attention_mask``, with transformers' masks: 1 = real token).

The decoder's self-attention is always causal; a ``tgt_mask`` is applied on top of the
causal triangle (a mask that only repeats it costs nothing: the fused kernel's causal flag is
used). ``encode`` / ``decode`` split the model so that a decoder can run one token at a time
with a cache (see attnlab.nn.cache).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..nn.block import DecoderLayer, EncoderLayer
from ..nn.cache import LayerCaches
from ..nn.checkpoint import checkpoint
from ..nn.norm import make_norm
from ..nn.position import PositionalEncoding
from .keywords import seq2seq_arguments
from .pretrained import SavePretrained
from .registry import register_family

__all__ = ["TransformerConfig", "Transformer", "TRANSFORMER", "build_config"]


@dataclass
class TransformerConfig:
    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 512
    num_heads: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    d_ff: int = 2048
    max_seq_len: int = 5000
    dropout: float = 0.1
    norm_first: bool = False          # Pre-Norm if True; the paper is Post-Norm
    final_norm: bool | None = None    # norm after each stack; default: only for Pre-Norm
    activation: str = "relu"
    layer_norm_eps: float = 1e-5
    tie_output: bool = False          # output projection shares the target embedding
    share_embeddings: bool = False    # source and target share one embedding (one vocabulary)
    pad_id: int | None = None         # if set, padding masks are derived from the ids

    def __post_init__(self):
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "num_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransformerConfig: {name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"TransformerConfig: d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads})")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError("TransformerConfig: share_embeddings needs src_vocab_size == tgt_vocab_size "
                             f"({self.src_vocab_size} != {self.tgt_vocab_size})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TransformerConfig: dropout must be in [0, 1), got {self.dropout}")
        if self.final_norm is None:
            self.final_norm = self.norm_first


class Transformer(SavePretrained, nn.Module):
    """Encoder-decoder Transformer; the constructor takes the chapter's arguments.

    forward(src (B, S), tgt (B, T), src_mask=None, tgt_mask=None, memory_mask=None,
    src_key_padding_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None)
    -> logits (B, T, tgt_vocab_size): torch.nn.Transformer's mask arguments in its order, with
    attnlab's conventions (module docstring). Teacher forcing: ``tgt`` is the shifted-right
    target. The chapter's call works as written::

        model(src, tgt, tgt_mask=generate_square_subsequent_mask(T))
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 512, num_heads: int = 8,
                 num_encoder_layers: int = 6, num_decoder_layers: int = 6, d_ff: int = 2048,
                 max_seq_len: int = 5000, dropout: float = 0.1, **options):
        super().__init__()
        cfg = TransformerConfig(src_vocab_size, tgt_vocab_size, d_model, num_heads, num_encoder_layers,
                                num_decoder_layers, d_ff, max_seq_len, dropout, **options)
        self.config = cfg
        self.gradient_checkpointing = False
        layer_args = dict(norm_first=cfg.norm_first, activation=cfg.activation, eps=cfg.layer_norm_eps)

        self.tgt_embedding = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model)
        self.src_embedding = self.tgt_embedding if cfg.share_embeddings else nn.Embedding(cfg.src_vocab_size, cfg.d_model)
        self.pos_encoding = PositionalEncoding(cfg.d_model, cfg.max_seq_len, cfg.dropout)
        self.encoder_layers = nn.ModuleList(
            EncoderLayer(cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.dropout, **layer_args)
            for _ in range(cfg.num_encoder_layers))
        self.decoder_layers = nn.ModuleList(
            DecoderLayer(cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.dropout, **layer_args)
            for _ in range(cfg.num_decoder_layers))
        self.encoder_norm = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps) if cfg.final_norm else nn.Identity()
        self.decoder_norm = make_norm("layernorm", cfg.d_model, cfg.layer_norm_eps) if cfg.final_norm else nn.Identity()
        self.output_projection = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=not cfg.tie_output)
        self.reset_parameters()
        if cfg.tie_output:
            self.output_projection.weight = self.tgt_embedding.weight

    @classmethod
    def from_config(cls, cfg: TransformerConfig | dict) -> "Transformer":
        d = asdict(cfg) if isinstance(cfg, TransformerConfig) else dict(cfg)
        return cls(**d)

    def reset_parameters(self) -> None:
        """Xavier-uniform for every projection, as the reference implementations do; the
        embeddings get N(0, E^-1/2), so that after the sqrt(E) scaling a token vector has unit
        scale, like the position signal it is added to, and a tied output layer starts with
        logits of unit scale. (Xavier on a large-vocabulary embedding would make tokens ~4x
        fainter than positions at the start; PyTorch's default N(0, 1) would make tied logits
        huge and fill the backward pass with denormals.)
        """
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        for emb in {id(e): e for e in (self.src_embedding, self.tgt_embedding)}.values():
            nn.init.normal_(emb.weight, mean=0.0, std=self.config.d_model ** -0.5)

    # ------------------------------------------------------------------ pieces
    def _padding(self, ids: Tensor, mask: Tensor | None, name: str = "padding mask") -> Tensor | None:
        if mask is None and self.config.pad_id is not None:
            mask = ids != self.config.pad_id
        if mask is not None and (mask.shape != ids.shape or mask.dtype != torch.bool):
            raise ValueError(f"Transformer: {name} must be bool {tuple(ids.shape)} (True = real token), "
                             f"got {mask.dtype} {tuple(mask.shape)}")
        return mask

    @staticmethod
    def _attn_mask(name: str, mask: Tensor | None, rows: int, cols: int) -> Tensor | None:
        """Check an attention mask: bool (True = may attend) or float (added to the scores), of
        shape (rows, cols) or (B or 1, H or 1, rows or 1, cols). A (B, L) padding mask passed here by
        position, or a 0/1 "keep" mask in the chapter's ``mask == 0`` convention, would be read
        as something else without a word, so both are refused with the fix in the message."""
        if mask is None:
            return None
        if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            raise ValueError(f"Transformer: {name} must be a bool (True = may attend) or float (added to the "
                             f"scores) tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if not (mask.dim() == 2 and mask.shape == (rows, cols)
                or mask.dim() == 4 and mask.size(-2) in (1, rows) and mask.size(-1) == cols):
            raise ValueError(f"Transformer: {name} must be ({rows}, {cols}) or (B, 1 or H, 1 or {rows}, {cols}), got "
                             f"{tuple(mask.shape)}; a (B, L) padding mask goes to src_key_padding_mask, "
                             "tgt_key_padding_mask or memory_key_padding_mask (True = real token)")
        if mask.dtype != torch.bool and bool(((mask == 0) | (mask == 1)).all()) and bool((mask == 1).any()):
            raise ValueError(f"Transformer: {name} holds only 0 and 1, but a float mask is added to the scores "
                             "(0 = allowed, -inf = blocked); for a 0/1 keep-mask pass mask.bool() (True = may attend)")
        return mask

    @staticmethod
    def _beyond_causal(mask: Tensor | None, T: int) -> Tensor | None:
        """``tgt_mask`` minus what the decoder's causal self-attention already does: a (T, T)
        mask that is exactly the causal triangle (bool or -inf above the diagonal) is dropped, so
        the fused kernel runs with its causal flag instead of a materialised mask."""
        if mask is None or mask.shape != (T, T):
            return mask
        allowed = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
        if mask.dtype == torch.bool:
            redundant = torch.equal(mask, allowed)
        else:
            redundant = bool(((mask == 0) == allowed).all()) and bool((mask[~allowed] == float("-inf")).all())
        return None if redundant else mask

    def _embed(self, ids: Tensor, embedding: nn.Embedding, offset: int = 0) -> Tensor:
        if ids.dim() != 2:
            raise ValueError(f"Transformer: token ids must be (batch, seq), got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= embedding.num_embeddings):
            raise ValueError(f"Transformer: token id out of range [0, {embedding.num_embeddings}): "
                             f"min {int(ids.min())}, max {int(ids.max())}")
        return self.pos_encoding(embedding(ids) * math.sqrt(self.config.d_model), offset=offset)

    def _run(self, layer: nn.Module, *args, **kwargs) -> Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(layer, *args, **kwargs)
        return layer(*args, **kwargs)

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None, *,
               src_mask: Tensor | None = None) -> Tensor:
        """Source ids (B, S) -> memory (B, S, E). ``src_key_padding_mask`` (B, S), True = real
        token; ``src_mask`` (S, S) bool (True = may attend) or float (added)."""
        src_key_padding_mask = self._padding(src, src_key_padding_mask, "src_key_padding_mask")
        src_mask = self._attn_mask("src_mask", src_mask, src.size(-1), src.size(-1))
        x = self._embed(src, self.src_embedding)
        for layer in self.encoder_layers:
            x = self._run(layer, x, src_mask, src_key_padding_mask)
        return self.encoder_norm(x)

    def decode(self, tgt: Tensor, memory: Tensor, memory_key_padding_mask: Tensor | None = None,
               tgt_key_padding_mask: Tensor | None = None, *, tgt_mask: Tensor | None = None,
               memory_mask: Tensor | None = None, cache: LayerCaches | None = None) -> Tensor:
        """Target ids (B, T) and memory (B, S, E) -> logits (B, T, V).

        ``memory_key_padding_mask`` (B, S) and ``tgt_key_padding_mask`` (B, T): True = real token
        (the third argument is the source's padding mask, as ``encode`` took it); ``tgt_mask``
        (T, T) on top of the causal triangle and ``memory_mask`` (T, S): bool True = may attend,
        or float added. With ``cache`` (``new_cache()``), pass only the new tokens each step:
        positions are offset by the cache length and earlier keys/values are reused (a
        ``tgt_mask`` then covers (new, cached + new) keys). Attention weights:
        ``attnlab.viz.record_attention(model)``.
        """
        offset = 0 if cache is None else cache.length
        if memory.dim() != 3 or memory.size(0) != tgt.size(0) or memory.size(-1) != self.config.d_model:
            raise ValueError(f"Transformer.decode: memory must be (batch={tgt.size(0)}, S, {self.config.d_model}), "
                             f"got {tuple(memory.shape)}")
        if cache is None:
            tgt_key_padding_mask = self._padding(tgt, tgt_key_padding_mask, "tgt_key_padding_mask")
        if memory_key_padding_mask is not None and (memory_key_padding_mask.dtype != torch.bool
                                                    or memory_key_padding_mask.shape != memory.shape[:2]):
            raise ValueError(f"Transformer: memory_key_padding_mask must be bool {tuple(memory.shape[:2])} "
                             f"(True = real token), got {memory_key_padding_mask.dtype} "
                             f"{tuple(memory_key_padding_mask.shape)}")
        T = tgt.size(-1)
        tgt_mask = self._beyond_causal(self._attn_mask("tgt_mask", tgt_mask, T, offset + T), offset + T)
        memory_mask = self._attn_mask("memory_mask", memory_mask, T, memory.size(1))
        x = self._embed(tgt, self.tgt_embedding, offset)
        for i, layer in enumerate(self.decoder_layers):
            layer_cache = None if cache is None else (cache.self_attn[i], cache.cross_attn[i])
            x = self._run(layer, x, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                          tgt_key_padding_mask=tgt_key_padding_mask,
                          memory_key_padding_mask=memory_key_padding_mask, cache=layer_cache)
        return self.output_projection(self.decoder_norm(x))

    def new_cache(self) -> LayerCaches:
        """An empty cache for step-by-step decoding with :meth:`decode`."""
        return LayerCaches(len(self.decoder_layers), cross=True)

    def forward(self, src: Tensor | None = None, tgt: Tensor | None = None, src_mask: Tensor | None = None,
                tgt_mask: Tensor | None = None, memory_mask: Tensor | None = None,
                src_key_padding_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, *, input_ids: Tensor | None = None,
                attention_mask: Tensor | None = None, decoder_input_ids: Tensor | None = None,
                decoder_attention_mask: Tensor | None = None) -> Tensor:
        """Ids src (B, S), tgt (B, T) -> logits (B, T, V); the masks as in the module docstring.
        transformers' names are taken too: ``input_ids`` for src, ``decoder_input_ids`` for tgt,
        ``attention_mask`` / ``decoder_attention_mask`` (1 = real token, any dtype) for the two
        padding masks (:mod:`attnlab.models.keywords`)."""
        who = "Transformer"
        src, tgt, src_key_padding_mask, tgt_key_padding_mask = seq2seq_arguments(
            who, src, tgt, src_key_padding_mask, tgt_key_padding_mask, input_ids, attention_mask, decoder_input_ids,
            decoder_attention_mask)
        src_key_padding_mask = self._padding(src, src_key_padding_mask, "src_key_padding_mask")
        memory = self.encode(src, src_key_padding_mask, src_mask=src_mask)
        if memory_key_padding_mask is None:
            memory_key_padding_mask = src_key_padding_mask
        return self.decode(tgt, memory, memory_key_padding_mask, tgt_key_padding_mask, tgt_mask=tgt_mask,
                           memory_mask=memory_mask)


# ----------------------------------------------------------------------------- registration
def build_config(*, vocab_size: int, context: int, d_model: int, num_heads: int, num_layers: int,
                 d_ff: int | None = None, dropout: float = 0.0, tgt_vocab_size: int | None = None,
                 num_decoder_layers: int | None = None, norm_first: bool = False, tie_output: bool = False,
                 share_embeddings: bool = False, pad_id: int | None = None) -> TransformerConfig:
    """A Transformer sized for training: ``vocab_size`` is the source's (and the target's unless
    ``tgt_vocab_size``), ``num_layers`` the encoder's (and the decoder's unless
    ``num_decoder_layers``), ``context`` the longest sequence, d_ff 4 d_model unless given."""
    return TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=tgt_vocab_size if tgt_vocab_size is not None else vocab_size,
        d_model=d_model, num_heads=num_heads, num_encoder_layers=num_layers,
        num_decoder_layers=num_decoder_layers if num_decoder_layers is not None else num_layers,
        d_ff=d_ff if d_ff is not None else 4 * d_model, max_seq_len=context, dropout=dropout, norm_first=norm_first,
        tie_output=tie_output, share_embeddings=share_embeddings, pad_id=pad_id)


# the paper's section 3.4 shares one matrix between both embeddings and the output layer, over a
# 37000-token BPE vocabulary shared by English and German (section 5.1); table 3 gives the sizes
_WMT = dict(src_vocab_size=37000, tgt_vocab_size=37000, share_embeddings=True, tie_output=True)
PRESETS = {
    "tiny": dict(src_vocab_size=96, tgt_vocab_size=96, d_model=32, num_heads=4, num_encoder_layers=2,
                 num_decoder_layers=2, d_ff=64, max_seq_len=64, dropout=0.0),
    "base": dict(_WMT, d_model=512, num_heads=8, num_encoder_layers=6, num_decoder_layers=6, d_ff=2048, dropout=0.1),
    "big": dict(_WMT, d_model=1024, num_heads=16, num_encoder_layers=6, num_decoder_layers=6, d_ff=4096, dropout=0.3),
}

# attnlab-native: no Hugging Face class matches the 2017 model, so its directories hold our own
# config fields and state-dict keys
TRANSFORMER = register_family("transformer", TransformerConfig, presets=PRESETS, build_config=build_config,
                              limits=lambda c: {"vocab_size": c.src_vocab_size, "context": c.max_seq_len})
TRANSFORMER.register("Transformer", Transformer, kind="seq2seq", factory=Transformer.from_config)
