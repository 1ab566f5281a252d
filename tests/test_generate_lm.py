"""Causal-LM generation (attnlab.generate.generate): cache, left padding, repetition penalty,
sampling, stopping, and speculative decoding (pitfalls 11 and 13).

Models are tiny random attnlab GPT / LLaMA models, with their weights scaled up so that their
next-token distributions are far from uniform and differ between models; the transformers
comparisons go through a tiny random Hugging Face model loaded with attnlab.from_pretrained.
"""
import math

import pytest
import torch

import attnlab.generate.speculative as G
from attnlab.generate import GenerationStats, apply_repetition_penalty, generate, seen_tokens
from attnlab.models import GPT, GPTConfig, Llama, LlamaConfig
from attnlab.nn.cache import KVCache
from _decoding import CRITICAL_0001, causal_logprob, chi2_sf as _chi2_sf, chi_square as _chi_square  # noqa: E402
from _decoding import exhaustive_best  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

V, CTX = 64, 256


def _scaled(model, seed: int, scale: float):
    """Re-draw every matrix as N(0, scale**2) from ``seed``: O(1) logits, a distinct model per seed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def _llama(seed=0, vocab=V, layers=2, scale=0.3):
    config = LlamaConfig(vocab_size=vocab, d_model=32, num_heads=4, num_kv_heads=2, num_layers=layers, d_ff=64,
                         max_position_embeddings=CTX)
    return _scaled(Llama(config), seed, scale)


def _gpt(seed=0, vocab=V, layers=2, d_model=32, scale=0.3, ctx=CTX):
    config = GPTConfig(vocab_size=vocab, n_positions=ctx, d_model=d_model, num_heads=4, num_layers=layers,
                       dropout=0.0)
    return _scaled(GPT(config), seed, scale)


@pytest.fixture(scope="module")
def llama():
    return _llama()


@pytest.fixture(scope="module")
def gpt():
    return _gpt()


def _ids(B, T, seed, vocab=V):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def _left_padded(prompts, pad=0):
    """Left-pad a list of 1-D prompts -> ids (B, T), mask (B, T)."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask


# ---------------------------------------------------------------------------- parity with transformers
def _hf_pair(family, path):
    """A tiny random transformers model of ``family`` (weights large enough for peaked
    distributions) and the attnlab model that attnlab.from_pretrained makes of it."""
    transformers = pytest.importorskip("transformers")
    import attnlab
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    else:
        config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.bos_token_id = config.eos_token_id = config.pad_token_id = None
    hf = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0          # norm scales around 1
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))
    hf.eval().save_pretrained(path)
    return hf, attnlab.from_pretrained(path)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_and_repetition_penalty_equal_transformers(family, tmp_path):
    hf, ours = _hf_pair(family, tmp_path)
    prompt = _ids(2, 6, seed=8)
    for penalty in (1.0, 1.8):
        with torch.no_grad():
            want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False, repetition_penalty=penalty, eos_token_id=None, pad_token_id=0)
        got = generate(ours, prompt, 32, repetition_penalty=penalty)
        assert got.shape == (2, 38)
        assert torch.equal(got, want), f"{family} penalty {penalty}:\nattnlab {got.tolist()}\nHF      {want.tolist()}"


def test_beam_search_equals_transformers_with_eos(tmp_path):
    """With EOS ids that end hypotheses early, the best hypothesis equals transformers' under
    ``early_stopping="never"`` (K live beams each step, a stop that cannot lose the best): each
    row compared up to and including its first EOS (after it both sides only pad)."""
    hf, ours = _hf_pair("gpt2", tmp_path)
    ids, mask = _left_padded([_ids(1, 6, 80)[0], _ids(1, 3, 81)[0], _ids(1, 5, 82)[0]])
    free = generate(ours, ids, 10, attention_mask=mask)[:, -10:]
    ended = 0
    for eos in sorted(set(free[:, 2:].flatten().tolist()))[:4]:
        for beams, length_penalty in ((3, 1.0), (4, 0.0)):
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, num_beams=beams, do_sample=False,
                                   length_penalty=length_penalty, early_stopping="never", eos_token_id=eos,
                                   pad_token_id=0)[:, ids.size(1):].tolist()
            got = generate(ours, ids, 10, attention_mask=mask, num_beams=beams, length_penalty=length_penalty,
                           eos_token_id=eos)[:, ids.size(1):].tolist()
            cut = [[r[:r.index(eos) + 1] if eos in r else r for r in rows] for rows in (got, want)]
            assert cut[0] == cut[1], f"eos {eos}, {beams} beams, length penalty {length_penalty}"
            ended += sum(len(r) < 10 for r in cut[0])
    assert ended >= 3, "some best hypotheses should end at EOS"


def test_beam_search_equals_transformers_without_eos(tmp_path):
    """Without an EOS every hypothesis ends at max_new_tokens, where attnlab's search (exact stop)
    and transformers' default (heuristic stop) coincide."""
    hf, ours = _hf_pair("gpt2", tmp_path)
    ids, mask = _left_padded([_ids(1, 6, 80)[0], _ids(1, 3, 81)[0]])
    for beams, length_penalty in ((2, 1.0), (4, 0.0), (5, 2.0)):
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10, num_beams=beams,
                               do_sample=False, length_penalty=length_penalty, eos_token_id=None, pad_token_id=0)
        got = generate(ours, ids, 10, attention_mask=mask, num_beams=beams, length_penalty=length_penalty)
        assert torch.equal(got[:, -10:], want[:, -10:]), f"{beams} beams:\nattnlab {got.tolist()}\nHF {want.tolist()}"
        assert not torch.equal(got, generate(ours, ids, 10, attention_mask=mask)), "beams should beat greedy here"


def test_repetition_penalty_equals_transformers_processor():
    transformers = pytest.importorskip("transformers")
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 3] = 0.0                                       # zero: unchanged either way
    ids = torch.tensor([[3, 1, 1, 7, 2], [0, 0, 9, 5, 9]])
    want = transformers.RepetitionPenaltyLogitsProcessor(1.7)(ids, logits.clone())
    got = apply_repetition_penalty(logits, seen_tokens(ids, 10), 1.7)
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)
    # padding is not "seen": row 1's pad id 0 keeps its logit
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    padded = apply_repetition_penalty(logits, seen_tokens(ids, 10, mask), 1.7)
    assert padded[1, 0] == logits[1, 0] and padded[1, 9] == want[1, 9] and torch.equal(padded[0], want[0])


# ---------------------------------------------------------------------------- cache and padding (pitfall 11)
def test_cached_equals_uncached_tokens_and_logits(llama, monkeypatch):
    ids, mask = _left_padded([_ids(1, 7, 1)[0], _ids(1, 3, 2)[0], _ids(1, 5, 3)[0]])
    runs = {}
    for use_cache in (True, False):
        seen = runs[use_cache] = []
        forward = type(llama).forward

        def recording(*args, **kwargs):
            logits = forward(llama, *args, **kwargs)
            seen.append(logits[:, -1])
            return logits
        monkeypatch.setattr(llama, "forward", recording)
        runs[use_cache] = (generate(llama, ids, 20, attention_mask=mask, use_cache=use_cache), seen)
        monkeypatch.undo()
    (cached, cached_logits), (full, full_logits) = runs[True], runs[False]
    assert torch.equal(cached, full)
    assert len(cached_logits) == len(full_logits) == 20
    for step, (a, b) in enumerate(zip(cached_logits, full_logits)):
        assert_close_scaled(a, b, FP32, f"step {step}: cached vs uncached logits")


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_left_padded_batch_equals_each_prompt_alone(name, request):
    model = request.getfixturevalue(name)
    prompts = [_ids(1, n, 10 + n)[0] for n in (7, 2, 4)]
    ids, mask = _left_padded(prompts)
    got = generate(model, ids, 16, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone = generate(model, p[None], 16)
        assert torch.equal(got[i, -16:], alone[0, -16:]), f"row {i} differs from its prompt alone"


def test_cache_grows_by_doubling_not_every_step(gpt, monkeypatch):
    calls = []
    grow = KVCache._grow

    def counting(self, need):
        calls.append(need)
        grow(self, need)
    monkeypatch.setattr(KVCache, "_grow", counting)
    out = generate(gpt, _ids(1, 3, 4), 200)
    assert out.shape == (1, 203)
    # capacity 64 -> 128 -> 256: two re-allocations per layer for 203 positions, not ~140
    assert len(calls) == 2 * len(gpt.layers), calls
    calls.clear()
    generate(gpt, _ids(1, 3, 4), 200, draft_model=gpt)          # truncation never re-allocates either
    assert len(calls) <= 4 * len(gpt.layers), calls


def test_cache_truncate(gpt):
    cache = gpt.new_cache()
    ids = _ids(1, 9, 5)
    with torch.no_grad():
        gpt(ids, cache=cache)
        cache.truncate(5)
        assert cache.length == 5
        resumed = gpt(ids[:, 5:], cache=cache)
        want = gpt(ids)[:, 5:]
    assert_close_scaled(resumed, want, FP32)
    for bad in (10, -1, 2.0, True):
        with pytest.raises(ValueError, match="length"):
            cache.truncate(bad)


# ---------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llama):
    prompt = _ids(2, 5, 6)

    def run(seed, **kw):
        return generate(llama, prompt, 24, generator=torch.Generator().manual_seed(seed), **kw)
    opts = dict(temperature=0.9, top_k=20, top_p=0.9)
    assert torch.equal(run(0, **opts), run(0, **opts))
    assert not torch.equal(run(0, **opts), run(1, **opts))
    greedy = generate(llama, prompt, 24)
    assert not torch.equal(run(0, temperature=1.0), greedy)
    assert torch.equal(run(0, temperature=1.0, top_k=1), greedy)
    assert torch.equal(run(0, temperature=1.0, top_p=1e-6), greedy)


# ---------------------------------------------------------------------------- stopping and checks
def test_eos_stopping_fill_and_streamer(llama):
    prompts = [_ids(1, 6, 20)[0], _ids(1, 4, 21)[0]]
    ids, mask = _left_padded(prompts)
    free = generate(llama, ids, 12, attention_mask=mask)
    eos = int(free[0, 6 + 2])                                      # row 0's third new token
    assert eos not in free[1, 6:].tolist(), "pick seeds where row 1 never produces row 0's EOS"
    columns = []
    got = generate(llama, ids, 12, attention_mask=mask, eos_token_id=eos, pad_token_id=1, streamer=columns.append)
    first = free[0, 6:].tolist().index(eos)
    assert torch.equal(got[0, 6:6 + first + 1], free[0, 6:6 + first + 1])
    assert (got[0, 6 + first + 1:] == 1).all(), "a finished row emits pad_token_id"
    assert torch.equal(got[1], free[1]), "an unfinished row runs to max_new_tokens"
    assert torch.equal(torch.stack(columns, 1), got[:, 6:]), "the streamer sees every new column, in order"
    alone = generate(llama, prompts[0][None], 12, eos_token_id=eos)
    assert alone.shape == (1, 6 + first + 1), "generation stops once every row has produced EOS"
    assert generate(llama, prompts[0][None], 3).shape == (1, 9)


def test_bad_arguments_raise(llama, gpt):
    prompt = _ids(1, 5, 7)
    with pytest.raises(ValueError, match="context"):
        generate(llama, _ids(1, 200, 7), 57)
    generate(llama, _ids(1, 200, 7), 56)                            # exactly the context is fine
    with pytest.raises(ValueError, match="out of range"):
        generate(llama, torch.tensor([[1, V]]), 2)
    with pytest.raises(ValueError, match="out of range"):
        generate(llama, torch.tensor([[-1, 2]]), 2)
    with pytest.raises(ValueError, match="LEFT"):
        generate(llama, _ids(2, 4, 1), 2, attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(llama, prompt, 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(llama, prompt, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        generate(llama, prompt, 2, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="eos_token_id"):
        generate(llama, prompt, 2, eos_token_id=V)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(llama, prompt, 2, draft_model=_gpt(vocab=V + 1, layers=1))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        generate(llama, prompt, 2, draft_model=gpt, num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft model's context"):
        generate(llama, prompt, 100, draft_model=_gpt(layers=1, ctx=64))


# ---------------------------------------------------------------------------- beam search (pitfall 12)
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_beam_one_equals_greedy(llama, length_penalty):
    from attnlab.generate import CausalState, run_beam_search
    prompts = [_ids(1, n, 40 + n)[0] for n in (6, 3, 5)]
    ids, mask = _left_padded(prompts)
    eos = int(generate(llama, ids, 10, attention_mask=mask)[0, 6 + 3])      # row 0 ends early
    greedy = generate(llama, ids, 10, attention_mask=mask, eos_token_id=eos)[:, 6:].tolist()
    assert any(eos not in row for row in greedy), "the case should mix EOS and max_new_tokens endings"
    nbest = run_beam_search(CausalState(llama, ids, mask), [10] * 3, [eos], beam_size=1,
                            length_penalty=length_penalty)
    for row, hyps in zip(greedy, nbest):
        assert hyps[0].tokens == (row[:row.index(eos) + 1] if eos in row else row)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_causal_beam_equals_exhaustive_search(length_penalty):
    """With K >= the live prefixes (4**3 before the last step), beam search is exhaustive: it must
    find the best of all sequences, and its early stop must not end it with a shorter, worse one
    (with length_penalty 2, greedy's one-token [EOS] finishes first and loses to four tokens)."""
    from attnlab.generate import CausalState, run_beam_search
    model, eos, max_new = _gpt(seed=7, vocab=5, layers=1, d_model=16, scale=0.3), 4, 4
    beaten = 0
    for seed in range(4):
        prompt = _ids(1, 4, 60 + seed, vocab=5)[0]
        (best, best_tokens), (second, _) = exhaustive_best(causal_logprob(model, prompt), 5, max_new, eos,
                                                           length_penalty)
        hyps = run_beam_search(CausalState(model, prompt[None]), [max_new], [eos], beam_size=64,
                               length_penalty=length_penalty)[0]
        assert hyps[0].normalized_score == pytest.approx(best, rel=1e-5, abs=1e-6)
        assert best - second > 1e-3, "pick cases without near-ties"
        assert hyps[0].tokens == best_tokens, f"seed {seed}"
        out = generate(model, prompt[None], max_new, eos_token_id=eos, num_beams=64, length_penalty=length_penalty)
        assert out[0, 4:].tolist() == best_tokens
        greedy = generate(model, prompt[None], max_new, eos_token_id=eos)[0, 4:].tolist()
        beaten += greedy != best_tokens
    assert beaten, "some case should have a best sequence that greedy misses"


def test_causal_beam_cached_uncached_and_batched_equal_alone(llama):
    prompts = [_ids(1, n, 70 + n)[0] for n in (5, 2, 7)]
    ids, mask = _left_padded(prompts)
    eos = int(generate(llama, ids, 8, attention_mask=mask)[1, 7 + 2])
    opts = dict(attention_mask=mask, eos_token_id=eos, num_beams=3, pad_token_id=0)
    cached = generate(llama, ids, 8, **opts)
    assert torch.equal(cached, generate(llama, ids, 8, use_cache=False, **opts))
    for i, p in enumerate(prompts):
        alone = generate(llama, p[None], 8, eos_token_id=eos, num_beams=3, pad_token_id=0)[0, len(p):]
        assert cached[i, 7:7 + alone.numel()].tolist() == alone.tolist(), f"row {i}"
    stats = GenerationStats()
    generate(llama, ids, 8, stats=stats, **opts)
    assert 1 <= stats.target_passes <= 8


def test_causal_beam_bad_combinations_raise(llama, gpt):
    prompt = _ids(1, 5, 7)
    for bad, match in [(dict(num_beams=0), "num_beams"), (dict(num_beams=2, length_penalty=math.inf), "length"),
                       (dict(num_beams=2, temperature=0.7), "temperature"), (dict(num_beams=2, top_k=3), "top_k"),
                       (dict(num_beams=2, draft_model=gpt), "draft_model"),
                       (dict(num_beams=2, repetition_penalty=1.2), "repetition_penalty"),
                       (dict(num_beams=2, streamer=print), "streamer")]:
        with pytest.raises(ValueError, match=match):
            generate(llama, prompt, 4, **bad)


# ---------------------------------------------------------------------------- speculative decoding
def _perturbed(model, seed, noise):
    """A copy of ``model`` with N(0, noise**2) added to every matrix: a draft that mostly agrees."""
    import copy
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() >= 2:
                p.add_(noise * torch.randn(p.shape, generator=g))
    return draft


def test_speculative_greedy_equals_plain_greedy(llama):
    prompts = [_ids(1, n, 30 + n)[0] for n in (6, 3, 9)]
    ids, mask = _left_padded(prompts)
    plain = generate(llama, ids, 32, attention_mask=mask)
    drafts = {"self": llama, "random": _gpt(seed=5, layers=1, d_model=16), "perturbed": _perturbed(llama, 3, 0.01)}
    rates = {}
    for name, draft in drafts.items():
        for k in (1, 4):
            stats = GenerationStats()
            got = generate(llama, ids, 32, attention_mask=mask, draft_model=draft, num_draft_tokens=k, stats=stats)
            assert torch.equal(got, plain), f"draft {name}, k={k}: speculative greedy differs from greedy"
            rates[name, k] = stats
        alone = GenerationStats()
        got = generate(llama, prompts[0][None], 32, draft_model=draft, stats=alone)
        assert torch.equal(got[0, -32:], plain[0, -32:])
        rates[name, "alone"] = alone
    self4 = rates["self", "alone"]
    # the target agrees with itself: every draft accepted, ceil(32 / 5) = 7 target passes
    assert self4.accepted == self4.drafted and self4.target_passes == 7, self4
    assert self4.target_passes_per_token == pytest.approx(7 / 32)
    assert 0.0 < rates["perturbed", "alone"].acceptance_rate < 1.0, "the perturbed draft should be partly right"
    assert rates["random", "alone"].target_passes_per_token >= rates["perturbed", "alone"].target_passes_per_token


def test_speculative_eos_and_streamer_equal_plain(llama):
    prompts = [_ids(1, 6, 20)[0], _ids(1, 4, 21)[0]]
    ids, mask = _left_padded(prompts)
    eos = int(generate(llama, ids, 12, attention_mask=mask)[0, 8])
    columns = []
    plain = generate(llama, ids, 12, attention_mask=mask, eos_token_id=eos)
    spec = generate(llama, ids, 12, attention_mask=mask, eos_token_id=eos, draft_model=llama, streamer=columns.append)
    assert torch.equal(spec, plain)
    assert torch.equal(torch.stack(columns, 1), spec[:, 6:])


def test_speculative_sampling_reproducible_and_with_penalty(llama):
    draft = _perturbed(llama, 3, 0.01)
    prompt = _ids(2, 5, 6)

    def run(seed, **kw):
        return generate(llama, prompt, 16, temperature=0.8, draft_model=draft,
                        generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(run(0), run(0))
    assert torch.equal(run(0, repetition_penalty=1.3), run(0, repetition_penalty=1.3))
    greedy = generate(llama, prompt, 16, repetition_penalty=1.5)
    assert torch.equal(generate(llama, prompt, 16, repetition_penalty=1.5, draft_model=draft), greedy)


# --- the output distribution is the target's (pitfall 13), tested with a chi-square test
SMALL_V, SAMPLES, OPTS = 6, 3000, dict(temperature=1.0, top_k=4)
def test_chi2_sf_matches_tables():
    for df, x in CRITICAL_0001.items():
        assert _chi2_sf(x, df) == pytest.approx(0.001, rel=2e-3), df


@pytest.fixture(scope="module")
def small_models():
    """A target and a draft over 6 tokens with clearly different next-token distributions, and the
    target's exact distribution (V, V, V) of the first three generated tokens."""
    target = _gpt(seed=1, vocab=SMALL_V, layers=1, d_model=16, scale=0.5)
    draft = _gpt(seed=2, vocab=SMALL_V, layers=1, d_model=16, scale=0.15)     # flatter: mass outside its top 4
    prompt = torch.tensor([[1, 4, 2]])
    grid = torch.cartesian_prod(torch.arange(SMALL_V), torch.arange(SMALL_V))                # (V*V, 2)
    with torch.no_grad():
        p1 = G.token_probs(target(prompt)[0, -1], **OPTS)                                   # (V,)
        p2 = G.token_probs(target(torch.cat([prompt.expand(SMALL_V, -1), grid[::SMALL_V, :1]], 1))[:, -1], **OPTS)
        p3 = G.token_probs(target(torch.cat([prompt.expand(len(grid), -1), grid], 1))[:, -1], **OPTS)
        q1 = G.token_probs(draft(prompt)[0, -1], **OPTS)
    assert (p1 - q1).abs().sum() > 0.2, "the draft must disagree with the target for the test to mean anything"
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(SMALL_V, SMALL_V, SMALL_V)
    assert joint.sum().item() == pytest.approx(1.0, abs=1e-5)
    return target, draft, prompt, joint


def _speculative_statistics(small_models):
    """Chi-square (statistic, df) of token 1, of tokens (1, 2) and of tokens (2, 3) of SAMPLES
    speculative generations with 2 draft tokens: together they cover acceptance and rejection at
    both draft positions and the bonus token after two acceptances."""
    target, draft, prompt, joint = small_models
    out = generate(target, prompt.expand(SAMPLES, -1), 3, draft_model=draft, num_draft_tokens=2,
                   generator=torch.Generator().manual_seed(0), **OPTS)[:, 3:]
    counts = torch.zeros(SMALL_V, SMALL_V, SMALL_V).index_put_(tuple(out.T), torch.ones(SAMPLES), accumulate=True)
    return [_chi_square(counts.sum(dims).flatten(), joint.sum(dims).flatten()) for dims in ((1, 2), 2, 0)]


def test_speculative_sampling_keeps_the_target_distribution(small_models):
    for what, (x, df) in zip(["token 1", "tokens 1-2", "tokens 2-3"], _speculative_statistics(small_models)):
        assert _chi2_sf(x, df) > 0.001, f"{what}: chi2 {x:.1f} with {df} df"


def _draft_samples_unfiltered(logits, sampling, generator):
    """Broken: reports the filtered q but draws from the unfiltered distribution (pitfall 13)."""
    return G._draw(G.token_probs(logits, sampling[0]), generator), G.token_probs(logits, *sampling)


def _residual_is_target(p, q):
    """Broken: after a rejection, samples from p instead of norm(max(0, p - q))."""
    return p


@pytest.mark.parametrize("name, broken", [("_draft_sample", _draft_samples_unfiltered),
                                          ("_residual", _residual_is_target)])
def test_chi_square_catches_broken_speculative_sampling(small_models, monkeypatch, name, broken):
    monkeypatch.setattr(G, name, broken)
    (x1, df1), *pairs = _speculative_statistics(small_models)
    assert df1 == 3 and x1 > CRITICAL_0001[3], f"{name}: first-token chi2 {x1:.1f} does not detect the bug"
    assert all(_chi2_sf(x, df) < 0.001 for x, df in pairs), f"{name}: pair statistics {pairs} miss the bug"

