"""Encoder-decoder decoding: batched greedy and beam search with the KV cache, translate()."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


MaxLen = int | Sequence[int] | Tensor


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
