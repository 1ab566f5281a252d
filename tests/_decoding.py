"""Reference helpers shared by the decoding tests: a chi-square test without scipy, and an
exhaustive search that beam search must agree with on tiny vocabularies."""
import itertools
import math

import torch

# chi-square critical values at p = 0.001 from standard tables, to check chi2_sf against
CRITICAL_0001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 10: 29.588, 15: 37.697}


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df), integer df, in closed form (no scipy): for even df,
    exp(-x/2) sum_{i < df/2} (x/2)^i / i!; for odd df, erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2)
    sum_{i=1}^{(df-1)/2} x^(i-1) / (1 * 3 * ... * (2i - 1))."""
    if df % 2 == 0:
        term = total = math.exp(-x / 2)
        for i in range(1, df // 2):
            term *= x / 2 / i
            total += term
        return total
    total, term = math.erfc(math.sqrt(x / 2)), math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for i in range(1, (df - 1) // 2 + 1):
        total += term
        term *= x / (2 * i + 1)
    return total


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expecting < 5 samples are pooled into one.
    A sample in a cell of probability 0 gives an infinite statistic."""
    expected = probs * counts.sum()
    if bool((counts[probs == 0] > 0).any()):
        return math.inf, 1
    small, big = (expected > 0) & (expected < 5), expected >= 5
    obs = torch.cat([counts[big], counts[small].sum().view(1)]) if small.any() else counts[big]
    exp = torch.cat([expected[big], expected[small].sum().view(1)]) if small.any() else expected[big]
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1


def all_hypotheses(vocab_size: int, max_new: int, eos: int) -> list[tuple[int, ...]]:
    """Every sequence a search may return: ends with EOS (EOS nowhere earlier) or reaches max_new."""
    out = []
    for n in range(1, max_new + 1):
        for body in itertools.product([t for t in range(vocab_size) if t != eos], repeat=n - 1):
            out += [body + (eos,)] if n < max_new else [body + (t,) for t in range(vocab_size)]
    return out


@torch.no_grad()
def exhaustive_best(logprob_of, vocab_size: int, max_new: int, eos: int, alpha: float):
    """The two best (normalized score, tokens) over :func:`all_hypotheses`, ranked by
    ``logprob_of(tokens)`` / len ** alpha (``logprob_of`` scores a batch of equal-length sequences)."""
    ranked = []
    hyps = all_hypotheses(vocab_size, max_new, eos)
    for n in range(1, max_new + 1):
        same = [h for h in hyps if len(h) == n]
        scores = logprob_of(torch.tensor(same)).tolist()
        ranked += [(s / n ** alpha, list(h)) for s, h in zip(scores, same)]
    ranked.sort(key=lambda r: r[0], reverse=True)
    return ranked[0], ranked[1]


@torch.no_grad()
def causal_logprob(model, prompt: torch.Tensor):
    """A ``logprob_of`` for :func:`exhaustive_best`: the teacher-forced log-prob sum (H,) of
    continuations (H, n) of ``prompt`` (T,) under a causal LM, without any cache."""
    def logprob_of(tokens: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([prompt.expand(tokens.size(0), -1), tokens], dim=1)
        logp = model(ids[:, :-1])[:, prompt.numel() - 1:].double().log_softmax(-1)
        return logp.gather(-1, tokens[..., None])[..., 0].sum(-1)
    return logprob_of
