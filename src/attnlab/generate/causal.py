"""Causal-LM generation: one prefill then cached steps; speculative decoding with a draft model."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..nn.cache import LayerCaches
from .sampling import _check_sampling, _draw, apply_repetition_penalty, sample, seen_tokens, token_probs


# ---------------------------------------------------------------------------- causal language models
@dataclass
class GenerationStats:
    """Counters that :func:`generate` fills in when given one (``stats=GenerationStats()``).

    ``new_tokens`` is the number of generated columns of the output; ``drafted`` / ``accepted``
    count draft tokens over all rows (speculative decoding only).
    """
    target_passes: int = 0
    draft_passes: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def target_passes_per_token(self) -> float:
        return self.target_passes / max(self.new_tokens, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.drafted, 1)


def truncate_cache(cache: LayerCaches, length: int) -> None:
    """Roll a causal LM's cache back to its first ``length`` positions (speculative decoding drops
    rejected draft tokens this way). A :class:`~attnlab.nn.cache.KVCache` reads its buffers up to
    ``length`` and writes the next keys/values at ``length``, so lowering ``length`` on every layer
    forgets the later positions without copying or freeing anything."""
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= cache.length:
        raise ValueError(f"truncate_cache: length must be an int in [0, {cache.length}], got {length!r}")
    for layer in cache.self_attn:
        layer.length = length


class _Sequences:
    """The rows of a batch still generating, and the output of all B rows.

    ``seq`` (N, L) holds every *slot* a live row has (prompt, left padding, generated tokens,
    rejected draft tokens) and ``mask`` (N, L) is True for the real ones, so a row's positions
    are the cumulative sum of its mask (pitfall 11) and a cache of length c has seen ``seq[:, :c]``.
    ``out`` (B, n) receives each row's tokens; a row is done at EOS or after n tokens, and is then
    filled with ``fill``. ``seen`` (N, V) backs the repetition penalty (None without one).
    """

    def __init__(self, input_ids: Tensor, mask: Tensor, max_new_tokens: int, eos: Tensor | None, fill: int,
                 vocab_size: int, penalty: float):
        B, device = input_ids.size(0), input_ids.device
        self.seq, self.mask, self.eos, self.max_new = input_ids, mask, eos, max_new_tokens
        self.rows = torch.arange(B, device=device)
        self.out = torch.full((B, max_new_tokens), fill, dtype=torch.long, device=device)
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.seen = seen_tokens(input_ids, vocab_size, mask) if penalty != 1.0 else None
        self.penalty, self.emitted = penalty, 0

    def unseen(self, cache: LayerCaches | None) -> Tensor:
        """The slots ``cache`` has not seen (all of them without a cache)."""
        return self.seq if cache is None else self.seq[:, cache.length:]

    def remaining(self) -> int:
        """The fewest tokens a live row may still produce."""
        return self.max_new - int(self.count[self.rows].max())

    def commit(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Give live row i the tokens ``tokens[i, :lengths[i]]`` (cut after EOS or at max_new_tokens);
        return which live rows are now done (N,)."""
        N, m = tokens.shape
        j = torch.arange(m, device=tokens.device)
        count = self.count[self.rows]
        n = torch.minimum(lengths, self.max_new - count)
        ended = torch.zeros(N, dtype=torch.bool, device=tokens.device)
        if self.eos is not None:
            is_eos = torch.isin(tokens, self.eos) & (j < n[:, None])
            ended = is_eos.any(1)
            n = torch.where(ended, is_eos.long().argmax(1) + 1, n)
        keep = j < n[:, None]
        self.out[self.rows[:, None].expand(N, m)[keep], (count[:, None] + j)[keep]] = tokens[keep]
        self.count[self.rows] = count + n
        finished = ended | (count + n >= self.max_new)
        self.done[self.rows] = finished
        return finished

    def extend(self, tokens: Tensor, real: Tensor | None = None) -> None:
        """Append slots ``tokens`` (N, m), ``real`` (N, m) False for rejected drafts."""
        real = torch.ones_like(tokens, dtype=torch.bool) if real is None else real
        self.seq = torch.cat([self.seq, tokens], dim=1)
        self.mask = torch.cat([self.mask, real], dim=1)
        if self.seen is not None:
            self.seen |= seen_tokens(tokens, self.seen.size(1), real)

    def keep(self, alive: Tensor, caches: list[LayerCaches | None]) -> None:
        """Drop the finished rows from the batch and from every cache."""
        if bool(alive.all()):
            return
        index = alive.nonzero()[:, 0]
        self.seq, self.mask, self.rows = self.seq[index], self.mask[index], self.rows[index]
        if self.seen is not None:
            self.seen = self.seen[index]
        for cache in caches:
            if cache is not None:
                cache.reorder(index)

    def penalize(self, logits: Tensor, drafts: Tensor | None = None) -> Tensor:
        """Apply the repetition penalty to ``logits`` (N, V) or (N, k + 1, V). With ``drafts`` (N, k)
        position i also counts drafts 1..i as seen; (N, V) logits are then those after all k."""
        if self.seen is None:
            return logits
        seen = self.seen[:, None]                                                       # (N, 1, V)
        if drafts is not None and drafts.size(1):
            so_far = torch.nn.functional.one_hot(drafts, seen.size(-1)).cumsum(1) > 0      # (N, k, V)
            seen = torch.cat([seen, seen | so_far], dim=1)                              # (N, k + 1, V)
        return apply_repetition_penalty(logits, seen if logits.dim() == 3 else seen[:, -1], self.penalty)

    def stream(self, streamer) -> None:
        """Hand ``streamer`` every output column that all rows have now produced."""
        if streamer is None:
            return
        live = ~self.done
        ready = int(self.count[live].min()) if bool(live.any()) else int(self.count.max())
        for column in range(self.emitted, ready):
            streamer(self.out[:, column])
        self.emitted = max(self.emitted, ready)

    def result(self, input_ids: Tensor) -> Tensor:
        return torch.cat([input_ids, self.out[:, :int(self.count.max())]], dim=1)


def _plain_loop(model, state: _Sequences, sampling: tuple, generator, use_cache: bool, stats: GenerationStats,
                streamer) -> None:
    """One prefill, then one cached step per token."""
    cache = model.new_cache() if use_cache else None
    while True:
        logits = model(state.unseen(cache), attention_mask=state.mask, cache=cache)[:, -1]
        stats.target_passes += 1
        token = sample(state.penalize(logits), *sampling, generator=generator)
        finished = state.commit(token[:, None], torch.ones_like(token))
        state.stream(streamer)
        if bool(finished.all()):
            return
        state.extend(token[:, None])
        state.keep(~finished, [cache])


def _draft_sample(logits: Tensor, sampling: tuple, generator) -> tuple[Tensor, Tensor]:
    """A draft token and the distribution q it was drawn from: the same tensor, after temperature,
    top-k and top-p, so the accept test uses exactly q (pitfall 13)."""
    q = token_probs(logits, *sampling)
    return _draw(q, generator), q


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)): where to sample after a rejection (p itself if p <= q everywhere, which
    only rounding can produce: then nothing is ever rejected)."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _propose(draft, cache: LayerCaches, state: _Sequences, k: int, sampling: tuple, generator,
             stats: GenerationStats, V: int) -> tuple[Tensor, Tensor]:
    """k draft tokens (N, k) drawn autoregressively with the draft's cache, and their q (N, k, V)."""
    N, device = state.seq.size(0), state.seq.device
    tokens, probs = [torch.empty(N, 0, dtype=torch.long, device=device)], [torch.empty(N, 0, V, device=device)]
    x, mask = state.unseen(cache), state.mask
    for _ in range(k):
        logits = draft(x, attention_mask=mask, cache=cache)[:, -1]
        stats.draft_passes += 1
        token, q = _draft_sample(state.penalize(logits, torch.cat(tokens, 1)), sampling, generator)
        tokens.append(token[:, None])
        probs.append(q[:, None])
        x, mask = token[:, None], torch.cat([mask, mask.new_ones(N, 1)], dim=1)
    return torch.cat(tokens, 1), torch.cat(probs, 1)


def _verify(drafts: Tensor, q: Tensor, p: Tensor, generator) -> tuple[Tensor, Tensor]:
    """Speculative sampling's accept step (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    drafts (N, k) drawn from q (N, k, V); p (N, k + 1, V) the target's distributions at the same
    positions plus one. Draft i is accepted with probability min(1, p_i(d) / q_i(d)) while all
    before it were; at the first rejection the next token comes from norm(max(0, p - q)), and
    after k acceptances from p_{k+1}. Returns the accepted counts n (N,) and the next token (N,).
    With one-hot p and q (temperature 0) this is: accept while the argmaxes agree, then the
    target's argmax.
    """
    N, k = drafts.shape
    n = torch.zeros(N, dtype=torch.long, device=drafts.device)
    if k:
        p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]
        q_d = q.gather(-1, drafts[..., None])[..., 0]
        u = torch.rand(N, k, generator=generator, device=drafts.device)
        n = (u * q_d < p_d).long().cumprod(1).sum(1)
    rows = torch.arange(N, device=drafts.device)
    q_next = torch.cat([q, q.new_zeros(N, 1, q.size(-1))], dim=1)[rows, n]           # 0 after k accepts
    return n, _draw(_residual(p[rows, n], q_next), generator)


def _speculative_loop(target, draft, state: _Sequences, k: int, sampling: tuple, generator,
                      stats: GenerationStats, streamer) -> None:
    """Each round the draft proposes up to k tokens, the target scores them in one pass, and
    both caches are rolled back to the longest accepted prefix. Rows of a batch that accepted
    fewer drafts than the longest keep their rejected slots masked out (holes)."""
    target_cache, draft_cache = target.new_cache(), draft.new_cache()
    V = target.config.vocab_size
    if sampling[0] == 0:        # one-hot p and q decide alone: leave the caller's RNG untouched, as plain greedy does
        generator = torch.Generator(state.seq.device)
    while True:
        k_now = min(k, state.remaining() - 1)               # never past max_new_tokens (nor the context)
        drafts, q = _propose(draft, draft_cache, state, k_now, sampling, generator, stats, V)
        L, N = state.seq.size(1), drafts.size(0)
        seq = torch.cat([state.seq, drafts], dim=1)
        mask = torch.cat([state.mask, state.mask.new_ones(N, k_now)], dim=1)
        logits = target(seq[:, target_cache.length:], attention_mask=mask, cache=target_cache)[:, -(k_now + 1):]
        stats.target_passes += 1
        p = token_probs(state.penalize(logits, drafts), *sampling)
        n, token = _verify(drafts, q, p, generator)
        stats.drafted, stats.accepted = stats.drafted + N * k_now, stats.accepted + int(n.sum())
        new = torch.cat([drafts, drafts.new_zeros(N, 1)], dim=1).scatter_(1, n[:, None], token[:, None])
        finished = state.commit(new, n + 1)
        state.stream(streamer)
        if bool(finished.all()):
            return
        m = int(n.max())
        truncate_cache(target_cache, L + m)
        truncate_cache(draft_cache, min(draft_cache.length, L + m))
        real = torch.arange(m + 1, device=n.device)[None] < n[:, None]           # accepted drafts
        real[:, m] = True
        state.extend(torch.cat([drafts[:, :m], token[:, None]], dim=1), real)
        state.keep(~finished, [target_cache, draft_cache])


def _ids_list(name: str, value, V: int) -> list[int]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < V for v in values):
        raise ValueError(f"generate: {name} must be a token id (or ids) in [0, vocab_size={V}), got {value!r}")
    return values


def _check_causal(model, draft_model, input_ids, attention_mask, max_new_tokens: int, opts: dict) -> Tensor:
    """Validate :func:`generate`'s arguments; return the (B, T) bool attention mask."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or 0 in input_ids.shape \
            or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError(f"generate: input_ids must be a non-empty integer (batch, seq) tensor, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} "
                         f"{tuple(getattr(input_ids, 'shape', ()))}")
    V = model.config.vocab_size
    lo, hi = (int(v) for v in input_ids.aminmax())
    if lo < 0 or hi >= V:
        raise ValueError(f"generate: token id {hi if hi >= V else lo} is out of range [0, vocab_size={V})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask
    if not isinstance(mask, Tensor) or mask.shape != input_ids.shape or mask.is_floating_point() \
            and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(f"generate: attention_mask must be a 0/1 or bool tensor of shape {tuple(input_ids.shape)}")
    mask = mask.bool().to(input_ids.device)
    if not bool(mask[:, -1].all()):
        raise ValueError("generate: every prompt must end with a real token: pad batched prompts on the LEFT")
    longest = int(mask.sum(-1).max())
    for who, m in (("the model", model), ("the draft model", draft_model)):
        if m is not None and longest + max_new_tokens > m.config.max_seq_len:
            raise ValueError(f"generate: {longest} prompt + {max_new_tokens} new tokens exceed {who}'s context of "
                             f"{m.config.max_seq_len} tokens")
    if draft_model is not None:
        if draft_model.config.vocab_size != V:
            raise ValueError(f"generate: the draft model's vocab_size {draft_model.config.vocab_size} differs from "
                             f"the model's {V}")
        k = opts["num_draft_tokens"]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"generate: num_draft_tokens must be an int >= 1, got {k!r}")
        if not opts["use_cache"]:
            raise ValueError("generate: speculative decoding (draft_model) needs use_cache=True")
    _check_sampling("generate", opts["temperature"], opts["top_k"], opts["top_p"])
    penalty = opts["repetition_penalty"]
    if not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"generate: repetition_penalty must be a finite number > 0, got {penalty!r}")
    if opts["streamer"] is not None and not callable(opts["streamer"]):
        raise ValueError("generate: streamer must be a callable taking a (batch,) tensor of token ids")
    return mask


@torch.no_grad()
def generate(model, input_ids: Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None, draft_model=None, *,
             attention_mask: Tensor | None = None, repetition_penalty: float = 1.0,
             generator: torch.Generator | None = None, num_draft_tokens: int = 4, streamer=None,
             pad_token_id: int | None = None, use_cache: bool = True,
             stats: GenerationStats | None = None) -> Tensor:
    """Continue the prompts ``input_ids`` (B, T) of a causal LM -> (B, T + n), n <= max_new_tokens.

    ``model`` is a :class:`~attnlab.models.CausalLM` (anything with ``forward(ids, attention_mask,
    cache=)``, ``new_cache()`` and ``config.vocab_size`` / ``config.max_seq_len``). One prefill of
    the prompts, then one cached step per token. Prompts of different lengths are LEFT-padded with
    ``attention_mask`` (B, T) (1 = real token); the mask grows by one column per token and the
    model takes positions from its cumulative sum, so a row generates what its prompt alone would.

    Each token is drawn from :func:`token_probs` of the logits after ``repetition_penalty`` (CTRL:
    for tokens already in the row, prompt included, padding excluded); temperature 0 is greedy.
    A row ends at ``eos_token_id`` (one id or several) or after ``max_new_tokens``; a finished row
    emits ``pad_token_id`` (default: the EOS id) until every row has finished, then the loop stops.
    ``streamer(column)`` gets each output column (B,) once every row has produced it.

    ``draft_model`` (same vocabulary) turns on speculative decoding: it proposes
    ``num_draft_tokens`` tokens per round, the model scores them in one pass, and the accept /
    resample rule of :func:`_verify` keeps the output distribution the model's own; greedy output
    is identical to plain greedy. ``stats`` (a :class:`GenerationStats`) counts forward passes.
    ``use_cache=False`` recomputes the whole prefix each step (for tests). Models keep their
    train/eval mode: call ``.eval()`` first, or dropout makes every pass random.
    """
    opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                num_draft_tokens=num_draft_tokens, use_cache=use_cache, streamer=streamer)
    mask = _check_causal(model, draft_model, input_ids, attention_mask, max_new_tokens, opts)
    V = model.config.vocab_size
    eos = None if eos_token_id is None else _ids_list("eos_token_id", eos_token_id, V)
    fill = _ids_list("pad_token_id", pad_token_id, V)[0] if pad_token_id is not None else eos[0] if eos else 0
    input_ids = input_ids.long()
    state = _Sequences(input_ids, mask, max_new_tokens, None if eos is None else torch.tensor(eos, device=mask.device),
                       fill, V, repetition_penalty)
    stats = GenerationStats() if stats is None else stats
    sampling = (temperature, top_k, top_p)
    if draft_model is None:
        _plain_loop(model, state, sampling, generator, use_cache, stats, streamer)
    else:
        _speculative_loop(model, draft_model, state, num_draft_tokens, sampling, generator, stats, streamer)
    out = state.result(input_ids)
    stats.new_tokens += out.size(1) - input_ids.size(1)
    return out
