"""Text in, text out: streaming a causal LM's continuation as it is generated.

    result = complete(model, tokenizer, prompt_ids, 200, eos_ids=[tokenizer.eos_id], on_text=print)

The token-level loops live in :mod:`attnlab.generate`; this module turns their output columns
into text for a person watching: :class:`TextStreamer` decodes a short window of the newest
tokens after each token and hands over only the new text, holding back a trailing U+FFFD (the
first bytes of a character that a byte-level tokenizer spreads over several tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from .causal import generate
from .search import GenerationStats
from .state import context_of
from ..nn.kv_cache import KVCacheKind

__all__ = ["TextStreamer", "Completion", "complete"]


class TextStreamer:
    """A ``streamer`` for :func:`attnlab.generate.generate` (batch of one): ``emit(text)`` gets the
    text of each new token as soon as it is complete; :meth:`end` returns the whole continuation.

    Each token decodes a short window, not the whole text: the tokens since the last emitted
    piece, after those of the piece before it (``context``) so that a word's leading space or a
    merge across the boundary comes out as in the whole text. The new text is the window's decode
    less the decode of its first part; a decode ending in U+FFFD (the first bytes of a character
    that a byte-level tokenizer spreads over several tokens) is held back until the character is
    complete. The work per token is bounded by the window, so a reply costs time linear in its
    length (decoding the whole text after every token was quadratic). The pieces concatenate to
    the continuation :meth:`end` decodes once more from the whole, for a tokenizer whose decode of
    a longer sequence extends that of a shorter one (byte-level BPE, characters, words)."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], emit: Callable[[str], None] | None = None,
                 context: int = 4):
        self.tokenizer, self.ids, self.emit = tokenizer, list(prompt_ids), emit
        self.prompt = len(self.ids)
        self.start = max(0, self.prompt - context)      # the window's first token
        self.read = self.prompt                          # the tokens whose text has been emitted
        self.pieces: list[str] = []
        self.text = ""

    def __call__(self, column: Tensor) -> None:
        self.ids.append(int(column[0]))
        self._push()

    def _push(self) -> None:
        before = self.tokenizer.decode(self.ids[self.start:self.read])
        window = self.tokenizer.decode(self.ids[self.start:])
        if window.endswith("\ufffd") or len(window) <= len(before) or not window.startswith(before):
            return                          # an unfinished character, or nothing new yet
        piece = window[len(before):]
        self.start, self.read = self.read, len(self.ids)
        self.pieces.append(piece)
        self.text += piece
        if self.emit is not None:
            self.emit(piece)

    def end(self) -> str:
        """The continuation, decoded once from the whole (what was held back is emitted now)."""
        full = self.tokenizer.decode(self.ids)
        prefix = self.tokenizer.decode(self.ids[:self.prompt])
        text = full[len(prefix):] if full.startswith(prefix) else full
        if text.startswith(self.text) and len(text) > len(self.text):
            rest = text[len(self.text):]
            self.pieces.append(rest)
            if self.emit is not None:
                self.emit(rest)
        self.text = text
        return text


@dataclass
class Completion:
    text: str                          # the continuation only
    new_tokens: int
    max_new_tokens: int                # after capping at the context
    stats: GenerationStats = field(default_factory=GenerationStats)


def complete(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, *, eos_ids: Sequence[int] = (),
             temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float = 1.0, seed: int = 0, draft_model=None, num_draft_tokens: int = 4,
             on_text: Callable[[str], None] | None = None, kv_cache=None,
             prefill_chunk: int | None = None) -> Completion:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` (capped so that prompt + new tokens fit
    the context of the model and of the draft), stopping at any of ``eos_ids``; ``on_text`` gets
    the text as it is produced. ``draft_model`` turns on speculative decoding; ``kv_cache`` and
    ``prefill_chunk`` go to :func:`attnlab.generate.generate` (a sink cache has no context cap)."""
    sink = KVCacheKind.of(kv_cache).kind == "sink"
    contexts = [context_of(m) for m in (model, draft_model) if m is not None and not (m is model and sink)]
    context = min((c for c in contexts if c is not None), default=None)      # None: a model without positions
    budget = max_new_tokens if context is None else min(max_new_tokens, context - len(prompt_ids))
    if context is not None and budget < 1:
        raise ValueError(f"the prompt is {len(prompt_ids)} tokens long and fills the context of {context} tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    streamer = TextStreamer(tokenizer, prompt_ids, on_text)
    stats = GenerationStats()
    out = generate(model, torch.tensor([prompt_ids], device=device), budget, temperature, top_k, top_p,
                   eos_token_id=list(eos_ids) or None, draft_model=draft_model,
                   repetition_penalty=repetition_penalty, generator=generator,
                   num_draft_tokens=num_draft_tokens, streamer=streamer, stats=stats, kv_cache=kv_cache,
                   prefill_chunk=prefill_chunk)
    return Completion(streamer.end(), out.size(1) - len(prompt_ids), budget, stats)
