"""transformers' keyword names beside the chapter's: one argument under two names.

The chapter calls an encoder-decoder as ``model(src, tgt, src_key_padding_mask=...)``;
transformers' users call ``model(input_ids=..., attention_mask=..., decoder_input_ids=...,
decoder_attention_mask=...)``. A model takes both: :func:`either` picks whichever name was used
(refusing both at once, which could disagree) and :func:`padding_mask` reads transformers'
masks, which hold 1 (or True) for real tokens and 0 for padding in any dtype, as attnlab's
padding masks (True = real token) do.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["either", "padding_mask", "seq2seq_arguments"]


def either(who: str, ours: str, mine, theirs: str, hers, required: bool = False):
    """The value given as ``ours`` (the chapter's name) or as ``theirs`` (transformers' name):
    ValueError if both were given, TypeError if ``required`` and neither was."""
    if mine is not None and hers is not None:
        raise ValueError(f"{who}: give {ours} or {theirs} (transformers' name for it), not both")
    if required and mine is None and hers is None:
        raise TypeError(f"{who}: missing {ours} (or transformers' name for it, {theirs})")
    return mine if hers is None else hers


def padding_mask(who: str, name: str, mask: Tensor | None) -> Tensor | None:
    """transformers' ``name`` (B, L) mask -> attnlab's bool padding mask (True = real token);
    ValueError unless it holds only 0 and 1 (an additive float mask, 0 / -inf, means the opposite)."""
    if mask is None or (isinstance(mask, Tensor) and mask.dtype == torch.bool):
        return mask
    if not isinstance(mask, Tensor) or mask.is_complex() or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"{who}: {name} must hold 1 for real tokens and 0 for padding (as transformers' does), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} values other than 0 and 1")
    return mask != 0


def seq2seq_arguments(who: str, src, tgt, src_key_padding_mask, tgt_key_padding_mask, input_ids, attention_mask,
                      decoder_input_ids, decoder_attention_mask) -> tuple:
    """An encoder-decoder's (src, tgt, src_key_padding_mask, tgt_key_padding_mask), each given under
    the chapter's name or transformers' (``input_ids``, ``decoder_input_ids``, ``attention_mask``,
    ``decoder_attention_mask``); src and tgt are required."""
    return (either(who, "src", src, "input_ids", input_ids, required=True),
            either(who, "tgt", tgt, "decoder_input_ids", decoder_input_ids, required=True),
            either(who, "src_key_padding_mask", src_key_padding_mask, "attention_mask",
                   padding_mask(who, "attention_mask", attention_mask)),
            either(who, "tgt_key_padding_mask", tgt_key_padding_mask, "decoder_attention_mask",
                   padding_mask(who, "decoder_attention_mask", decoder_attention_mask)))
