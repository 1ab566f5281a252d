"""The cross-attention alignment of a translation: which source tokens each target token read."""
from __future__ import annotations

from pathlib import Path

import torch

from ..generate import greedy_decode
from ..generate.state import context_of
from .attention import plot_attention, plot_attention_grid
from .labels import readable_piece
from .record import record_attention
from .views import View, seq2seq_views

__all__ = ["cross_attention", "draw_alignment", "translation_views"]


def _start(model, tgt_tok) -> int:
    """The id the decoder starts from: the model's own where its config names one (T5 starts
    from its pad id), else the target tokenizer's BOS."""
    start = getattr(model.config, "decoder_start_token_id", None)
    return tgt_tok.bos_id if start is None else start


def _pair(model, src_tok, tgt_tok, text: str, target: str | None, max_len: int | None):
    """(source ids, target ids ending in EOS): ``target`` encoded, or the greedy translation of ``text``."""
    device = next(model.parameters()).device
    src = src_tok.encode(text)
    if not src:
        raise ValueError("viz: the source text is empty")
    if target is not None:
        out = tgt_tok.encode(target)
        if not out:
            raise ValueError("viz: --target is empty")
        return src, out if out[-1] == tgt_tok.eos_id else out + [tgt_tok.eos_id]
    limit = 2 * len(src) + 10
    longest = context_of(model)                         # None: relative positions set no limit
    limit = max_len or (limit if longest is None else min(limit, longest))
    out = greedy_decode(model, torch.tensor([src], device=device), max_len=limit, bos_id=_start(model, tgt_tok),
                        eos_id=tgt_tok.eos_id, pad_id=tgt_tok.pad_id)[0].tolist()
    while out and out[-1] == tgt_tok.pad_id:
        out.pop()
    return src, out


def _pieces(tgt_tok, out: list[int]) -> list[str]:
    shown = out if out else [tgt_tok.eos_id]
    return [tgt_tok.tokens([i])[0] if i != tgt_tok.eos_id else "</s>" for i in shown]


@torch.no_grad()
def cross_attention(model, src_tok, tgt_tok, text: str, max_len: int | None = None, target: str | None = None):
    """Greedy-translate ``text`` (or take ``target``), then re-run the decoder on that output to
    collect the cross-attention weights. Returns (weights (L, H, T, S), source pieces, target
    pieces, translation); target row t is the step that *produced* target piece t."""
    model.eval()
    device = next(model.parameters()).device
    src_ids, out = _pair(model, src_tok, tgt_tok, text, target, max_len)
    src = torch.tensor([src_ids], device=device)
    bos = _start(model, tgt_tok)
    tgt_in = torch.tensor([[bos] + out[:-1]] if out else [[bos]], device=device)
    memory = model.encode(src)
    with record_attention(model) as record:
        model.decode(tgt_in, memory)
    cross = record.stack("cross")[:, 0]                             # (L, H, T, S)
    return cross, src_tok.tokens(src_ids), _pieces(tgt_tok, out), tgt_tok.decode(out)


def translation_views(model, src_tok, tgt_tok, text: str, target: str | None = None) -> tuple[list[View], str]:
    """(every attention of the translation as views: encoder self, decoder self, cross; the
    translation). Decoder row t is the step that produced target piece t, as in :func:`cross_attention`."""
    src_ids, out = _pair(model, src_tok, tgt_tok, text, target, None)
    bos = _start(model, tgt_tok)
    tgt_in = [bos] + out[:-1] if out else [bos]
    src_labels = [readable_piece(p) for p in src_tok.tokens(src_ids)]
    tgt_labels = [readable_piece(p) for p in _pieces(tgt_tok, out)]
    return seq2seq_views(model, src_ids, tgt_in, src_labels, tgt_labels), tgt_tok.decode(out)


def draw_alignment(model, src_tok, tgt_tok, text: str, path: str | Path, *, layer: int | None = None,
                   head: int | None = None, grid: bool = False, target: str | None = None) -> tuple[Path, str]:
    """Write the alignment PNG; returns (path, translation).

    Default: the average over all layers and heads. ``layer``/``head`` (1-based) pick one;
    ``grid`` draws every layer and head.
    """
    cross, src_pieces, tgt_pieces, translation = cross_attention(model, src_tok, tgt_tok, text, target=target)
    L, H = cross.shape[:2]
    if layer is not None and not 1 <= layer <= L:
        raise ValueError(f"viz: --layer must be in 1..{L}, got {layer}")
    if head is not None and not 1 <= head <= H:
        raise ValueError(f"viz: --head must be in 1..{H}, got {head}")
    if grid:
        return plot_attention_grid(cross, tgt_pieces, src_pieces, path, title=f"{text}\n-> {translation}"), translation
    w = cross if layer is None else cross[layer - 1: layer]
    w = w.mean(0)
    w = w.mean(0) if head is None else w[head - 1]
    what = ("all layers" if layer is None else f"layer {layer}") + (", mean of heads" if head is None else f", head {head}")
    title = f"cross-attention ({what})"
    return plot_attention(w, tgt_pieces, src_pieces, path, title=title), translation
