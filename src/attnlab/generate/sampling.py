"""Sampling filters shared by every decoder: top-k, top-p, temperature, repetition penalty."""
from __future__ import annotations

import math

import torch
from torch import Tensor


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
