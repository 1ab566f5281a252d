"""Text in, text out: streaming a causal LM's continuation as it is generated.

    result = complete(model, tokenizer, prompt_ids, 200, eos_ids=[tokenizer.eos_id], on_text=print)

The token-level loops live in :mod:`attnlab.generate`; this module turns their output columns
into text for a person watching: :class:`TextStreamer` decodes prompt + new tokens after each
token and hands over only the new text, holding back a trailing U+FFFD (the first bytes of a
character that a byte-level tokenizer spreads over several tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from .causal import generate
from .search import GenerationStats

__all__ = ["TextStreamer", "Completion", "complete"]


class TextStreamer:
    """A ``streamer`` for :func:`attnlab.generate.generate` (batch of one): ``emit(text)`` gets the
    text of each new token as soon as it is complete."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], emit: Callable[[str], None] | None = None):
        self.tokenizer, self.ids, self.emit = tokenizer, list(prompt_ids), emit
        self.prefix = tokenizer.decode(self.ids)
        self.sent = 0
        self.text = ""

    def __call__(self, column: Tensor) -> None:
        self.ids.append(int(column[0]))
        self._push(final=False)

    def _push(self, final: bool) -> None:
        full = self.tokenizer.decode(self.ids)
        self.text = full[len(self.prefix):] if full.startswith(self.prefix) else full
        if not final and self.text.endswith("\ufffd"):
            return
        if self.emit is not None and len(self.text) > self.sent:
            self.emit(self.text[self.sent:])
        self.sent = max(self.sent, len(self.text))

    def end(self) -> str:
        self._push(final=True)
        return self.text


@dataclass
class Completion:
    text: str                          # the continuation only
    new_tokens: int
    max_new_tokens: int                # after capping at the context
    stats: GenerationStats = field(default_factory=GenerationStats)


def complete(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, *, eos_ids: Sequence[int] = (),
             temperature: float = 0.8, top_k: int | None = None, top_p: float | None = None,
             repetition_penalty: float = 1.0, seed: int = 0, draft_model=None, num_draft_tokens: int = 4,
             on_text: Callable[[str], None] | None = None) -> Completion:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` (capped so that prompt + new tokens fit
    the context of the model and of the draft), stopping at any of ``eos_ids``; ``on_text`` gets
    the text as it is produced. ``draft_model`` turns on speculative decoding."""
    contexts = [getattr(m.config, "max_seq_len", None) for m in (model, draft_model) if m is not None]
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
                   num_draft_tokens=num_draft_tokens, streamer=streamer, stats=stats)
    return Completion(streamer.end(), out.size(1) - len(prompt_ids), budget, stats)
