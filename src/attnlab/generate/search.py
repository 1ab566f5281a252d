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


def _beam_step(logits: Tensor, scores: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``width`` best extensions of A groups of K beams, best first: logits (A*K, V), scores
    (A, K) -> new scores (A, W), tokens (A, W) and the parent row (A*W,) of each.

    The best W extensions of all beams lie within each beam's W best tokens, so only A*K*W
    candidates are ranked. Dead beams carry -inf and are never preferred to a live one. A width
    of one takes the argmax, as greedy decoding does, so that ties break the same way.
    """
    A, K = scores.shape
    k = min(width, logits.size(-1))
    top_tokens = logits.argmax(-1, keepdim=True) if width == 1 else logits.topk(k, dim=-1).indices  # (A*K, k)
    logp = logits.float().log_softmax(dim=-1).gather(-1, top_tokens)
    candidates = (scores.view(-1, 1) + logp).view(A, K * k)
    new_scores, flat = candidates.topk(min(width, K * k), dim=-1)            # (A, W)
    tokens = top_tokens.view(A, K * k).gather(1, flat)
    parents = torch.arange(A, device=scores.device).view(A, 1) * K + flat // k
    return new_scores, tokens, parents.view(-1)


def _settle(prefixes: list[list[int]], scores: list[float], tokens: list[int], finished: list[Hypothesis],
            limit: int, eos: set[int], alpha: float, K: int) -> tuple[list[int], bool]:
    """One source's candidates, best first -> (the ones that go on, whether the source is done).

    Of the K best candidates, those ending in EOS (all of them at the source's limit) move to
    ``finished``; an EOS ranked below K is dropped. The K best candidates that do not end go on
    (there are K: at most one EOS per beam). The source is done when none goes on, at its limit,
    or when no live beam can beat the best finished one (:func:`_best_possible`).
    """
    length, live = len(prefixes[0]), []
    for j, (prefix, s, tok) in enumerate(zip(prefixes, scores, tokens)):
        if s == float("-inf"):
            continue
        if tok in eos or length >= limit:
            if j < K:
                finished.append(Hypothesis(prefix, s, _normalize(s, length, alpha)))
        elif len(live) < K:
            live.append(j)
    if not live or length >= limit:
        return live, True
    best = max((h.normalized_score for h in finished), default=float("-inf"))
    return live, max(_best_possible(scores[j], length, limit, alpha) for j in live) <= best


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
    step ranks the 2K best extensions: those of the K best that end in EOS move to the row's
    finished list, and the K best that do not end go on, so K beams stay live (transformers'
    beam search, and the canonical one). Ranking is score / len**length_penalty with len counting
    EOS (0: plain log-prob sum; 1: mean log-prob). No early stop can return a shorter-but-worse
    hypothesis: a row stops only when no live beam can still beat its best finished one, or at
    its limit, so the best hypothesis is transformers' with ``early_stopping="never"``.
    ``beam_size=1`` is exactly greedy decoding: its only beam ends at the first EOS.
    """
    check_beam_options("beam_search", beam_size, length_penalty)
    B, K, eos_set = state.rows, beam_size, set(eos)
    W = 1 if K == 1 else 2 * K               # candidates ranked per source: K can end and K still go on
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
        cand_scores, cand_tokens, cand_parents = _beam_step(logits, scores, W)
        w = cand_scores.size(1)
        cand_history = torch.cat([history.index_select(0, cand_parents), cand_tokens.view(-1, 1)], dim=1)
        prefixes, cand_s, cand_t = cand_history.tolist(), cand_scores.tolist(), cand_tokens.tolist()
        chosen, new_scores, kept = [], [], []
        for a, b in enumerate(alive):
            live, done = _settle(prefixes[a * w:(a + 1) * w], cand_s[a], cand_t[a], finished[b], limits[b],
                                 eos_set, length_penalty, K)
            if done:
                continue
            kept.append(b)
            # fewer than K go on only with a vocabulary under 2K tokens: fill with dead copies
            new_scores.append([cand_s[a][j] for j in live] + [float("-inf")] * (K - len(live)))
            chosen += [a * w + j for j in live + [live[0]] * (K - len(live))]
        alive = kept
        if not alive:
            return [sorted(hyps, key=lambda h: h.normalized_score, reverse=True) for hyps in finished]
        index = torch.tensor(chosen, device=device)
        state.select(cand_parents.index_select(0, index))
        state.append(cand_tokens.view(-1).index_select(0, index).view(-1, 1))
        history = cand_history.index_select(0, index)
        scores = torch.tensor(new_scores, device=device)
        logits = state.logits()[:, -1]
        stats.target_passes += 1
