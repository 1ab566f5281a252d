"""Speculative decoding over two state adaptors (Leviathan et al. 2023; Chen et al. 2023).

A cheap draft model proposes k tokens, the target scores them in one pass, and the accept /
resample rule keeps the output distribution exactly the target's. Written against the state
adaptors of :mod:`attnlab.generate.state`: it needs ``logits(last)``, ``append``, ``select``,
``mark`` and ``rewind`` (rejected drafts leave the model's state, per row: rows of one batch
accept different numbers of drafts). A KV cache rewinds by truncating and masking the rejected
slots; a recurrent state restores each row's snapshot at its accepted length. A state that
cannot rewind is refused with :class:`attnlab.nn.cache.CannotRewindError` before any pass.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..nn.cache import CannotRewindError
from .sampling import _draw, token_probs
from .search import GenerationStats, Rows, Sampling


def _draft_sample(logits: Tensor, sampling: tuple, generator) -> tuple[Tensor, Tensor]:
    """A draft token and the distribution q it was drawn from: the same tensor, after temperature,
    top-k and top-p, so that the accept test uses exactly the q the token came from (otherwise
    the output is no longer the target's distribution)."""
    q = token_probs(logits, *sampling)
    return _draw(q, generator), q


def _residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(0, p - q)): where to sample after a rejection (p itself if p <= q everywhere, which
    only rounding can produce: then nothing is ever rejected)."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _check_rewindable(target, draft) -> None:
    for who, state in (("the model's", target), ("the draft model's", draft)):
        if not state.can_rewind:
            raise CannotRewindError(
                f"speculative decoding: {who} decoding state ({type(state.cache).__name__}) cannot rewind past "
                f"rejected draft tokens; decode without a draft model, or give the state snapshots (attnlab.nn.cache)")


def _propose(draft, rows: Rows, k: int, sampling: Sampling, generator,
             stats: GenerationStats) -> tuple[Tensor, Tensor | None]:
    """k draft tokens (N, k) drawn autoregressively by the ``draft`` state (which keeps them), and
    their q (N, k, V); q is None when k is 0."""
    tokens, probs = [], []
    for i in range(k):
        if i:
            draft.append(tokens[-1])
        logits = draft.logits()[:, -1]
        stats.draft_passes += 1
        so_far = torch.cat(tokens, 1) if tokens else None
        token, q = _draft_sample(rows.penalize(logits, so_far), sampling.filters, generator)
        tokens.append(token[:, None])
        probs.append(q[:, None])
    if not k:
        return torch.empty(draft.rows, 0, dtype=torch.long, device=rows.out.device), None
    draft.append(tokens[-1])            # the state holds every draft, as the target's will
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


@torch.no_grad()
def run_speculative(target, draft, rows: Rows, k: int, sampling: Sampling, generator=None,
                    stats: GenerationStats | None = None, streamer=None) -> Tensor:
    """Decode every row of the ``target`` state with proposals from the ``draft`` state (both
    adaptors over the same rows and tokens, models over one vocabulary) -> ``rows.result()``.

    Each round the draft proposes up to k tokens, the target scores them in one pass, and both
    states are rewound, row by row, to the drafts that row accepted; all rows keep the slots of
    the longest accepted prefix, rows that accepted fewer as holes. Greedy output (temperature
    0) is the target's plain greedy. Both states must be able to rewind (checked first).
    """
    _check_rewindable(target, draft)
    stats = GenerationStats() if stats is None else stats
    if sampling.temperature == 0:   # one-hot p and q decide alone: leave the caller's RNG untouched, as greedy does
        generator = torch.Generator(rows.out.device)
    while True:
        k_now = min(k, rows.remaining() - 1)               # never past a row's limit (nor the context)
        L = target.length
        for state in (target, draft):
            state.mark(L)                                   # no row goes back before this round's drafts
        drafts, q = _propose(draft, rows, k_now, sampling, generator, stats)
        N = drafts.size(0)
        target.append(drafts)
        p = token_probs(rows.penalize(target.logits(k_now + 1), drafts), *sampling.filters)
        q = p.new_zeros(N, 0, p.size(-1)) if q is None else q
        stats.target_passes += 1
        n, token = _verify(drafts, q, p, generator)
        stats.drafted, stats.accepted = stats.drafted + N * k_now, stats.accepted + int(n.sum())
        new = torch.cat([drafts, drafts.new_zeros(N, 1)], dim=1).scatter_(1, n[:, None], token[:, None])
        finished = rows.commit(new, n + 1)
        rows.stream(streamer)
        if bool(finished.all()):
            return rows.result()
        m = int(n.max())
        for state in (target, draft):
            state.rewind(L, n)
            state.append(token[:, None])
        real = torch.arange(m + 1, device=n.device)[None] < n[:, None]           # accepted drafts
        real[:, m] = True
        rows.note(torch.cat([drafts[:, :m], token[:, None]], dim=1), real)
        rows.keep(~finished, [target, draft])

