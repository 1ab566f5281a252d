"""The decoding state protocol: a recurrent LM with a constant-size state decodes through the
same loops as the Transformers (greedy, sampling, beam search, speculative decoding), rewinding
rejected drafts row by row from its snapshots, and a state that cannot rewind is refused.

The toy is a GRU-cell language model written here, not a CausalLM and without positions (no
``max_seq_len``); its state is one (B, H) tensor in an attnlab.nn.cache.RecurrentState, which
is all the loops see.
"""
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import attnlab.generate.speculative as G
from attnlab.generate import CausalState, GenerationStats, generate, run_beam_search
from attnlab.nn.cache import DecodingState, LayerCaches, RecurrentState
from _decoding import chi2_sf, chi_square, exhaustive_best, causal_logprob  # noqa: E402  (tests/ is on sys.path)

V, H = 7, 16


class GRULM(nn.Module):
    """ids (B, T) -> embedding -> GRU cell, one position at a time -> linear head -> logits (B, T, V).

    ``attention_mask`` (B, cached + T) marks real tokens: at padding (and at holes) the state is
    carried over unchanged, so a left-padded prompt ends in the state it would have alone. The
    state advances one position at a time, as a recurrent state that keeps snapshots requires.
    ``context`` sets ``config.max_seq_len`` (by default there is none: the model has no positions).
    """

    def __init__(self, seed: int, scale: float = 1.5, context: int | None = None):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=V, **({} if context is None else {"max_seq_len": context}))
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
                cache.advance(1)
        return self.head(torch.stack(outputs, dim=1))


class FixedGRULM(GRULM):
    """The same GRU with a state that keeps no snapshots, so it says it cannot rewind."""

    def new_cache(self) -> RecurrentState:
        return RecurrentState([None], can_rewind=False)


class ContraryDraft(GRULM):
    """The target's twin, except that right after token ``z`` it proposes the token after the
    target's argmax: rows whose greedy path never meets ``z`` accept every draft, the others not."""

    def __init__(self, z: int, seed: int, **kw):
        super().__init__(seed=seed, **kw)
        self.z = z

    def forward(self, input_ids, attention_mask=None, positions=None, cache=None):
        logits = super().forward(input_ids, attention_mask, positions, cache)
        wrong = nn.functional.one_hot((logits.argmax(-1) + 1) % V, V)
        return logits + 100.0 * wrong * (input_ids == self.z)[..., None]


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
    assert isinstance(rnn.new_cache(), DecodingState) and rnn.new_cache().can_rewind
    assert isinstance(LayerCaches(2), DecodingState) and LayerCaches(2).can_rewind
    assert not RecurrentState([None], can_rewind=False).can_rewind
    assert not hasattr(rnn.config, "max_seq_len")


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


# ---------------------------------------------------------------------------- speculative decoding
def test_recurrent_speculative_greedy_equals_plain_greedy(rnn):
    _, ids, mask = _prompts()
    plain = generate(rnn, ids, 14, attention_mask=mask)
    # drafting for itself greedily, every draft is accepted
    stats = GenerationStats()
    assert torch.equal(generate(rnn, ids, 14, attention_mask=mask, draft_model=rnn, stats=stats), plain)
    assert stats.accepted == stats.drafted > 0
    # a perturbed GRU: rows reject at different draft positions, each rewinds to its own snapshot
    draft = GRULM(seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(0.15 * torch.randn(p.shape, generator=g))
    for k in (1, 2, 4):
        stats = GenerationStats()
        got = generate(rnn, ids, 14, attention_mask=mask, draft_model=draft, num_draft_tokens=k, stats=stats)
        assert torch.equal(got, plain), f"k={k}"
        assert 0 < stats.accepted < stats.drafted, (k, stats)


ONE_ROW_SEED = 5           # a GRU whose greedy paths from these prompts do not settle at once on one token


def _one_row_rejects(context):
    """Rows 0 and 1 of the prompts, their plain greedy output, and a token z that row 1's greedy
    path feeds the model but row 0's never does."""
    _, ids, mask = _prompts()
    ids, mask = ids[:2], mask[:2]
    plain = generate(GRULM(seed=ONE_ROW_SEED, context=context), ids, 12, attention_mask=mask)
    fed = [set(plain[i, 4:-1].tolist()) for i in range(2)]       # last prompt token and all but the last new one
    candidates = sorted(fed[1] - fed[0])
    assert candidates, "the two rows' greedy paths must differ for the test to mean anything"
    return ids, mask, plain, candidates[0]


@pytest.mark.parametrize("context", [None, 64])
def test_recurrent_speculative_rejected_on_one_row_of_two_equals_greedy(context):
    """Row 0 accepts every draft in every round, so the batch-wide accepted count is always k;
    row 1 rejects some: its state must go back to its own accepted length, not keep the
    rejected tokens it has folded in."""
    ids, mask, plain, z = _one_row_rejects(context)
    target, draft = GRULM(seed=ONE_ROW_SEED, context=context), ContraryDraft(z, ONE_ROW_SEED, context=context)
    for k in (2, 4):
        stats = GenerationStats()
        got = generate(target, ids, 12, attention_mask=mask, draft_model=draft, num_draft_tokens=k, stats=stats)
        assert stats.accepted < stats.drafted, "row 1 must reject drafts"
        assert torch.equal(got, plain), f"k={k}: {got[:, 5:].tolist()} != {plain[:, 5:].tolist()}"
        alone = generate(target, ids[:1], 12, draft_model=draft, num_draft_tokens=k)
        assert torch.equal(alone, plain[:1])


# the output distribution is the target's with per-row rewinds in a batch of SAMPLES rows
SAMPLES, OPTS = 3000, dict(temperature=1.0, top_k=5)


@pytest.fixture(scope="module")
def gru_pair():
    """A target and a flatter draft GRU, and the target's exact distribution (V, V, V) of the
    first three tokens after ``prompt``, by enumeration without any state."""
    target, draft = GRULM(seed=0), GRULM(seed=7, scale=0.5)
    prompt = torch.tensor([[1, 4, 2]])
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V))
    with torch.no_grad():
        p1 = G.token_probs(target(prompt)[0, -1], **OPTS)
        p2 = G.token_probs(target(torch.cat([prompt.expand(V, -1), grid[::V, :1]], 1))[:, -1], **OPTS)
        p3 = G.token_probs(target(torch.cat([prompt.expand(len(grid), -1), grid], 1))[:, -1], **OPTS)
        q1 = G.token_probs(draft(prompt)[0, -1], **OPTS)
    assert (p1 - q1).abs().sum() > 0.2, "the draft must disagree with the target for the test to mean anything"
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(V, V, V)
    return target, draft, prompt, joint


def _gru_statistics(gru_pair):
    target, draft, prompt, joint = gru_pair
    out = generate(target, prompt.expand(SAMPLES, -1), 3, draft_model=draft, num_draft_tokens=2,
                   generator=torch.Generator().manual_seed(0), **OPTS)[:, 3:]
    counts = torch.zeros(V, V, V).index_put_(tuple(out.T), torch.ones(SAMPLES), accumulate=True)
    return [chi_square(counts.sum(dims).flatten(), joint.sum(dims).flatten()) for dims in ((1, 2), 2, 0)]


def test_recurrent_speculative_sampling_keeps_the_target_distribution(gru_pair):
    for what, (x, df) in zip(["token 1", "tokens 1-2", "tokens 2-3"], _gru_statistics(gru_pair)):
        assert chi2_sf(x, df) > 0.001, f"{what}: chi2 {x:.1f} with {df} df"


def test_chi_square_catches_a_rewind_that_ignores_rows(gru_pair, monkeypatch):
    """Restoring every row at the batch's longest accepted length (keeping rejected tokens folded
    into the rows that accepted fewer) is what masking holes would do to a recurrent state."""
    restore = RecurrentState._restore

    def restore_at_longest(self, keep):
        restore(self, torch.full_like(keep, int(keep.max())))
    monkeypatch.setattr(RecurrentState, "_restore", restore_at_longest)
    stats = _gru_statistics(gru_pair)
    assert any(chi2_sf(x, df) < 0.001 for x, df in stats[1:]), f"pair statistics {stats} miss the bug"


def test_state_that_cannot_rewind_is_refused_up_front(rnn):
    _, ids, mask = _prompts()
    fixed = FixedGRULM(seed=0)
    for target, draft, who in ((fixed, rnn, "the model's"), (rnn, fixed, "the draft model's")):
        stats = GenerationStats()
        with pytest.raises(ValueError, match=f"^speculative decoding: {who} decoding state \\(RecurrentState\\) "
                                             f"cannot rewind") as err:
            generate(target, ids, 10, attention_mask=mask, draft_model=draft, stats=stats)
        assert "\n" not in str(err.value)
        assert stats.target_passes == stats.draft_passes == 0, "refused before any forward pass"
    # it decodes everything that does not rewind
    assert torch.equal(generate(fixed, ids, 10, attention_mask=mask), generate(rnn, ids, 10, attention_mask=mask))
    assert torch.equal(generate(fixed, ids, 6, attention_mask=mask, num_beams=3),
                       generate(rnn, ids, 6, attention_mask=mask, num_beams=3))


# ---------------------------------------------------------------------------- the state itself
def _advanced(values, steps=1, **kw):
    state = RecurrentState([None], **kw)
    for v in values:
        state.tensors[0] = torch.tensor(v, dtype=torch.float32).view(-1, 1)
        state.advance(steps)
    return state


def test_recurrent_state_reorders_and_rewinds_per_row_from_snapshots():
    state = _advanced([[0, 10, 20]])                              # length 1
    state.mark(2)                                                 # snapshots from length 2 on
    for v in ([1, 11, 21], [2, 12, 22], [3, 13, 23]):
        state.tensors[0] = torch.tensor(v, dtype=torch.float32).view(-1, 1)
        assert state.stepwise
        state.advance(1)
    assert sorted(state._snapshots) == [2, 3, 4]
    state.rewind(torch.tensor([2, 4, 3]), 4)                      # rows go back to their own lengths
    assert state.tensors[0].view(-1).tolist() == [1, 13, 22] and state.length == 4
    assert not state.stepwise and not state._snapshots         # a rewind ends the mark
    state.reorder(torch.tensor([2, 2, 0]))
    assert state.tensors[0].view(-1).tolist() == [22, 22, 1]
    state.rewind(torch.tensor([4, 4, 4]), 4)                      # to where it is: nothing to restore
    with pytest.raises(ValueError, match="cannot go back from 4 to 3 positions: it keeps snapshots only after"):
        state.rewind(torch.tensor([3, 4, 4]), 4)
    state.mark(4)
    state.tensors[0] = torch.tensor([5.0, 6.0, 7.0]).view(-1, 1)
    state.advance(1)
    state.reorder(torch.tensor([1, 0, 2]))                        # snapshots follow the rows
    state.rewind(torch.tensor([4, 5, 4]), 5)
    assert state.tensors[0].view(-1).tolist() == [22, 5, 1]
    for keep, length in (([4, 4, 4], 6), ([6, 4, 4], 5), ([-1, 4, 4], 5), ([4.0, 4, 4], 5), ([4, 4], 2.0)):
        with pytest.raises(ValueError, match="rewind: (keep|length)"):
            state.rewind(torch.tensor(keep), length)


def test_recurrent_state_refuses_to_skip_a_snapshot_and_without_snapshots():
    state = _advanced([[0, 1]], steps=3)                          # jumps are fine without a mark
    state.mark(4)
    with pytest.raises(ValueError, match=r"advance\(2\): while a rewind point is marked"):
        state.advance(2)
    state.tensors[0] = torch.tensor([[5.0], [6.0]])
    state.advance(1)                                              # to length 4, which is snapshotted
    fixed = _advanced([[0, 1], [2, 3]], can_rewind=False)
    fixed.mark(1)
    assert not fixed.stepwise
    fixed.rewind(torch.tensor([2, 2]), 2)
    with pytest.raises(ValueError, match="from 2 to 1 positions: it was made with can_rewind=False"):
        fixed.rewind(torch.tensor([1, 2]), 2)


# ---------------------------------------------------------------------------- the model side
def test_recurrent_lm_gets_generate_without_its_own_copy(rnn):
    from attnlab.generate.text import complete
    from attnlab.models.causal_lm import GenerationMixin

    class GRUWithGenerate(GenerationMixin, GRULM):
        pass
    model = GRUWithGenerate(seed=0)
    _, ids, mask = _prompts()
    assert torch.equal(model.generate(ids, 9, attention_mask=mask, draft_model=GRULM(seed=5)),
                       generate(rnn, ids, 9, attention_mask=mask))
    tokenizer = SimpleNamespace(decode=lambda ids: "".join("abcdefg"[i] for i in ids))
    done = complete(model, tokenizer, [1, 2], 300, temperature=0.0)     # no context to cap it at
    assert done.new_tokens == done.max_new_tokens == 300
    assert done.text == tokenizer.decode(generate(rnn, torch.tensor([[1, 2]]), 300)[0, 2:].tolist())


def test_causal_lm_refuses_a_state_that_is_not_its_kv_cache():
    from attnlab.models import GPT, GPTConfig
    gpt = GPT(GPTConfig(vocab_size=V, n_positions=16, d_model=8, num_heads=2, num_layers=1, dropout=0.0)).eval()
    with pytest.raises(ValueError, match="cache must be the model's KV cache .* got RecurrentState"):
        gpt(torch.tensor([[1, 2]]), cache=RecurrentState([None]))
