"""T5 (relu feed-forward, head tied and scaled) and T5 v1.1 (gated GELU, own head) against
transformers' T5ForConditionalGeneration with the same weights, both ways through the
converter users call; generation against transformers' generate; cached decoding against
uncached; the unscaled attention that T5 needs from MultiHeadAttention."""
import pytest
import torch

import attnlab
import contract
from _tolerance import FP32, FP32_OP, assert_close_scaled
from attnlab.generate import beam_search, greedy_decode
from attnlab.models.registry import family
from attnlab.models.t5 import T5Config, T5ForConditionalGeneration, build_config, config_from_hf
from attnlab.nn.attention import MultiHeadAttention

transformers = pytest.importorskip("transformers")

T5 = family("t5")
# the tiny preset is original T5; v1.1 also gets a decoder deeper than the encoder and heads whose
# width d_kv * H (36) is not d_model (32)
CONFIGS = {"t5": {}, "t5-v1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                     num_decoder_layers=3, d_kv=12)}
V = T5.preset("tiny").vocab_size


def _ours(name: str, seed: int = 0) -> T5ForConditionalGeneration:
    """Weights of order 0.2 everywhere (norms around 1): every mapping error shows in the outputs."""
    torch.manual_seed(seed)
    model = T5.default.build(T5.preset("tiny", **CONFIGS[name]))
    contract.randomize_(model, seed)
    return model.eval()


def _generator(name: str, seed: int = 3) -> T5ForConditionalGeneration:
    """A model whose greedy and beam outputs vary with the source and whose argmaxes are far from
    ties: T5's own initialisation, the tied embedding made fainter (at full scale it dominates the
    residual stream and a tied head just repeats the input token), logits spread by the final norm."""
    torch.manual_seed(seed)
    model = T5.default.build(T5.preset("tiny", **CONFIGS[name]))
    with torch.no_grad():
        if model.config.tie_word_embeddings:
            model.shared.weight.mul_(0.2)
        model.decoder_norm.weight.fill_(10.0)
    return model.eval()


def _new_token(rows: list[list[int]], avoid: tuple[int, ...]) -> int:
    """A token some row produces for the first time at its third step or later (an EOS that ends
    a hypothesis early, rather than at once)."""
    for row in rows:
        for t in range(2, len(row)):
            if row[t] not in row[:t] and row[t] not in avoid:
                return row[t]
    raise AssertionError(f"no row produces a new token after its second: {rows}")


def _to_hf(model, path):
    attnlab.save_pretrained(model, path)
    hf, info = transformers.T5ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    return hf.eval()


def _padded_batch(seed: int = 5):
    """Sources (3, 11) with padding: row 0 full, row 1 right-padded, row 2 left-padded (T5's
    positions are indices, so transformers takes either); ids from 2 so none is pad or EOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, V, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, 7:] = False
    mask[2, :4] = False
    return src.masked_fill(~mask, 0), mask, torch.randint(2, V, (3, 6), generator=g)


# ----------------------------------------------------------------------------- attention scale
def test_attention_scale_replaces_one_over_sqrt_d():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16)
    plain = MultiHeadAttention(16, 2, bias=False)
    t5 = MultiHeadAttention(16, 2, bias=False, scale=1.0)
    t5.load_state_dict(plain.state_dict())
    q, k, v = (p(x).view(2, 5, 2, 8).transpose(1, 2) for p in (t5.q_proj, t5.k_proj, t5.v_proj))
    want = t5.out_proj((torch.softmax(q @ k.transpose(-1, -2), -1) @ v).transpose(1, 2).reshape(2, 5, 16))
    fused, _ = t5(x)
    explicit, weights = t5(x, return_weights=True)
    assert_close_scaled(fused, want, FP32_OP, "scale=1.0, fused")
    assert_close_scaled(explicit, want, FP32_OP, "scale=1.0, explicit")
    assert_close_scaled(weights, torch.softmax(q @ k.transpose(-1, -2), -1), FP32_OP, "scale=1.0 weights")
    assert (plain(x)[0] - want).abs().max() > 1e-3, "the default scale should differ from 1.0 here"


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_memory_equal_transformers_with_padding(name, tmp_path):
    model = _ours(name)
    hf = _to_hf(model, tmp_path)
    src, mask, tgt = _padded_batch()
    with torch.no_grad():
        want = hf(input_ids=src, attention_mask=mask.long(), decoder_input_ids=tgt)
        memory = model.encode(src, mask)
        logits = model(src, tgt, mask)
    assert_close_scaled(memory[mask], want.encoder_last_hidden_state[mask], FP32, f"{name} memory")
    assert_close_scaled(logits, want.logits, FP32, f"{name} logits")
    with torch.no_grad():       # the same call in transformers' words
        assert torch.equal(model(src, tgt, attention_mask=mask.long()), logits)
        # and each padded row alone, without padding
        alone = model(src[2:, 4:], tgt[2:])
    assert_close_scaled(alone[0], logits[2], FP32, f"{name}: padded row vs alone")


@pytest.mark.parametrize("name", CONFIGS)
def test_transformers_checkpoint_loads(name, tmp_path):
    config = T5.preset("tiny", **CONFIGS[name])
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5.config_to_hf(config)))
    if not config.tie_word_embeddings:      # transformers >= 5 ties at init; a v1.1 checkpoint has its own head
        hf.lm_head.weight = torch.nn.Parameter(torch.empty(V, config.d_model))
    contract.randomize_(hf, 3)
    hf.eval().save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is T5ForConditionalGeneration and ours.config == config
    assert (ours.lm_head.weight is ours.shared.weight) == config.tie_word_embeddings
    src, mask, tgt = _padded_batch(7)
    with torch.no_grad():
        assert_close_scaled(ours(src, tgt, mask), hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits,
                            FP32, f"{name} from transformers")


def test_encoder_model_equals_transformers_with_padding(tmp_path):
    model = T5.architecture("T5EncoderModel").build(T5.preset("tiny", d_kv=12))
    contract.randomize_(model, 4)
    attnlab.save_pretrained(model.eval(), tmp_path)
    hf, info = transformers.T5EncoderModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    src, mask, _ = _padded_batch(9)
    with torch.no_grad():
        got, want = model(src, mask), hf.eval()(input_ids=src, attention_mask=mask).last_hidden_state
    assert_close_scaled(got[mask], want[mask], FP32, "T5EncoderModel")


def test_gradient_checkpointing_gives_the_same_gradients():
    src, mask, tgt = _padded_batch()
    grads = []
    for checkpointing in (False, True):
        model = _ours("t5-v1.1").train()
        model.gradient_checkpointing = checkpointing
        model(src, tgt, mask).square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert_close_scaled(grads[1], grads[0], FP32, "checkpointed gradients")


def test_config_from_both_generations_of_transformers():
    base = dict(vocab_size=50, d_model=16, num_heads=2, d_kv=8, num_layers=1, d_ff=32)
    assert config_from_hf(base).tie_word_embeddings                                   # T5's default
    assert not config_from_hf(dict(base, tie_word_embeddings=False)).tie_word_embeddings   # v1.1 before 5.0
    v5 = dict(base, tie_word_embeddings=True, scale_decoder_outputs=False)             # v1.1 written by 5.x
    assert not config_from_hf(v5).tie_word_embeddings
    with pytest.raises(ValueError, match="feed_forward_proj 'gated-silu' is not supported"):
        config_from_hf(dict(base, feed_forward_proj="gated-silu"))


# ----------------------------------------------------------------------------- decoding
def test_decoder_bias_follows_the_cache(tmp_path):
    """Step-by-step decoding with the cache equals the full pass; the bias matters here, so a
    bias computed from position 0 at every step would fail."""
    model = _ours("t5-v1.1")
    src, mask, tgt = _padded_batch()
    with torch.no_grad():
        memory = model.encode(src, mask)
        full = model.decode(tgt, memory, mask)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, :2], memory, mask, cache=cache)]          # a prefill of two, then one by one
        steps += [model.decode(tgt[:, t:t + 1], memory, mask, cache=cache) for t in range(2, tgt.size(1))]
        steps = torch.cat(steps, 1)
        assert_close_scaled(steps, full, FP32, "cached vs full decoding")
        model.decoder_bias.relative_attention_bias.weight.zero_()
        assert (model.decode(tgt, memory, mask) - full).abs().max() > 1e-2, "the decoder bias should matter"


# transformers' generate builds its cache with the encoder's depth (num_layers), so a decoder of
# another depth (num_decoder_layers, as v1.1 here) fails in it: its generate runs without a cache,
# and attnlab's cached decoding is checked against its own uncached decoding instead.
def _cut(rows: list[list[int]], eos: int | None) -> list[list[int]]:
    """Each row up to and including its first EOS. transformers fills the rest of a beam row
    with EOS when pad_token_id is 0 (it reads the id as false) and greedy rows with the pad id;
    attnlab fills greedy rows with the pad id."""
    return [r[:r.index(eos) + 1] if eos in r else r for r in rows]


def _hf_tokens(out: torch.Tensor, eos: int | None) -> list[list[int]]:
    return _cut(out[:, 1:].tolist(), eos)          # transformers' rows start with the decoder start id


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_transformers_generate(name, tmp_path):
    model = _generator(name)
    hf = _to_hf(model, tmp_path)
    src, mask, _ = _padded_batch()
    c = model.config
    ids = dict(bos_id=c.decoder_start_token_id, pad_id=c.pad_token_id)
    free = greedy_decode(model, src, mask, max_len=12, eos_id=V, **ids)       # no EOS: 12 tokens each
    eos = _new_token(free.tolist(), (c.pad_token_id,))
    ours = greedy_decode(model, src, mask, max_len=12, eos_id=eos, **ids)
    assert torch.equal(ours, greedy_decode(model, src, mask, max_len=12, eos_id=eos, use_cache=False, **ids))
    with torch.no_grad():
        want = hf.generate(input_ids=src, attention_mask=mask.long(), max_new_tokens=12, num_beams=1,
                           do_sample=False, eos_token_id=eos, pad_token_id=c.pad_token_id, use_cache=False)
    assert (ours == eos).sum(1).tolist().count(1) >= 1, "some row should end at EOS"
    assert _cut(ours.tolist(), eos) == _hf_tokens(want, eos)


@pytest.mark.parametrize("name", CONFIGS)
def test_beam_search_equals_transformers_generate(name, tmp_path):
    """Beam 3. Without an EOS every hypothesis runs to max_len, where attnlab's search and
    transformers' coincide. With an EOS, transformers' ``early_stopping="never"`` is attnlab's
    exact stopping rule (no live beam can beat the best finished one, bounded at max_len)."""
    model = _generator(name)
    hf = _to_hf(model, tmp_path)
    src, mask, _ = _padded_batch()
    c = model.config
    ids = dict(bos_id=c.decoder_start_token_id, pad_id=c.pad_token_id)
    produced = _new_token(beam_search(model, src, mask, beam_size=3, max_len=10, eos_id=V, **ids), (c.pad_token_id,))
    ended = 0
    for eos, lp in ((None, 1.0), (None, 0.0), (produced, 0.0), (produced, 1.0)):
        ours = beam_search(model, src, mask, beam_size=3, max_len=10, eos_id=V if eos is None else eos,
                           length_penalty=lp, **ids)
        assert ours == beam_search(model, src, mask, beam_size=3, max_len=10, eos_id=V if eos is None else eos,
                                   length_penalty=lp, use_cache=False, **ids), "cached beams != uncached"
        with torch.no_grad():
            want = hf.generate(input_ids=src, attention_mask=mask.long(), max_new_tokens=10, num_beams=3,
                               do_sample=False, length_penalty=lp, early_stopping="never", eos_token_id=eos,
                               pad_token_id=c.pad_token_id, min_new_tokens=10 if eos is None else 0,
                               use_cache=False)
        assert ours == _hf_tokens(want, eos), f"eos {eos}, length penalty {lp}"
        ended += sum(len(r) < 10 for r in ours)
    assert ended, "some best hypothesis should end at EOS"
    greedy = greedy_decode(model, src, mask, max_len=10, eos_id=V, **ids).tolist()
    assert beam_search(model, src, mask, beam_size=1, max_len=10, eos_id=V, **ids) == greedy


def test_beam_search_keeps_k_live_beams_as_transformers_does(tmp_path):
    """Many sources, frequent EOS ids, beams of 3 and 4, three length penalties: the best
    hypothesis equals transformers' (``early_stopping="never"``) every time. Hypotheses that end
    while others go on are common here, and each step keeps K live beams besides them (a search
    that let a finished hypothesis take a beam's place, as attnlab's did, gave 3 of these 36 best
    hypotheses otherwise)."""
    model = _generator("t5", seed=7)
    with torch.no_grad():
        model.decoder_norm.weight.fill_(2.0)              # flatter logits: more hypotheses compete
    hf = _to_hf(model, tmp_path)
    c = model.config
    ids = dict(bos_id=c.decoder_start_token_id, pad_id=c.pad_token_id)
    g = torch.Generator().manual_seed(11)
    src = torch.randint(2, V, (6, 9), generator=g)
    mask = torch.ones_like(src, dtype=torch.bool)
    free = greedy_decode(model, src, mask, max_len=8, eos_id=V, **ids)
    eos_ids = sorted(set(free[:, 1:].flatten().tolist()) - {c.pad_token_id})
    compared = ended_early = 0
    for eos in eos_ids:
        for K, lp in ((3, 1.0), (4, 0.0), (4, 2.0)):
            ours = beam_search(model, src, mask, beam_size=K, max_len=8, eos_id=eos, length_penalty=lp, **ids)
            with torch.no_grad():
                want = hf.generate(input_ids=src, attention_mask=mask.long(), max_new_tokens=8, num_beams=K,
                                   do_sample=False, length_penalty=lp, early_stopping="never", eos_token_id=eos,
                                   pad_token_id=c.pad_token_id, use_cache=False)
            assert ours == _hf_tokens(want, eos), f"eos {eos}, beam {K}, length penalty {lp}"
            compared += len(ours)
            ended_early += sum(0 < len(r) < 8 for r in ours)
    assert len(eos_ids) >= 2 and compared == 6 * 3 * len(eos_ids) and ended_early >= 5, (eos_ids, ended_early)


# ----------------------------------------------------------------------------- sizes and configs
@pytest.mark.parametrize("preset, parameters", [
    ("t5-small", 60_506_624), ("t5-base", 222_903_552),                 # the published checkpoints'
    ("t5-v1_1-small", 76_961_152), ("t5-v1_1-base", 247_577_856),
])
def test_presets_have_the_published_sizes(preset, parameters):
    with torch.device("meta"):
        model = T5.default.build(T5.preset(preset))
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_one_shared_vocabulary_and_clear_config_errors():
    sizes = dict(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2)
    c = build_config(**sizes, tgt_vocab_size=50)
    assert (c.src_vocab_size, c.tgt_vocab_size, c.d_kv, c.d_ff, c.num_decoder_layers) == (50, 50, 12, 192, 2)
    assert (c.feed_forward_proj, c.tie_word_embeddings) == ("gated-gelu", False)        # v1.1 trains faster
    assert build_config(**sizes, feed_forward_proj="relu", tie_word_embeddings=True).tie_word_embeddings
    with pytest.raises(ValueError, match="one vocabulary serves source and target"):
        build_config(**sizes, tgt_vocab_size=60)
    with pytest.raises(ValueError, match="feed_forward_proj must be one of"):
        T5Config(feed_forward_proj="swiglu")
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        T5Config(d_model=30, num_heads=4)
    assert T5Config(d_model=30, num_heads=4, d_kv=8).d_kv == 8
