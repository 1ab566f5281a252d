"""The decoding loops, written once over a state adaptor (:mod:`attnlab.generate.state`):
greedy / sampled decoding and beam search, for every model kind that has an adaptor.

Glossary: B rows asked for, N rows still decoding, K beams, V vocabulary, t tokens so far.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .sampling import apply_repetition_penalty, sample, seen_tokens


@dataclass
class GenerationStats:
    """Counters that the decoding loops fill in when given one (``stats=GenerationStats()``).

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


@dataclass(frozen=True)
class Sampling:
    """How a token is drawn from logits: :func:`attnlab.generate.sample`'s temperature / top-k /
    top-p after the repetition penalty; temperature 0 is greedy."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float = 1.0

    @property
    def filters(self) -> tuple:
        return self.temperature, self.top_k, self.top_p


# ---------------------------------------------------------------------------- rows and their outputs
class Rows:
    """The output of B rows while some of them are still decoding.

    ``rows`` (N,) maps the adaptor's live rows to output rows; ``out`` (B, n) receives each
    row's tokens; row b is done at an id of ``eos`` or after ``limits[b]`` tokens, and is then
    filled with ``fill``. ``seen`` (N, V) backs the repetition penalty (None without one).
    """

    def __init__(self, limits: Tensor, eos: Tensor | None, fill: int, penalty: float = 1.0,
                 seen: Tensor | None = None):
        B, device = limits.size(0), limits.device
        self.limits, self.eos, self.penalty = limits, eos, penalty
        self.rows = torch.arange(B, device=device)
        self.out = torch.full((B, int(limits.max())), fill, dtype=torch.long, device=device)
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.done = torch.zeros(B, dtype=torch.bool, device=device)
        self.seen = seen if penalty != 1.0 else None
        self.emitted = 0

    def remaining(self) -> int:
        """The fewest tokens a live row may still produce."""
        return int((self.limits[self.rows] - self.count[self.rows]).min())

    def commit(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Give live row i the tokens ``tokens[i, :lengths[i]]`` (cut after EOS or at its limit);
        return which live rows are now done (N,)."""
        N, m = tokens.shape
        j = torch.arange(m, device=tokens.device)
        count, limit = self.count[self.rows], self.limits[self.rows]
        n = torch.minimum(lengths, limit - count)
        ended = torch.zeros(N, dtype=torch.bool, device=tokens.device)
        if self.eos is not None:
            is_eos = torch.isin(tokens, self.eos) & (j < n[:, None])
            ended = is_eos.any(1)
            n = torch.where(ended, is_eos.long().argmax(1) + 1, n)
        keep = j < n[:, None]
        self.out[self.rows[:, None].expand(N, m)[keep], (count[:, None] + j)[keep]] = tokens[keep]
        self.count[self.rows] = count + n
        finished = ended | (count + n >= limit)
        self.done[self.rows] = finished
        return finished

    def note(self, tokens: Tensor, real: Tensor | None = None) -> None:
        """Count ``tokens`` (N, m) (``real`` False: holes) as seen by the repetition penalty."""
        if self.seen is not None:
            self.seen |= seen_tokens(tokens, self.seen.size(1), real)

    def keep(self, alive: Tensor, states: list) -> None:
        """Drop the finished rows from the outputs' map and from every state adaptor."""
        if bool(alive.all()):
            return
        index = alive.nonzero()[:, 0]
        self.rows = self.rows[index]
        if self.seen is not None:
            self.seen = self.seen[index]
        for state in states:
            state.select(index)

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

    def result(self) -> Tensor:
        """(B, n): every row's tokens, n the most any row produced, then ``fill``."""
        return self.out[:, :int(self.count.max())]


# ---------------------------------------------------------------------------- greedy and sampling
@torch.no_grad()
def run_sampling(state, rows: Rows, sampling: Sampling, generator: torch.Generator | None = None,
                 stats: GenerationStats | None = None, streamer=None) -> Tensor:
    """Greedy (temperature 0) or sampled decoding of every row of ``state`` -> ``rows.result()``.

    One call to ``state.logits`` per token (the first one is the prefill); a row that is done
    leaves ``state``, and the loop ends when none is left.
    """
    stats = GenerationStats() if stats is None else stats
    while True:
        logits = state.logits()[:, -1]
        stats.target_passes += 1
        token = sample(rows.penalize(logits), *sampling.filters, generator=generator)
        finished = rows.commit(token[:, None], torch.ones_like(token))
        rows.stream(streamer)
        if bool(finished.all()):
            return rows.result()
        state.append(token[:, None])
        rows.note(token[:, None])
        rows.keep(~finished, [state])


# ---------------------------------------------------------------------------- beam search
@dataclass
class Hypothesis:
    """One finished beam: ``tokens`` (the generated ones), ending with EOS unless cut at the limit.

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


def _beam_step(logits: Tensor, scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The K best extensions of A groups of K beams: logits (A*K, V), scores (A, K) ->
    new scores (A, K), tokens (A, K) and the parent row (A*K,) of each.

    The best K extensions of all beams lie within each beam's K best tokens, so only A*K*K
    candidates are ranked. Dead beams carry -inf and are never preferred to a live one. One
    beam takes the argmax, as greedy decoding does, so that ties break the same way.
    """
    A, K = scores.shape
    k = min(K, logits.size(-1))
    top_tokens = logits.argmax(-1, keepdim=True) if K == 1 else logits.topk(k, dim=-1).indices  # (A*K, k)
    logp = logits.float().log_softmax(dim=-1).gather(-1, top_tokens)
    candidates = (scores.view(-1, 1) + logp).view(A, K * k)
    new_scores, flat = candidates.topk(K, dim=-1)                              # (A, K)
    tokens = top_tokens.view(A, K * k).gather(1, flat)
    parents = torch.arange(A, device=scores.device).view(A, 1) * K + flat // k
    return new_scores, tokens, parents.view(-1)


def _settle(prefixes: list[list[int]], scores: list[float], tokens: list[int], finished: list[Hypothesis],
            limit: int, eos: set[int], alpha: float) -> tuple[list[float], bool]:
    """Move one source's EOS beams to ``finished``; return the live scores and whether it is done.

    A source is done when no beam is live, at its limit (live beams then compete as they
    are), or when no live beam can beat the best finished one (:func:`_best_possible`).
    """
    length = len(prefixes[0])
    for j, (prefix, s, tok) in enumerate(zip(prefixes, scores, tokens)):
        if s != float("-inf") and (tok in eos or length >= limit):
            finished.append(Hypothesis(prefix, s, _normalize(s, length, alpha)))
            scores[j] = float("-inf")
    live = [s for s in scores if s != float("-inf")]
    if not live or length >= limit:
        return scores, True
    best = max((h.normalized_score for h in finished), default=float("-inf"))
    return scores, max(_best_possible(s, length, limit, alpha) for s in live) <= best


def check_beam_options(who: str, beam_size, length_penalty, name: str = "beam_size") -> None:
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"{who}: {name} must be an int >= 1, got {beam_size!r}")
    if not (isinstance(length_penalty, (int, float)) and math.isfinite(length_penalty)):
        raise ValueError(f"{who}: length_penalty must be a finite number, got {length_penalty!r}")


@torch.no_grad()
def run_beam_search(state, limits: list[int], eos: list[int], *, beam_size: int = 4,
                    length_penalty: float = 1.0, stats: GenerationStats | None = None) -> list[list[Hypothesis]]:
    """Beam search from every row of ``state`` -> per row, every finished hypothesis, best first.

    Row b gets at most ``limits[b]`` tokens; ``eos`` ids end a hypothesis. The first logits come
    from the B rows (one prefill each), then the state is expanded to B*K rows that decode
    together; ``state.select`` follows the surviving beams and rows that are done leave. Each
    step the K best extensions are kept; those ending in EOS move to the row's finished list
    (the beam is refilled next step). Ranking is score / len**length_penalty with len counting
    EOS (0: plain log-prob sum; 1: mean log-prob). No early stop can return a shorter-but-worse
    hypothesis: a row stops only when no live beam can still beat its best finished one, or at
    its limit. ``beam_size=1`` is exactly greedy decoding: its only beam ends at the first EOS.
    """
    check_beam_options("beam_search", beam_size, length_penalty)
    B, K, eos_set = state.rows, beam_size, set(eos)
    if len(limits) != B or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in limits):
        raise ValueError(f"run_beam_search: limits must be one int >= 1 per row ({B}), got {limits!r}")
    stats = GenerationStats() if stats is None else stats
    logits = state.logits()[:, -1]
    stats.target_passes += 1
    device = logits.device
    expand = torch.arange(B, device=device).repeat_interleave(K)
    state.select(expand)
    logits = logits.index_select(0, expand)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0                     # all beams start equal: keep one, or K copies would fill the beam
    history = torch.empty(B * K, 0, dtype=torch.long, device=device)
    alive = list(range(B))
    finished: list[list[Hypothesis]] = [[] for _ in range(B)]
    while True:
        scores, tokens, parents = _beam_step(logits, scores)
        state.select(parents)
        state.append(tokens.view(-1, 1))
        history = torch.cat([history.index_select(0, parents), tokens.view(-1, 1)], dim=1)
        prefixes, new_scores, keep = history.tolist(), scores.tolist(), []
        for a, b in enumerate(alive):
            new_scores[a], done = _settle(prefixes[a * K:(a + 1) * K], new_scores[a], tokens[a].tolist(),
                                          finished[b], limits[b], eos_set, length_penalty)
            if not done:
                keep.append(a)
        alive = [alive[a] for a in keep]
        if not alive:
            return [sorted(hyps, key=lambda h: h.normalized_score, reverse=True) for hyps in finished]
        scores = torch.tensor([new_scores[a] for a in keep], device=device).view(len(keep), K)
        if len(keep) < len(new_scores):
            index = (torch.tensor(keep, device=device).view(-1, 1) * K + torch.arange(K, device=device)).view(-1)
            state.select(index)
            history = history.index_select(0, index)
        logits = state.logits()[:, -1]
        stats.target_passes += 1
