"""Decoding: sampling filters, greedy and beam search for encoder-decoder models, translate,
and causal-LM generation with speculative decoding.

Glossary: B sources, K beams, S source length, t tokens generated so far, V vocabulary;
for causal LMs N live rows, L cache slots, k draft tokens.

An encoder-decoder model is anything with ``encode(src, src_padding_mask) -> memory``,
``new_cache() -> LayerCaches`` and ``decode(tgt, memory, src_padding_mask, cache=cache) ->
(logits, _)`` (see attnlab.models.transformer). Generation lives here, outside the model:
the source is encoded once, then one loop asks :class:`Seq2SeqState` for the next-token
logits, picks tokens and appends them. With the cache the decoder sees only the new token
each step; without it the whole prefix is recomputed (kept for the equality tests).

Conventions shared by every function here:

- outputs never contain BOS and contain EOS where the model produced it; a hypothesis that
  reaches ``max_len`` without EOS ends there;
- ``max_len`` counts generated tokens, EOS included; it may be one int or one per source,
  so that a source decodes the same alone or in any batch;
- the source padding mask is (B, S) bool, True for real tokens; when it is None and the
  model's config has a ``pad_id``, it is derived from the ids (as ``Transformer.forward`` does).

The sampling filters are pure functions of a (..., V) logits tensor, for every decoder.

A causal LM (:class:`attnlab.models.CausalLM`) generates with :func:`generate`: one prefill,
then one cached step per token, left-padded batches, repetition penalty, EOS stopping, a
streamer, and speculative decoding with a draft model (Leviathan et al. 2023; Chen et al.
2023), whose rejected tokens are dropped from both caches by :func:`truncate_cache`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .nn.cache import LayerCaches

__all__ = ["top_k_filter", "top_p_filter", "token_probs", "sample", "seen_tokens", "apply_repetition_penalty",
           "Seq2SeqState", "greedy_decode", "Hypothesis",
           "beam_search", "beam_search_nbest", "translate", "GenerationStats", "truncate_cache", "generate"]

MaxLen = int | Sequence[int] | Tensor


# ---------------------------------------------------------------------------- sampling
def top_k_filter(logits: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest logits of each row (last dim), set the others to -inf.

    Exactly ``k`` survive even when values tie; ``k >= V`` returns the logits unchanged.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_k_filter: k must be an int >= 1, got {k!r}")
    if k >= logits.size(-1):
        return logits
    index = logits.topk(k, dim=-1).indices
    return torch.full_like(logits, float("-inf")).scatter(-1, index, logits.gather(-1, index))


def top_p_filter(logits: Tensor, p: float) -> Tensor:
    """Nucleus filter: keep the smallest set of most likely tokens whose probability is >= p.

    A token survives when the probability of the tokens ranked above it is still < p, so the
    most likely token always survives. ``p = 1`` returns the logits unchanged.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p_filter: p must be in (0, 1], got {p!r}")
    if p == 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    cumulative = sorted_logits.float().softmax(dim=-1).cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    keep = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before < p)
    return logits.masked_fill(~keep, float("-inf"))


def _check_sampling(who: str, temperature, top_k, top_p) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"{who}: temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{who}: top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"{who}: top_p must be None or in (0, 1], got {top_p!r}")


def token_probs(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None) -> Tensor:
    """The distribution :func:`sample` draws from: logits (..., V) -> float32 probabilities (..., V).

    Logits / temperature, then top-k, then top-p, then softmax. Temperature 0 gives the one-hot
    of the argmax (greedy as a distribution; speculative decoding relies on it).
    """
    _check_sampling("token_probs", temperature, top_k, top_p)
    if temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    scores = logits.float() / temperature
    if top_k is not None:
        scores = top_k_filter(scores, top_k)
    if top_p is not None:
        scores = top_p_filter(scores, top_p)
    return scores.softmax(dim=-1)


def _draw(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """One index per row of ``probs`` (..., V) -> (...)."""
    return torch.multinomial(probs.reshape(-1, probs.size(-1)), 1, generator=generator).view(probs.shape[:-1])


def sample(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> Tensor:
    """Draw one token id per row of ``logits`` (..., V) -> (...) from :func:`token_probs`.

    ``temperature`` 0 is argmax (deterministic; the filters cannot change the argmax). Otherwise
    the logits are divided by the temperature, then filtered by top-k, then by top-p, then sampled.
    """
    _check_sampling("sample", temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    return _draw(token_probs(logits, temperature, top_k, top_p), generator)


def seen_tokens(input_ids: Tensor, vocab_size: int, attention_mask: Tensor | None = None) -> Tensor:
    """(B, V) bool: True for every token id present in a row of ``input_ids`` (B, T), padding
    (``attention_mask`` False/0) excluded. The set the repetition penalty acts on."""
    ids = input_ids.long()
    real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    seen = torch.zeros(ids.size(0), vocab_size + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, ids.masked_fill(~real, vocab_size), True)[:, :vocab_size]


def apply_repetition_penalty(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's repetition penalty (Keskar et al. 2019, section 4.1), as transformers applies it: the
    logit of every token in ``seen`` (bool, broadcastable to ``logits`` (..., V)) is divided by
    ``penalty`` when positive and multiplied by it when negative; 1.0 changes nothing."""
    if not (isinstance(penalty, (int, float)) and math.isfinite(penalty) and penalty > 0):
        raise ValueError(f"apply_repetition_penalty: penalty must be a finite number > 0, got {penalty!r}")
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


# ---------------------------------------------------------------------------- decoder state
class Seq2SeqState:
    """The decoder side of an encoder-decoder model during generation, N rows at a time.

    Holds the encoder ``memory`` (N, S, E), the source mask, the tokens so far (N, 1 + t)
    starting with BOS, and with ``use_cache`` the model's cache: :meth:`next_logits` then feeds
    the decoder only the tokens the cache has not seen, otherwise the whole prefix.
    """

    def __init__(self, model, memory: Tensor, src_padding_mask: Tensor | None, bos_id: int,
                 use_cache: bool = True):
        self.model = model
        self.memory = memory
        self.src_padding_mask = src_padding_mask
        self.tokens = torch.full((memory.size(0), 1), bos_id, dtype=torch.long, device=memory.device)
        self.cache = model.new_cache() if use_cache else None

    def next_logits(self) -> Tensor:
        """Logits (N, V) for the token after the current prefix."""
        if self.cache is None:
            logits, _ = self.model.decode(self.tokens, self.memory, self.src_padding_mask)
        else:
            new = self.tokens[:, self.cache.length:]
            if new.size(1) == 0:
                raise RuntimeError("Seq2SeqState.next_logits: append a token before asking again")
            logits, _ = self.model.decode(new, self.memory, self.src_padding_mask, cache=self.cache)
        return logits[:, -1]

    def append(self, tokens: Tensor) -> None:
        """Add one token (N,) to every row."""
        self.tokens = torch.cat([self.tokens, tokens.view(-1, 1).to(self.tokens)], dim=1)

    def select(self, index: Tensor) -> None:
        """Keep rows ``index`` in that order (follow surviving beams, drop finished sources)."""
        self.tokens = self.tokens.index_select(0, index)
        self.memory = self.memory.index_select(0, index)
        if self.src_padding_mask is not None:
            self.src_padding_mask = self.src_padding_mask.index_select(0, index)
        if self.cache is not None:
            self.cache.reorder(index)


# ---------------------------------------------------------------------------- checks
def _check_id(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


def _prepare(model, src: Tensor, src_padding_mask: Tensor | None, max_len: MaxLen, who: str,
             **ids: int) -> tuple[Tensor, Tensor | None, list[int]]:
    """Validate the inputs; return src as long, the source mask and one max_len per source."""
    if not isinstance(src, Tensor) or src.dim() != 2 or src.dtype.is_floating_point or src.dtype == torch.bool \
            or src.is_complex():
        raise ValueError(f"{who}: src must be a 2-D integer tensor (batch, seq), got "
                         f"{getattr(src, 'dtype', type(src).__name__)} {tuple(getattr(src, 'shape', ()))}")
    B, S = src.shape
    if B == 0 or S == 0:
        raise ValueError(f"{who}: src must have at least one row and one position, got shape {(B, S)}")
    for name, value in ids.items():
        _check_id(f"{who}: {name}", value)
    config = getattr(model, "config", None)
    if src_padding_mask is None and getattr(config, "pad_id", None) is not None:
        src_padding_mask = src != config.pad_id
    if src_padding_mask is not None and (not isinstance(src_padding_mask, Tensor) or src_padding_mask.dtype
                                         != torch.bool or src_padding_mask.shape != src.shape):
        raise ValueError(f"{who}: src_padding_mask must be a bool tensor of shape {(B, S)} (True = real token), got "
                         f"{getattr(src_padding_mask, 'dtype', type(src_padding_mask).__name__)} "
                         f"{tuple(getattr(src_padding_mask, 'shape', ()))}")
    limits = max_len.tolist() if isinstance(max_len, Tensor) else max_len
    limits = [limits] * B if isinstance(limits, int) and not isinstance(limits, bool) else list(limits)
    if len(limits) != B or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise ValueError(f"{who}: max_len must be an int >= 1 or one such int per source ({B}), got {max_len!r}")
    longest = getattr(config, "max_seq_len", None)
    if longest is not None and max(limits) > longest:
        raise ValueError(f"{who}: max_len {max(limits)} exceeds the model's max_seq_len {longest}")
    return src.long(), src_padding_mask, limits


# ---------------------------------------------------------------------------- greedy
@torch.no_grad()
def greedy_decode(model, src: Tensor, src_padding_mask: Tensor | None = None, *, max_len: MaxLen,
                  bos_id: int, eos_id: int, pad_id: int = 0, use_cache: bool = True) -> Tensor:
    """Greedy decoding of a batch of sources -> tokens (B, L), L <= max(max_len).

    Each row is the argmax continuation up to and including EOS, then ``pad_id``. A row stops
    at EOS or at its own max_len; finished rows leave the batch, and the loop ends when none
    is left. ``use_cache=False`` recomputes the whole prefix every step (same result).
    """
    src, mask, limits = _prepare(model, src, src_padding_mask, max_len, "greedy_decode",
                                 bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    B = src.size(0)
    state = Seq2SeqState(model, model.encode(src, mask), mask, bos_id, use_cache)
    rows = torch.arange(B, device=src.device)              # source of each live row
    limit = torch.tensor(limits, device=src.device)
    out = torch.full((B, max(limits)), pad_id, dtype=torch.long, device=src.device)
    for step in range(max(limits)):
        # topk(1), not argmax, so that beam_size=1 (which ranks with topk) ties the same way
        token = state.next_logits().topk(1, dim=-1).indices[:, 0]
        out[rows, step] = token
        done = (token == eos_id) | (limit[rows] <= step + 1)
        if bool(done.all()):
            return out[:, :step + 1]
        state.append(token)
        if bool(done.any()):
            keep = (~done).nonzero()[:, 0]
            state.select(keep)
            rows = rows[keep]
    return out


# ---------------------------------------------------------------------------- beam search
@dataclass
class Hypothesis:
    """One finished beam: ``tokens`` without BOS, ending with EOS unless cut at max_len.

    ``score`` is the sum of the tokens' log-probabilities; ``normalized_score`` =
    score / len(tokens) ** length_penalty ranks the hypotheses.
    """
    tokens: list[int]
    score: float
    normalized_score: float


def _normalize(score: float, length: int, alpha: float) -> float:
    return score / length ** alpha


def _best_possible(score: float, length: int, limit: int, alpha: float) -> float:
    """An upper bound on the normalized score of any completion of a live beam.

    The beam has ``length`` tokens and log-prob sum ``score`` <= 0. A completion adds
    log-probs <= 0, so its sum s <= score, and ends at a length L in [length + 1, limit].
    Then s / L**alpha <= score / L**alpha, and score / L**alpha is monotonic in L (rising for
    alpha > 0 because score <= 0, falling for alpha < 0), so its maximum is at an end of the
    range: for alpha > 0 that is L = limit, i.e. score / limit**alpha.
    """
    return max(_normalize(score, length + 1, alpha), _normalize(score, limit, alpha))


def _beam_step(state: Seq2SeqState, scores: Tensor, K: int) -> tuple[Tensor, Tensor]:
    """Extend every beam; return the K best (A, K) scores and tokens, ``state`` following them.

    The best K extensions of all beams lie within each beam's K best tokens, so only A*K*K
    candidates are ranked. Dead beams carry -inf and are never preferred to a live one.
    """
    A = scores.size(0)
    logits = state.next_logits()                                               # (A*K, V)
    k = min(K, logits.size(-1))
    top_tokens = logits.topk(k, dim=-1).indices                                # (A*K, k)
    logp = logits.float().log_softmax(dim=-1).gather(-1, top_tokens)
    candidates = (scores.view(-1, 1) + logp).view(A, K * k)
    new_scores, flat = candidates.topk(K, dim=-1)                              # (A, K)
    tokens = top_tokens.view(A, K * k).gather(1, flat)
    parents = torch.arange(A, device=scores.device).view(A, 1) * K + flat // k
    state.select(parents.view(-1))
    state.append(tokens.view(-1))
    return new_scores, tokens


def _settle(prefixes: list[list[int]], scores: list[float], tokens: list[int], finished: list[Hypothesis],
            limit: int, eos_id: int, alpha: float) -> tuple[list[float], bool]:
    """Move one source's EOS beams to ``finished``; return the live scores and whether it is done.

    A source is done when no beam is live, at its max_len (live beams then compete as they
    are), or when no live beam can beat the best finished one (:func:`_best_possible`).
    """
    length = len(prefixes[0])
    for j, (prefix, s, tok) in enumerate(zip(prefixes, scores, tokens)):
        if s != float("-inf") and (tok == eos_id or length >= limit):
            finished.append(Hypothesis(prefix, s, _normalize(s, length, alpha)))
            scores[j] = float("-inf")
    live = [s for s in scores if s != float("-inf")]
    if not live or length >= limit:
        return scores, True
    best = max((h.normalized_score for h in finished), default=float("-inf"))
    return scores, max(_best_possible(s, length, limit, alpha) for s in live) <= best


@torch.no_grad()
def beam_search_nbest(model, src: Tensor, src_padding_mask: Tensor | None = None, *, beam_size: int = 4,
                      max_len: MaxLen, bos_id: int, eos_id: int, pad_id: int = 0,
                      length_penalty: float = 1.0) -> list[list[Hypothesis]]:
    """Beam search over a batch of sources -> per source, every finished hypothesis, best first.

    B*K rows decode together with one cache; ``cache.reorder`` follows the surviving beams and
    sources that are done leave the batch. Each step the K best extensions are kept; those
    ending in EOS move to the source's finished list (the beam is refilled next step). Ranking
    is score / len**length_penalty with len counting EOS (0: plain log-prob sum; 1: mean
    log-prob). No early stop can return a shorter-but-worse hypothesis: a source stops only when
    no live beam can still beat its best finished one, or at max_len. ``beam_size=1`` is
    exactly :func:`greedy_decode`: its only beam ends at the first EOS. ``pad_id`` is unused by
    the search itself (outputs are lists) and accepted for symmetry with greedy_decode.
    """
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_search: beam_size must be an int >= 1, got {beam_size!r}")
    if not (isinstance(length_penalty, (int, float)) and math.isfinite(length_penalty)):
        raise ValueError(f"beam_search: length_penalty must be a finite number, got {length_penalty!r}")
    src, mask, limits = _prepare(model, src, src_padding_mask, max_len, "beam_search",
                                 bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    B, K = src.size(0), beam_size
    memory = model.encode(src, mask)
    state = Seq2SeqState(model, memory.repeat_interleave(K, dim=0),
                         None if mask is None else mask.repeat_interleave(K, dim=0), bos_id)
    scores = torch.full((B, K), float("-inf"), device=src.device)
    scores[:, 0] = 0.0                     # all beams start as BOS: keep one, or K copies would fill the beam
    alive = list(range(B))
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    while alive:
        scores, tokens = _beam_step(state, scores, K)
        prefixes = state.tokens[:, 1:].tolist()
        new_scores, keep = scores.tolist(), []
        for a, b in enumerate(alive):
            new_scores[a], done = _settle(prefixes[a * K:(a + 1) * K], new_scores[a], tokens[a].tolist(),
                                          finished[b], limits[b], eos_id, length_penalty)
            if not done:
                keep.append(a)
        alive = [alive[a] for a in keep]
        scores = torch.tensor([new_scores[a] for a in keep], device=src.device).view(len(keep), K)
        if alive and len(keep) < len(new_scores):
            index = torch.tensor(keep, device=src.device)
            state.select((index.view(-1, 1) * K + torch.arange(K, device=src.device)).view(-1))
    return [sorted(hyps, key=lambda h: h.normalized_score, reverse=True) for hyps in finished]


def beam_search(model, src: Tensor, src_padding_mask: Tensor | None = None, *, beam_size: int = 4,
                max_len: MaxLen, bos_id: int, eos_id: int, pad_id: int = 0,
                length_penalty: float = 1.0) -> list[list[int]]:
    """The best hypothesis of :func:`beam_search_nbest` per source: tokens without BOS, with EOS
    where produced (as :func:`greedy_decode`, without the padding)."""
    nbest = beam_search_nbest(model, src, src_padding_mask, beam_size=beam_size, max_len=max_len, bos_id=bos_id,
                              eos_id=eos_id, pad_id=pad_id, length_penalty=length_penalty)
    return [hyps[0].tokens for hyps in nbest]


# ---------------------------------------------------------------------------- translate
def _strip(ids: list[int], eos_id: int, pad_id: int) -> list[int]:
    ids = ids[:ids.index(eos_id)] if eos_id in ids else ids
    return [i for i in ids if i != pad_id]


def translate(model, src_tok, tgt_tok, texts: Sequence[str], *, beam_size: int = 1,
              max_len: int | None = None, device: torch.device | str | None = None, batch_size: int = 32,
              src_eos: bool = True, length_penalty: float = 1.0) -> list[str]:
    """Translate ``texts`` with an encoder-decoder model -> one string per text, in order.

    Sources are ``src_tok.encode(text)`` plus ``src_tok.eos_id`` when ``src_eos`` (as the
    training data is built), right-padded with ``src_tok.pad_id`` in batches of similar
    length. ``max_len`` defaults per text to 2 * len(source) + 10, capped by the model's
    ``config.max_seq_len``, so a text's translation does not depend on its batch. beam_size 1
    is greedy. The model runs in eval mode and gets its previous mode back. ``device`` defaults
    to the model's.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"translate: batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(texts, str):
        raise ValueError("translate: texts must be a sequence of strings, not one string")
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu")) \
            if hasattr(model, "parameters") else torch.device("cpu")
    longest = getattr(getattr(model, "config", None), "max_seq_len", None)
    sources = [list(src_tok.encode(t)) + ([src_tok.eos_id] if src_eos else []) for t in texts]
    for i, ids in enumerate(sources):
        if longest is not None and len(ids) > longest:
            raise ValueError(f"translate: text {i} has {len(ids)} source tokens, more than the model's "
                             f"max_seq_len {longest}")
    limits = [max_len if max_len is not None else min(2 * len(ids) + 10, longest or 2 * len(ids) + 10)
              for ids in sources]
    order = sorted(range(len(texts)), key=lambda i: len(sources[i]), reverse=True)
    results: list[str] = [""] * len(texts)
    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(1, max(len(sources[i]) for i in batch))
            src = torch.full((len(batch), width), src_tok.pad_id, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.bool)
            for row, i in enumerate(batch):
                src[row, :len(sources[i])] = torch.tensor(sources[i], dtype=torch.long)
                mask[row, :len(sources[i])] = True
            common = dict(max_len=[limits[i] for i in batch], bos_id=tgt_tok.bos_id, eos_id=tgt_tok.eos_id,
                          pad_id=tgt_tok.pad_id)
            if beam_size == 1:
                outputs = greedy_decode(model, src.to(device), mask.to(device), **common).tolist()
            else:
                outputs = beam_search(model, src.to(device), mask.to(device), beam_size=beam_size,
                                      length_penalty=length_penalty, **common)
            for i, ids in zip(batch, outputs):
                results[i] = tgt_tok.decode(_strip(ids, tgt_tok.eos_id, tgt_tok.pad_id))
    finally:
        if was_training and hasattr(model, "train"):
            model.train()
    return results


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
