"""The decoding state protocol: a recurrent LM with a constant-size state decodes through the
same loops as the Transformers (greedy, sampling, beam search, speculative decoding), and a
state that cannot go back says so clearly.

The toy is a GRU-cell language model written here; its state is one (B, H) tensor in an
attnlab.nn.cache.RecurrentState, which is all the loops see.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from attnlab.generate import CausalState, GenerationStats, generate, run_beam_search
from attnlab.nn.cache import CannotTruncateError, DecodingState, LayerCaches, RecurrentState
from _decoding import exhaustive_best, causal_logprob  # noqa: E402  (tests/ is on sys.path under pytest)

V, H = 7, 16


class GRULM(nn.Module):
    """ids (B, T) -> embedding -> GRU cell, one position at a time -> linear head -> logits (B, T, V).

    ``attention_mask`` (B, cached + T) marks real tokens: at padding (and at holes) the state is
    carried over unchanged, so a left-padded prompt ends in the state it would have alone.
    """

    def __init__(self, seed: int, scale: float = 1.5):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=V, max_seq_len=1000)
        self.embedding, self.cell, self.head = nn.Embedding(V, H), nn.GRUCell(H, H), nn.Linear(H, V)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(scale * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.eval()

    def new_cache(self) -> RecurrentState:
        return RecurrentState([None])

    def forward(self, input_ids, attention_mask=None, positions=None, cache=None):
        B, T = input_ids.shape
        real = torch.ones(B, T, dtype=torch.bool) if attention_mask is None else attention_mask.bool()[:, -T:]
        h = None if cache is None else cache.tensors[0]
        h = input_ids.new_zeros(B, H, dtype=torch.float32) if h is None else h
        x, outputs = self.embedding(input_ids), []
        for t in range(T):
            h = torch.where(real[:, t, None], self.cell(x[:, t], h), h)
            outputs.append(h)
        if cache is not None:
            cache.tensors[0] = h
            cache.advance(T)
        return self.head(torch.stack(outputs, dim=1))


@pytest.fixture(scope="module")
def rnn():
    return GRULM(seed=0)


def _prompts():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, V, (n,), generator=g) for n in (5, 2, 4)]
    ids = torch.zeros(3, 5, dtype=torch.long)
    mask = torch.zeros(3, 5, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 5 - len(p):], mask[i, 5 - len(p):] = p, 1
    return prompts, ids, mask


@torch.no_grad()
def _greedy_by_hand(model, prompt, n):
    """Argmax continuation recomputed from scratch each step: no state object at all."""
    ids = prompt[None]
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):]


def test_states_meet_the_protocol(rnn):
    assert isinstance(rnn.new_cache(), DecodingState)
    assert isinstance(LayerCaches(2), DecodingState)


def test_recurrent_greedy_cached_uncached_and_batched(rnn):
    prompts, ids, mask = _prompts()
    stats = GenerationStats()
    cached = generate(rnn, ids, 12, attention_mask=mask, stats=stats)
    assert stats.target_passes == 12, "one prefill then one step per token, through the recurrent state"
    assert torch.equal(cached, generate(rnn, ids, 12, attention_mask=mask, use_cache=False))
    for i, p in enumerate(prompts):
        assert cached[i, 5:].tolist() == _greedy_by_hand(rnn, p, 12).tolist(), f"row {i}"
    assert len(set(map(tuple, cached[:, 5:].tolist()))) > 1, "rows should differ"


def test_recurrent_sampling(rnn):
    _, ids, mask = _prompts()

    def run(seed, **kw):
        return generate(rnn, ids, 16, attention_mask=mask, generator=torch.Generator().manual_seed(seed), **kw)
    opts = dict(temperature=1.2, top_p=0.95, repetition_penalty=1.3)
    assert torch.equal(run(0, **opts), run(0, use_cache=False, **opts))
    assert not torch.equal(run(0, **opts), run(1, **opts))
    assert torch.equal(run(0, temperature=1.0, top_k=1), generate(rnn, ids, 16, attention_mask=mask))


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_recurrent_beam_search(rnn, length_penalty):
    prompts, ids, mask = _prompts()
    eos = 3
    greedy = generate(rnn, ids, 8, attention_mask=mask, eos_token_id=eos)[:, 5:].tolist()
    one = run_beam_search(CausalState(rnn, ids, mask), [8] * 3, [eos], beam_size=1, length_penalty=length_penalty)
    assert [h[0].tokens for h in one] == [r[:r.index(eos) + 1] if eos in r else r for r in greedy]
    beams = generate(rnn, ids, 8, attention_mask=mask, eos_token_id=eos, num_beams=4, length_penalty=length_penalty)
    assert torch.equal(beams, generate(rnn, ids, 8, attention_mask=mask, eos_token_id=eos, num_beams=4,
                                       length_penalty=length_penalty, use_cache=False))
    # exhaustive for 3 tokens: K = 6**2 covers every live prefix; batched rows equal each alone
    for i, p in enumerate(prompts):
        (best, tokens), (second, _) = exhaustive_best(causal_logprob(rnn, p), V, 3, eos, length_penalty)
        hyps = run_beam_search(CausalState(rnn, p[None]), [3], [eos], beam_size=36, length_penalty=length_penalty)[0]
        assert hyps[0].normalized_score == pytest.approx(best, rel=1e-5, abs=1e-6)
        if best - second > 1e-4:
            assert hyps[0].tokens == tokens, f"row {i}"
        alone = generate(rnn, p[None], 8, eos_token_id=eos, num_beams=4, length_penalty=length_penalty)[0, len(p):]
        assert beams[i, 5:5 + alone.numel()].tolist() == alone.tolist()


def test_run_beam_search_checks_its_limits(rnn):
    _, ids, mask = _prompts()
    for bad in ([4, 4], [4, 4, 0], [4, 4, 2.0]):
        with pytest.raises(ValueError, match="limits"):
            run_beam_search(CausalState(rnn, ids, mask), bad, [3])


def test_recurrent_speculative_decoding_needs_truncation(rnn):
    _, ids, mask = _prompts()
    plain = generate(rnn, ids, 10, attention_mask=mask)
    # drafting for itself greedily, every draft is accepted: no position is ever rolled back
    stats = GenerationStats()
    assert torch.equal(generate(rnn, ids, 10, attention_mask=mask, draft_model=rnn, stats=stats), plain)
    assert stats.accepted == stats.drafted > 0
    # a draft that disagrees makes the state go back: a clear error, not a wrong answer
    with pytest.raises(CannotTruncateError, match="(?i)cannot go back .* speculative decoding"):
        generate(rnn, ids, 10, attention_mask=mask, draft_model=GRULM(seed=5))


def test_recurrent_state_reorder_and_truncate():
    state = RecurrentState([torch.arange(6.0).view(3, 2), None])
    state.advance(4)
    state.reorder(torch.tensor([2, 2, 0]))
    assert state.tensors[0].tolist() == [[4.0, 5.0], [4.0, 5.0], [0.0, 1.0]] and state.tensors[1] is None
    state.truncate(4)                                         # to its own length: nothing to forget
    with pytest.raises(CannotTruncateError, match="from 4 to 3 positions"):
        state.truncate(3)
    for bad in (5, -1, 2.5, True):
        with pytest.raises(ValueError, match="length"):
            state.truncate(bad)
