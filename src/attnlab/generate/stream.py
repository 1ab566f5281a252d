"""Reading a long text through a model's decoding state: every token predicted from what the state
kept of everything before it (a KV cache of some kind, or a recurrent state), the text fed a chunk
at a time, so that memory is that of the state and one chunk, whatever the text's length."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .state import new_state


@torch.no_grad()
def stream_logits(model, ids: Tensor, chunk: int = 256, kv_cache=None,
                  on_chunk: Callable[[int, Tensor], None] | None = None):
    """Feed ``ids`` (L,) or (1, L) to ``model`` ``chunk`` tokens per call through one decoding state
    (``kv_cache`` as in :func:`attnlab.generate.generate`); ``on_chunk(start, logits (n, V))`` gets
    each call's logits, those at positions start .. start + n - 1. Returns the state."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"stream_logits: chunk must be an int >= 1, got {chunk!r}")
    ids = ids.view(1, -1).long()
    state = new_state(model, kv_cache)
    for start in range(0, ids.size(1), chunk):
        logits = model(ids[:, start:start + chunk], cache=state)[0]
        if on_chunk is not None:
            on_chunk(start, logits)
    return state


def stream_nll(model, ids: Tensor, chunk: int = 256, kv_cache=None) -> Tensor:
    """(L - 1,) float64 negative log-likelihood of each token of ``ids`` after the first, the text
    read once through one decoding state (see :func:`stream_logits`)."""
    ids = ids.view(-1).long()
    out = torch.empty(ids.numel() - 1, dtype=torch.float64, device=ids.device)

    def take(start: int, logits: Tensor) -> None:
        n = min(logits.size(0), ids.numel() - 1 - start)
        if n > 0:
            lp = torch.log_softmax(logits[:n].double(), -1)
            out[start:start + n] = -lp.gather(-1, ids[start + 1:start + 1 + n, None])[:, 0]

    stream_logits(model, ids, chunk, kv_cache, take)
    return out
