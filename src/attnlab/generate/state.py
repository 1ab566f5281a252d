"""Adaptors between a model and the decoding loops: one per kind of model.

The loops in :mod:`attnlab.generate.search` and :mod:`attnlab.generate.speculative` are
written once, against these methods, never against a model class or a cache's insides:

- ``rows``: the number N of rows being decoded; ``length``: the positions each row holds;
- ``logits(last=1) -> (N, last, V)``: the model's next-token logits at the last ``last``
  positions given so far (the last of them predicts the next token);
- ``append(tokens (N, m), real=None)``: give every row m more tokens;
- ``select(index)``: keep rows ``index`` in that order (beam search, finished rows leaving);
- ``can_rewind``: whether :meth:`rewind` works (the model's state says, see
  :class:`attnlab.nn.cache.DecodingState`); speculative decoding needs it;
- ``mark(start)``: no row will be rewound to fewer than ``start`` slots until the next rewind
  (a recurrent state keeps snapshots from there on);
- ``rewind(start, keep)``: row i keeps its first ``start + keep[i]`` slots (speculative
  decoding drops rejected drafts). Rows that keep fewer than the most, ``start + max(keep)``,
  keep the difference as holes so that all rows stay aligned (causal LMs; an encoder-decoder
  state accepts only calls that leave no hole); slots after that are forgotten.

Each adaptor owns the token history and the model's decoding state (``model.new_cache()``, an
object meeting :class:`attnlab.nn.cache.DecodingState`: a KV cache or a recurrent state); it
feeds the model only the positions the state has not consumed. Without a state
(``use_cache=False``) the whole history is recomputed each call (kept for equality tests).
"""
from __future__ import annotations

import torch
from torch import Tensor


def context_of(model) -> int | None:
    """The longest sequence ``model`` takes (None: no limit, as with relative positions or a
    recurrence), as its family states it once, ``register_family(limits=)``: every registered model
    answers ``model.input_limits()`` (attnlab.models.pretrained.SavePretrained). A model outside the
    registry (a test's toy) may state ``config.max_seq_len`` instead. Every check of a length in
    generation reads this, so a family's context is said in one place."""
    limits = getattr(model, "input_limits", None)
    if callable(limits):
        try:
            return limits()["context"]
        except ValueError:             # a class that inherits the method but is not registered
            pass
    return getattr(getattr(model, "config", None), "max_seq_len", None)


def new_state(model, kv_cache=None):
    """``model.new_cache()``, its self-attention caches of the kind ``kv_cache`` names (a
    :class:`~attnlab.nn.kv_cache.KVCacheKind`, a kind's name, or None for the model's own)."""
    from ..nn.kv_cache import KVCacheKind
    state = model.new_cache()
    kind = KVCacheKind.of(kv_cache)
    if kind.kind == "full" and kv_cache is None:
        return state
    if not callable(getattr(state, "use", None)):
        if kind.kind == "full":
            return state
        raise ValueError(f"kv_cache={kind.kind!r}: this model's decoding state is a {type(state).__name__}, not a "
                         f"KV cache (a recurrent state is already of constant size)")
    return state.use(kind)


def _check_rewind(who: str, start, keep: Tensor, length: int) -> int:
    """Validate ``rewind(start, keep)`` on ``length`` slots; return ``max(keep)``."""
    if isinstance(start, bool) or not isinstance(start, int) or not 0 < start <= length:
        raise ValueError(f"{who}.rewind: start must be an int in [1, {length}], got {start!r}")
    if not isinstance(keep, Tensor) or keep.dim() != 1 or keep.is_floating_point() or keep.numel() == 0 \
            or not 0 <= int(keep.min()) <= int(keep.max()) <= length - start:
        raise ValueError(f"{who}.rewind: keep must be an integer (rows,) tensor in [0, {length - start}], "
                         f"got {keep!r}")
    return int(keep.max())


def _rewind_cache(cache, start: int, keep: Tensor, kept: int) -> None:
    """Rewind the model's ``cache`` so that row i has consumed ``start + keep[i]`` slots, the rest up
    to ``start + kept`` holes, within what it has consumed (a draft's state has not yet seen its
    last token, which stays a slot to feed)."""
    if cache is not None:
        consumed = cache.length
        cache.rewind((start + keep).clamp(max=consumed), min(start + kept, consumed))


def _check_new(who: str, tokens: Tensor, rows: int) -> Tensor:
    tokens = tokens.view(rows, -1) if tokens.dim() < 2 else tokens
    if tokens.size(0) != rows:
        raise ValueError(f"{who}.append: expected tokens for {rows} rows, got shape {tuple(tokens.shape)}")
    return tokens.long()


class _Rewinding:
    """What both adaptors say of rewinding: the model's state decides (no state: the history is
    recomputed each call, so anything can be forgotten)."""
    cache = None

    @property
    def can_rewind(self) -> bool:
        return self.cache is None or bool(self.cache.can_rewind)

    def mark(self, start: int) -> None:
        if self.cache is not None:
            self.cache.mark(start)


class CausalState(_Rewinding):
    """A causal LM decoding N rows (``model(ids, attention_mask=, cache=) -> (N, T, V)``).

    ``seq`` (N, L) holds every *slot* of a row: its prompt with left padding, generated tokens
    and rejected draft tokens; ``mask`` (N, L) is True for the real ones. The model takes a
    row's positions from the cumulative sum of its mask, so a left-padded prompt decodes as it
    would alone and a hole shifts nothing. The model's state has consumed ``seq[:, :cache.length]``.

    Both live in buffers with room to spare, doubled when full, and ``seq`` / ``mask`` are views
    of their first L columns: appending a token writes one column instead of copying the whole
    history, so a step of a recurrent model costs the same after 100 tokens as after 100,000.
    """

    def __init__(self, model, input_ids: Tensor, attention_mask: Tensor | None = None, use_cache: bool = True,
                 kv_cache=None, prefill_chunk: int | None = None):
        self.model = model
        self.prefill_chunk = prefill_chunk
        ids = input_ids.long()
        mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None \
            else attention_mask.bool().to(ids.device)
        self._length = ids.size(1)
        # own copies (never the caller's tensors, which rewinding edits in place), with room to grow
        self._seq = self._room(ids, 2 * self._length + 64)
        self._mask = self._room(mask, self._seq.size(1))
        self.cache = new_state(model, kv_cache) if use_cache else None

    def _room(self, t: Tensor, capacity: int) -> Tensor:
        """``t`` (N, L) copied into the first L columns of a new (N, capacity) buffer."""
        out = t.new_zeros(t.size(0), capacity)
        out[:, :t.size(1)] = t
        return out

    @property
    def seq(self) -> Tensor:
        return self._seq[:, :self._length]

    @property
    def mask(self) -> Tensor:
        return self._mask[:, :self._length]

    @property
    def rows(self) -> int:
        return self._seq.size(0)

    @property
    def length(self) -> int:
        return self._length

    def logits(self, last: int = 1) -> Tensor:
        """Logits (N, last, V) at the last ``last`` slots; the model sees only unconsumed slots."""
        if self.cache is None:
            return self.model(self.seq, attention_mask=self.mask)[:, -last:]
        new = self.seq[:, self.cache.length:]
        if new.size(1) < last:
            raise RuntimeError(f"CausalState.logits: {new.size(1)} new slots, asked for the last {last}: "
                               f"append tokens before asking again")
        chunk = self.prefill_chunk
        while chunk is not None and self._length - self.cache.length > max(chunk, last):
            n = self.cache.length                    # a long prompt in pieces: the cache takes each in turn
            m = min(chunk, self._length - n - last)
            self.model(self._seq[:, n:n + m], attention_mask=self._mask[:, :n + m], cache=self.cache)
            new = self.seq[:, self.cache.length:]
        return self.model(new, attention_mask=self.mask, cache=self.cache)[:, -last:]

    def next_logits(self) -> Tensor:
        """Logits (N, V) for the token after every row."""
        return self.logits(1)[:, 0]

    def append(self, tokens: Tensor, real: Tensor | None = None) -> None:
        """Add slots ``tokens`` (N, m) (or (N,)); ``real`` (N, m) False marks holes."""
        tokens = _check_new("CausalState", tokens, self.rows)
        n, m = self._length, tokens.size(1)
        if n + m > self._seq.size(1):
            capacity = max(2 * self._seq.size(1), n + m)
            self._seq, self._mask = self._room(self.seq, capacity), self._room(self.mask, capacity)
        self._seq[:, n:n + m] = tokens
        self._mask[:, n:n + m] = True if real is None else real.bool()
        self._length = n + m

    def select(self, index: Tensor) -> None:
        self._seq, self._mask = self._seq.index_select(0, index), self._mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)

    def rewind(self, start: int, keep: Tensor) -> None:
        """Row i keeps its slots up to ``start + keep[i]``; the rest up to ``start + max(keep)``
        become holes (rejected drafts, kept so that all rows keep one length), the rest go."""
        kept = _check_rewind("CausalState", start, keep, self._length)
        keep = keep.to(self._seq.device)
        j = torch.arange(kept, device=keep.device)
        self._mask[:, start:start + kept] &= j < keep[:, None]
        self._length = start + kept
        _rewind_cache(self.cache, start, keep, kept)


_NO_HOLES = ("Seq2SeqState: an encoder-decoder state cannot hold holes (decoder positions count tokens); "
             "decode rows that may accept different numbers of draft tokens one at a time")


class Seq2SeqState(_Rewinding):
    """The decoder side of an encoder-decoder model during generation, N rows at a time.

    The model is anything with ``decode(tgt, memory, src_padding_mask, cache=) -> logits
    (N, T, V)`` and ``new_cache()`` (see :class:`attnlab.models.Transformer`). Holds the encoder
    ``memory`` (N, S, E), encoded once, the source mask, the tokens so far (N, 1 + t) starting
    with BOS, and with ``use_cache`` the decoder's state; memory rows follow the state's rows.
    Holes are not supported: decoder positions count tokens, not a mask.
    """

    def __init__(self, model, memory: Tensor, src_padding_mask: Tensor | None, bos_id: int,
                 use_cache: bool = True):
        self.model = model
        self.memory = memory
        self.src_padding_mask = src_padding_mask
        self.tokens = torch.full((memory.size(0), 1), bos_id, dtype=torch.long, device=memory.device)
        self.cache = model.new_cache() if use_cache else None

    @property
    def rows(self) -> int:
        return self.tokens.size(0)

    @property
    def length(self) -> int:
        return self.tokens.size(1)

    def logits(self, last: int = 1) -> Tensor:
        """Logits (N, last, V) after the last ``last`` tokens; the decoder sees only unconsumed ones."""
        if self.cache is None:
            return self.model.decode(self.tokens, self.memory, self.src_padding_mask)[:, -last:]
        new = self.tokens[:, self.cache.length:]
        if new.size(1) < last:
            raise RuntimeError(f"Seq2SeqState.logits: {new.size(1)} new tokens, asked for the last {last}: "
                               f"append a token before asking again")
        return self.model.decode(new, self.memory, self.src_padding_mask, cache=self.cache)[:, -last:]

    def next_logits(self) -> Tensor:
        """Logits (N, V) for the token after the current prefix."""
        return self.logits(1)[:, 0]

    def append(self, tokens: Tensor, real: Tensor | None = None) -> None:
        """Add tokens (N, m) (or one token (N,)) to every row."""
        if real is not None and not bool(real.all()):
            raise ValueError(_NO_HOLES)
        self.tokens = torch.cat([self.tokens, _check_new("Seq2SeqState", tokens, self.rows)], dim=1)

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` in that order (follow surviving beams, drop finished sources)."""
        self.tokens = self.tokens.index_select(0, index)
        self.memory = self.memory.index_select(0, index)
        if self.src_padding_mask is not None:
            self.src_padding_mask = self.src_padding_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)

    def rewind(self, start: int, keep: Tensor) -> None:
        """Keep the first ``start + keep[0]`` tokens (BOS included); every row must keep as many."""
        kept = _check_rewind("Seq2SeqState", start, keep, self.tokens.size(1))
        if not bool((keep == kept).all()):
            raise ValueError(_NO_HOLES)
        self.tokens = self.tokens[:, :start + kept]
        _rewind_cache(self.cache, start, keep.to(self.tokens.device), kept)
