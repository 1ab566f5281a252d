"""The cross-attention alignment of a translation: which source tokens each target token read."""
from __future__ import annotations

from pathlib import Path

import torch

from ..generate import greedy_decode
from .attention import plot_attention, plot_attention_grid
from .record import record_attention

__all__ = ["cross_attention", "draw_alignment"]


@torch.no_grad()
def cross_attention(model, src_tok, tgt_tok, text: str, max_len: int | None = None):
    """Greedy-translate ``text``, then re-run the decoder on its own output to collect the
    cross-attention weights. Returns (weights (L, H, T, S), source pieces, target pieces,
    translation); target row t is the step that *produced* target piece t."""
    model.eval()
    device = next(model.parameters()).device
    src = torch.tensor([src_tok.encode(text)], device=device)
    if src.size(1) == 0:
        raise ValueError("viz: the source text is empty")
    limit = 2 * src.size(1) + 10
    longest = getattr(model.config, "max_seq_len", None)     # None: relative positions (T5) set no limit
    limit = max_len or (limit if longest is None else min(limit, longest))
    out = greedy_decode(model, src, max_len=limit, bos_id=tgt_tok.bos_id, eos_id=tgt_tok.eos_id,
                        pad_id=tgt_tok.pad_id)[0].tolist()
    while out and out[-1] == tgt_tok.pad_id:
        out.pop()
    tgt_in = torch.tensor([[tgt_tok.bos_id] + out[:-1]] if out else [[tgt_tok.bos_id]], device=device)
    memory = model.encode(src)
    with record_attention(model) as record:
        model.decode(tgt_in, memory)
    cross = record.stack("cross")[:, 0]                             # (L, H, T, S)
    shown = out if out else [tgt_tok.eos_id]
    targets = [tgt_tok.tokens([i])[0] if i != tgt_tok.eos_id else "</s>" for i in shown]
    return cross, src_tok.tokens(src[0].tolist()), targets, tgt_tok.decode(out)


def draw_alignment(model, src_tok, tgt_tok, text: str, path: str | Path, *, layer: int | None = None,
                   head: int | None = None, grid: bool = False) -> tuple[Path, str]:
    """Write the alignment PNG; returns (path, translation).

    Default: the average over all layers and heads. ``layer``/``head`` (1-based) pick one;
    ``grid`` draws every layer and head.
    """
    cross, src_pieces, tgt_pieces, translation = cross_attention(model, src_tok, tgt_tok, text)
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
