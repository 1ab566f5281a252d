"""Decoding: sampling filters, greedy and beam search for encoder-decoder models (pitfalls 11, 12).

Two kinds of model: a tiny random attnlab Transformer for cache / padding / score checks, and
a lookup model whose next-token distributions are written by hand, to build cases where the
right answer is known (beam beats greedy; a short hypothesis finishes first but is worse).
"""
import math

import pytest
import torch

from attnlab.generate import (GenerationStats, Seq2SeqState, beam_search, beam_search_nbest, greedy_decode, sample,
                              sample_decode, speculative_decode, top_k_filter, top_p_filter, translate)
from attnlab.generate.seq2seq import _prepare
from attnlab.models import Transformer
from _decoding import chi2_sf, chi_square  # noqa: E402  (tests/ is on sys.path under pytest)
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

PAD, BOS, EOS = 0, 1, 17      # with this seed, EOS 17 ends some rows early and not others


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(20, 20, d_model=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=64,
                       max_seq_len=64, dropout=0.0).eval()


def ragged_batch(lengths, seed=1):
    """Right-padded sources of the given lengths, their mask, and the unpadded rows."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 20, (n,), generator=g) for n in lengths]
    src = torch.full((len(rows), max(lengths)), PAD)
    for i, r in enumerate(rows):
        src[i, :len(r)] = r
    return src, src != PAD, rows


def strip(row):
    return [t for t in row.tolist() if t != PAD]


def sequence_logprob(model, src, tokens):
    """Teacher-forced sum of log-probs of ``tokens`` (no BOS) for one unpadded source (S,)."""
    tgt_in = torch.tensor([[BOS] + tokens[:-1]])
    with torch.no_grad():
        logp = model(src.view(1, -1), tgt_in).float().log_softmax(-1)
    return logp[0].gather(-1, torch.tensor(tokens).view(-1, 1)).sum().item()


# ---------------------------------------------------------------------------- cache and padding (pitfall 11)
def test_cached_greedy_equals_uncached_tokens_and_logits(model):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    cached = greedy_decode(model, src, mask, max_len=12, bos_id=BOS, eos_id=EOS)
    uncached = greedy_decode(model, src, mask, max_len=12, bos_id=BOS, eos_id=EOS, use_cache=False)
    assert torch.equal(cached, uncached)
    ended = (cached == EOS).any(1)
    assert ended.any() and not ended.all(), "the case should mix early-stopped and max_len rows"

    # the same tokens teacher-forced through both states give the same logits at every step
    with torch.no_grad():
        memory = model.encode(src, mask)
        states = [Seq2SeqState(model, memory, mask, BOS, use_cache=c) for c in (True, False)]
        for step in range(cached.size(1)):
            a, b = (s.next_logits() for s in states)
            assert_close_scaled(a, b, FP32, f"step {step}: cached vs uncached logits")
            for s in states:
                s.append(cached[:, step])
    assert states[0].cache.length == cached.size(1)


def test_batched_ragged_sources_equal_each_alone(model):
    src, mask, rows = ragged_batch([3, 7, 5, 2, 6])
    batched = greedy_decode(model, src, mask, max_len=10, bos_id=BOS, eos_id=EOS)
    beams = beam_search(model, src, mask, beam_size=3, max_len=10, bos_id=BOS, eos_id=EOS)
    for i, r in enumerate(rows):
        alone = greedy_decode(model, r.view(1, -1), max_len=10, bos_id=BOS, eos_id=EOS)
        assert strip(batched[i]) == strip(alone[0]), f"greedy row {i}"
        assert beams[i] == beam_search(model, r.view(1, -1), beam_size=3, max_len=10, bos_id=BOS,
                                       eos_id=EOS)[0], f"beam row {i}"
    # padding must matter: without the mask the padded rows see their pads and decode differently
    with torch.no_grad():
        with_mask = Seq2SeqState(model, model.encode(src, mask), mask, BOS).next_logits()
        no_mask = Seq2SeqState(model, model.encode(src), None, BOS).next_logits()
    assert not torch.allclose(with_mask[0], no_mask[0], atol=1e-3)


def test_mask_derived_from_config_pad_id(model):
    src, mask, _ = ragged_batch([3, 7, 5])
    explicit = greedy_decode(model, src, mask, max_len=8, bos_id=BOS, eos_id=EOS)
    assert _prepare(model, src, None, 8, "test")[1] is None         # no pad_id: no mask is made up
    model.config.pad_id = PAD
    try:
        assert torch.equal(_prepare(model, src, None, 8, "test")[1], mask)
        assert torch.equal(explicit, greedy_decode(model, src, max_len=8, bos_id=BOS, eos_id=EOS))
    finally:
        model.config.pad_id = None


def test_greedy_output_format_and_per_source_max_len(model):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    out = greedy_decode(model, src, mask, max_len=12, bos_id=BOS, eos_id=EOS)
    for row in out.tolist():
        if EOS in row:
            assert all(t == PAD for t in row[row.index(EOS) + 1:])
    limits = [1, 2, 3, 12, 5]
    short = greedy_decode(model, src, mask, max_len=limits, bos_id=BOS, eos_id=EOS)
    for i, n in enumerate(limits):
        assert strip(short[i]) == strip(out[i])[:n]


# ---------------------------------------------------------------------------- beam search (pitfall 12)
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beam_size_one_equals_greedy(model, length_penalty):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    greedy = greedy_decode(model, src, mask, max_len=12, bos_id=BOS, eos_id=EOS)
    beam = beam_search(model, src, mask, beam_size=1, max_len=12, bos_id=BOS, eos_id=EOS,
                       length_penalty=length_penalty)
    assert beam == [strip(r) for r in greedy]


def test_beam_scores_equal_teacher_forced_logprobs(model):
    src, mask, rows = ragged_batch([6, 4, 7])
    nbest = beam_search_nbest(model, src, mask, beam_size=4, max_len=10, bos_id=BOS, eos_id=EOS)
    for r, hyps in zip(rows, nbest):
        assert hyps, "every source gets at least one hypothesis"
        keys = [h.normalized_score for h in hyps]
        assert keys == sorted(keys, reverse=True)
        for h in hyps[:3]:
            assert_close_scaled(torch.tensor(h.score), sequence_logprob(model, r, h.tokens), FP32, "beam score")
            assert math.isclose(h.normalized_score, h.score / len(h.tokens), rel_tol=1e-12)


def test_beam_is_at_least_as_good_as_greedy_on_the_model(model):
    src, mask, rows = ragged_batch([6, 4, 7, 5])
    greedy = greedy_decode(model, src, mask, max_len=10, bos_id=BOS, eos_id=EOS)
    nbest = beam_search_nbest(model, src, mask, beam_size=4, max_len=10, bos_id=BOS, eos_id=EOS,
                              length_penalty=0.0)
    for r, g, hyps in zip(rows, greedy, nbest):
        assert hyps[0].score >= sequence_logprob(model, r, strip(g)) - 1e-5


class LookupModel:
    """An encoder-decoder whose next-token distribution is looked up from the generated prefix.

    ``table`` maps a prefix (tuple of generated ids, no BOS) to {token: probability}; the rest of
    the mass is shared by the other content tokens; an unlisted prefix ends with EOS (0.9).
    """
    EOS, V, CONTENT = 2, 6, (2, 3, 4, 5)

    def __init__(self, table):
        self.table = table

    def encode(self, src, src_padding_mask=None):
        return torch.zeros(src.size(0), src.size(1), 1)

    def new_cache(self):
        return PrefixCache()

    def logprobs(self, prefix):
        given = self.table.get(tuple(prefix), {self.EOS: 0.9})
        rest = [t for t in self.CONTENT if t not in given]
        probs = torch.full((self.V,), 1e-9, dtype=torch.float64)
        for t in rest:
            probs[t] = (1.0 - sum(given.values())) / len(rest)
        for t, p in given.items():
            probs[t] = p
        return probs.log()

    def decode(self, tgt, memory, src_padding_mask=None, *, cache=None):
        full = tgt if cache is None else cache.extend(tgt)
        T, L = tgt.size(1), full.size(1)
        logits = [[self.logprobs(full[b, 1:p + 1].tolist()) for p in range(L - T, L)] for b in range(tgt.size(0))]
        return torch.stack([torch.stack(r) for r in logits]).float()

    def sequence_logprob(self, tokens):
        return sum(self.logprobs(tokens[:i])[t].item() for i, t in enumerate(tokens))


class PrefixCache:
    def __init__(self):
        self.tokens = None

    @property
    def length(self):
        return 0 if self.tokens is None else self.tokens.size(1)

    def extend(self, tgt):
        self.tokens = tgt if self.tokens is None else torch.cat([self.tokens, tgt], 1)
        return self.tokens

    def reorder(self, index):
        self.tokens = self.tokens.index_select(0, index)


E = LookupModel.EOS
ONE_SOURCE = torch.tensor([[3, 4]])


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_finds_better_sequence_than_greedy(length_penalty):
    # greedy takes 3 (0.5) then EOS (0.3): p = 0.15; the runner-up 4 (0.4) then EOS (0.9): p = 0.36
    fake = LookupModel({(): {3: 0.5, 4: 0.4}, (3,): {E: 0.3, 4: 0.25, 5: 0.24}, (4,): {E: 0.9}})
    greedy = strip(greedy_decode(fake, ONE_SOURCE, max_len=6, bos_id=1, eos_id=E)[0])
    assert greedy == [3, E]
    best = beam_search_nbest(fake, ONE_SOURCE, beam_size=2, max_len=6, bos_id=1, eos_id=E,
                             length_penalty=length_penalty)[0][0]
    assert best.tokens == [4, E]
    assert best.score > fake.sequence_logprob(greedy) + 0.5
    assert_close_scaled(torch.tensor(best.score), torch.tensor(fake.sequence_logprob(best.tokens)), FP32, "score")


def test_short_hypothesis_finishing_first_does_not_stop_the_search():
    # [EOS] finishes at step 1 with log 0.45 = -0.80 per token; [3, 4, 5, EOS] finishes at step 4
    # with log(0.4 * 0.9 * 0.95 * 0.95) / 4 = -0.28 per token. At step 1 the live beam [3] has
    # -0.92 per token, worse than -0.80: a stop at the first EOS, or a bound taken at the current
    # length, returns the short one.
    fake = LookupModel({(): {E: 0.45, 3: 0.4}, (3,): {4: 0.9}, (3, 4): {5: 0.95}, (3, 4, 5): {E: 0.95}})
    nbest = beam_search_nbest(fake, ONE_SOURCE, beam_size=2, max_len=8, bos_id=1, eos_id=E, length_penalty=1.0)[0]
    assert nbest[0].tokens == [3, 4, 5, E]
    short = next(h for h in nbest if h.tokens == [E])
    assert short.normalized_score < nbest[0].normalized_score
    # the search really is what decides: by plain log-prob the short one is best
    assert beam_search(fake, ONE_SOURCE, beam_size=2, max_len=8, bos_id=1, eos_id=E, length_penalty=0.0) == [[E]]


def test_beam_stops_when_no_live_beam_can_win():
    # with length_penalty 0 a finished hypothesis better than every live beam ends the search at once
    fake = LookupModel({(): {E: 0.6, 3: 0.3}})
    calls = []
    decode = fake.decode
    fake.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    assert beam_search(fake, ONE_SOURCE, beam_size=2, max_len=30, bos_id=1, eos_id=E, length_penalty=0.0) == [[E]]
    assert len(calls) == 1


def test_max_len_hypotheses_without_eos_compete():
    # nothing ever ends: at max_len the live beams become the hypotheses, best first
    fake = LookupModel({p: {3: 0.6, 4: 0.3, E: 1e-6} for p in
                        [(), (3,), (4,), (3, 3), (3, 4), (4, 3), (4, 4)]})
    nbest = beam_search_nbest(fake, ONE_SOURCE, beam_size=2, max_len=3, bos_id=1, eos_id=E)[0]
    assert nbest[0].tokens == [3, 3, 3] and all(len(h.tokens) == 3 for h in nbest)


# ---------------------------------------------------------------------------- sampling filters
def test_top_k_keeps_exactly_k():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    kept = top_k_filter(logits, 3)
    assert (kept.isfinite().sum(-1) == 3).all()
    assert torch.equal(kept.topk(3).indices.sort().values, logits.topk(3).indices.sort().values)
    ties = top_k_filter(torch.tensor([1.0, 1.0, 1.0, 0.0]), 2)
    assert ties.isfinite().sum() == 2
    assert torch.equal(top_k_filter(logits, 10), logits)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert top_p_filter(logits, 0.75).isfinite().tolist() == [True, True, False, False]
    assert top_p_filter(logits, 0.85).isfinite().tolist() == [True, True, True, False]
    assert top_p_filter(logits, 0.4).isfinite().tolist() == [True, False, False, False]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        row = torch.randn(12, generator=g) * 2
        p = torch.rand(1, generator=g).item()
        keep = top_p_filter(row, p).isfinite()
        probs = row.softmax(-1)
        assert probs[keep].sum() >= p - 1e-6
        assert probs[keep].sum() - probs[keep].min() < p + 1e-6, "dropping the least likely kept token goes below p"
        if not keep.all():
            assert probs[keep].min() >= probs[~keep].max()


def test_sample_temperature_zero_is_argmax_and_filters_restrict_support():
    logits = torch.randn(3, 5, 9, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, 0.0), logits.argmax(-1))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, 1.0, top_k=1, generator=g), logits.argmax(-1))
    draws = torch.stack([sample(logits[0, 0], 2.0, top_k=2, generator=g) for _ in range(200)])
    assert set(draws.tolist()) == set(logits[0, 0].topk(2).indices.tolist())


# ---------------------------------------------------------------------------- sampling
def _seeded(seed):
    return torch.Generator().manual_seed(seed)


def test_sampling_cached_equals_uncached_with_the_same_seed(model):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    kw = dict(max_len=12, bos_id=BOS, eos_id=EOS, temperature=1.3, top_p=0.95)
    cached = sample_decode(model, src, mask, generator=_seeded(0), **kw)
    assert torch.equal(cached, sample_decode(model, src, mask, generator=_seeded(0), use_cache=False, **kw))
    assert not torch.equal(cached, sample_decode(model, src, mask, generator=_seeded(1), **kw))
    assert not torch.equal(cached, greedy_decode(model, src, mask, max_len=12, bos_id=BOS, eos_id=EOS))


def test_sampling_limits_are_greedy(model):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    kw = dict(max_len=12, bos_id=BOS, eos_id=EOS)
    greedy = greedy_decode(model, src, mask, **kw)
    assert torch.equal(sample_decode(model, src, mask, temperature=0.0, **kw), greedy)
    assert torch.equal(sample_decode(model, src, mask, temperature=1e-4, generator=_seeded(0), **kw), greedy)
    assert torch.equal(sample_decode(model, src, mask, temperature=2.0, top_k=1, generator=_seeded(0), **kw), greedy)
    assert torch.equal(sample_decode(model, src, mask, temperature=2.0, top_p=1e-6, generator=_seeded(0), **kw),
                       greedy)


def test_sampled_first_token_follows_softmax_over_temperature(model):
    """3000 copies of one source sample their first token from softmax(logits / T) (chi-square)."""
    src, mask, _ = ragged_batch([5])
    T, n = 0.7, 3000
    with torch.no_grad():
        logits = Seq2SeqState(model, model.encode(src, mask), mask, BOS).next_logits()[0]
    first = sample_decode(model, src.expand(n, -1), mask.expand(n, -1), max_len=1, bos_id=BOS, eos_id=EOS,
                          temperature=T, generator=_seeded(0))[:, 0]
    counts = torch.bincount(first, minlength=logits.numel()).double()
    x, df = chi_square(counts, (logits.double() / T).softmax(-1))
    assert df >= 3 and chi2_sf(x, df) > 0.001, f"chi2 {x:.1f} with {df} df"
    x, df = chi_square(counts, logits.double().softmax(-1))         # the test can tell T = 1 from T = 0.7
    assert chi2_sf(x, df) < 0.001, f"chi2 {x:.1f} with {df} df"


def _perturbed(model, noise, seed=0):
    """A copy of ``model`` with N(0, noise**2) added to every matrix: a draft that mostly agrees."""
    import copy
    draft, g = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(noise * torch.randn(p.shape, generator=g))
    return draft


def test_speculative_greedy_equals_greedy(model):
    src, mask, _ = ragged_batch([6, 4, 7, 5, 3])
    kw = dict(max_len=[12, 3, 12, 8, 12], bos_id=BOS, eos_id=EOS)
    greedy = greedy_decode(model, src, mask, **kw)
    rates = {}
    for name, draft in (("self", model), ("perturbed", _perturbed(model, 0.02)), ("far", _perturbed(model, 1.0))):
        stats = rates[name] = GenerationStats()
        got = speculative_decode(model, draft, src, mask, num_draft_tokens=3, stats=stats, **kw)
        assert torch.equal(got, greedy), name
    assert rates["self"].accepted == rates["self"].drafted > 0
    assert 0 < rates["perturbed"].acceptance_rate < 1, rates["perturbed"]
    assert rates["far"].acceptance_rate < rates["perturbed"].acceptance_rate
    sampled = [speculative_decode(model, _perturbed(model, 0.02), src, mask, temperature=1.2,
                                  generator=_seeded(s), **kw) for s in (0, 0, 1)]
    assert torch.equal(sampled[0], sampled[1]) and not torch.equal(sampled[0], sampled[2])


def test_seq2seq_state_rewinds_and_refuses_holes(model):
    src, mask, _ = ragged_batch([3, 4])
    with torch.no_grad():
        memory = model.encode(src, mask)
        state, fresh = (Seq2SeqState(model, memory, mask, BOS, use_cache=c) for c in (True, False))
        state.mark(1)
        state.append(torch.tensor([[5, 6, 7], [8, 9, 10]]))
        state.next_logits()                                     # the cache has seen all four tokens
        state.rewind(1, torch.tensor([1, 1]))
        state.append(torch.tensor([11, 12]))
        assert state.cache.length == 2 and state.tokens.tolist() == [[BOS, 5, 11], [BOS, 8, 12]]
        fresh.append(torch.tensor([[5, 11], [8, 12]]))
        got, want = state.next_logits(), fresh.next_logits()
    assert_close_scaled(got, want, FP32)
    assert state.can_rewind
    state.rewind(1, torch.tensor([2, 2]))                       # keeps every token: nothing to forget
    assert state.tokens.size(1) == 3
    with pytest.raises(ValueError, match="holes"):
        state.rewind(1, torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="holes"):
        state.append(torch.tensor([[5], [6]]), real=torch.tensor([[True], [False]]))
    for start, keep in ((0, [1, 1]), (1, [3, 3]), (1, [-1, 0]), (1.0, [1, 1])):
        with pytest.raises(ValueError, match="start|keep"):
            state.rewind(start, torch.tensor(keep))


def test_translate_samples_reproducibly(model):
    tok = DigitTokenizer()
    texts = ["123", "9876543", "5", "44"]
    one = translate(model, tok, tok, texts, temperature=1.5, generator=_seeded(3))
    assert one == translate(model, tok, tok, texts, temperature=1.5, generator=_seeded(3))
    assert one != translate(model, tok, tok, texts)
    assert translate(model, tok, tok, texts, temperature=1.5, top_k=1, generator=_seeded(3)) == \
        translate(model, tok, tok, texts)
    with pytest.raises(ValueError, match="sample"):
        translate(model, tok, tok, texts, beam_size=2, temperature=1.0)


# ---------------------------------------------------------------------------- translate and arguments
class DigitTokenizer:
    pad_id, bos_id, eos_id = 0, 1, 17

    def encode(self, text):
        return [3 + int(c) for c in text]

    def decode(self, ids):
        return "".join(str(i - 3) for i in ids)


def test_translate_matches_greedy_and_keeps_order(model):
    tok = DigitTokenizer()
    texts = ["123", "9876543", "5", "44"]
    model.train()
    out = translate(model, tok, tok, texts, batch_size=2)
    assert model.training, "translate gives the model its mode back"
    model.eval()
    for text, got in zip(texts, out):
        ids = tok.encode(text) + [tok.eos_id]
        row = strip(greedy_decode(model, torch.tensor([ids]), max_len=2 * len(ids) + 10, bos_id=1, eos_id=17)[0])
        assert got == tok.decode([t for t in row if t != 17])
    assert translate(model, tok, tok, texts, beam_size=3, batch_size=3) == \
        translate(model, tok, tok, texts[::-1], beam_size=3, batch_size=1)[::-1]


def test_bad_arguments_raise(model):
    src, mask, _ = ragged_batch([3, 4])
    kw = dict(max_len=5, bos_id=BOS, eos_id=EOS)
    bad = [
        lambda: beam_search(model, src, mask, beam_size=0, **kw),
        lambda: beam_search(model, src, mask, length_penalty=float("nan"), **kw),
        lambda: greedy_decode(model, src, mask, max_len=0, bos_id=BOS, eos_id=EOS),
        lambda: greedy_decode(model, src, mask, max_len=[5], bos_id=BOS, eos_id=EOS),
        lambda: greedy_decode(model, src, mask, max_len=65, bos_id=BOS, eos_id=EOS),
        lambda: greedy_decode(model, src.float(), mask, **kw),
        lambda: greedy_decode(model, src[0], None, **kw),
        lambda: greedy_decode(model, src, mask[:, :2], **kw),
        lambda: greedy_decode(model, src, mask.long(), **kw),
        lambda: greedy_decode(model, src, mask, max_len=5, bos_id=-1, eos_id=EOS),
        lambda: top_k_filter(src.float(), 0),
        lambda: top_p_filter(src.float(), 0.0),
        lambda: top_p_filter(src.float(), 1.5),
        lambda: sample(src.float(), -1.0),
        lambda: sample_decode(model, src, mask, temperature=-1.0, **kw),
        lambda: sample_decode(model, src, mask, top_k=0, **kw),
        lambda: translate(model, DigitTokenizer(), DigitTokenizer(), "123"),
        lambda: translate(model, DigitTokenizer(), DigitTokenizer(), ["1" * 70]),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(ValueError):
            call()
