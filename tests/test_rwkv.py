"""RWKV-4 (attnlab.nn.wkv, attnlab.models.rwkv): the WKV recurrence (chunked fast path, stable
one-step reference and the literal sums of the paper in float64 all equal, gradients included);
parity with transformers' RwkvForCausalLM / RwkvModel with the same weights, in train mode and in
eval mode with its rescaling; HF directories both ways; generation through the recurrent state
(step by step equals the full forward, greedy equals transformers' generate, left padding changes
no row, speculative decoding equals greedy); `attnlab train lm --model rwkv`."""
import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnlab
import attnlab.models  # noqa: F401
import contract
import recurrent_contract
from attnlab.models.rwkv import RWKV, Rwkv, RwkvConfig, RwkvModel
from attnlab.nn.wkv import wkv4, wkv4_reference, wkv4_step
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, assert_close_scaled, scaled_error  # noqa: E402  (tests/ is on sys.path)

transformers = pytest.importorskip("transformers")


def _tiny(cls=Rwkv, seed=0, **overrides) -> Rwkv:
    torch.manual_seed(seed)
    model = cls(RWKV.preset("tiny", **overrides))
    contract.randomize_(model, seed)
    with torch.no_grad():       # decays from fast (exp(-e^2.5) per step) to slow, keys of order 5
        for layer in model.layers:
            tm = layer.time_mix
            tm.time_decay.copy_(torch.linspace(-4.0, 2.5, tm.time_decay.numel()))
            tm.key.weight.mul_(4.0)
    return model.eval()


def _ids(shape, seed=1, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Our tiny RWKV and transformers' RwkvForCausalLM loaded from its save_pretrained."""
    model = _tiny()
    d = attnlab.save_pretrained(model, tmp_path_factory.mktemp("rwkv"))
    hf = transformers.RwkvForCausalLM.from_pretrained(d).eval()
    return model, hf, d


# ----------------------------------------------------------------------------- the recurrence
def _direct(k, v, w, u):
    """The paper's WKV as the two sums, in float64 (no running maximum needed there)."""
    k, v, w, u = k.double(), v.double(), w.double(), u.double()
    l = k.size(1)
    t, i = torch.arange(l)[:, None], torch.arange(l)[None, :]
    expo = k[:, None, :, :] - (t - 1 - i).double()[..., None] * w                        # (b, t, i, c)
    expo = torch.where((i == t)[..., None], u + k[:, None, :, :], expo)
    weight = torch.exp(expo.masked_fill((i > t)[..., None], float("-inf")))
    return ((weight * v[:, None]).sum(2) / weight.sum(2)).float()


def _wkv_inputs(b, l, c, seed, key_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    k = key_scale * torch.randn(b, l, c, generator=g)
    v = torch.randn(b, l, c, generator=g)
    w = torch.exp(torch.linspace(-4.0, 3.0, c))
    u = torch.randn(c, generator=g)
    return k, v, w, u


def test_wkv_equals_the_papers_sums_with_keys_whose_exponentials_overflow_fp32():
    k, v, w, u = _wkv_inputs(2, 45, 6, seed=0, key_scale=40.0)         # exp(k) up to ~e^150
    want = _direct(k, v, w, u)
    assert not torch.isfinite(torch.exp(k.max())), "the keys must overflow a naive fp32 evaluation"
    for chunk in (1, 8, 16, 64):
        got, _ = wkv4(k, v, w, u, chunk=chunk)
        assert_close_scaled(got, want, FP32, f"chunk {chunk}")
    assert_close_scaled(wkv4_reference(k, v, w, u)[0], want, FP32, "reference")


def _real(state):
    num, den, p = state
    return torch.cat([num * torch.exp(p), den * torch.exp(p)])


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), l=st.integers(1, 40), c=st.integers(1, 5), chunk=st.integers(1, 17),
       with_state=st.booleans(), seed=st.integers(0, 100))
def test_chunked_wkv_equals_the_reference_with_gradients(b, l, c, chunk, with_state, seed):
    """The fast path in fp32 against the one-step recurrence in float64 (whose fp32 run carries
    more round-off than the chunks: each of its l steps rounds the state again)."""
    k, v, w, u = _wkv_inputs(b, l, c, seed, key_scale=3.0)
    state = None
    if with_state:
        k0, v0, *_ = _wkv_inputs(b, 5, c, seed + 1)
        state = wkv4_reference(k0.double(), v0.double(), w.double(), u.double())[1]
    outs = []
    for fn, dtype in ((lambda *a: wkv4(*a, chunk=chunk), torch.float32), (wkv4_reference, torch.float64)):
        ins = [t.detach().to(dtype).clone().requires_grad_() for t in (k, v, w, u)]
        out, end = fn(*ins, None if state is None else tuple(s.to(dtype) for s in state))
        g = torch.Generator().manual_seed(seed)
        end = _real(end)          # the end state enters the loss so that w has a gradient at l = 1
        ((out * torch.randn(out.shape, generator=g).to(dtype)).sum()
         + (end * torch.randn(end.shape, generator=g).to(dtype)).sum() / end.abs().max().detach()).backward()
        outs.append((out, end, torch.cat([t.grad.flatten() for t in ins])))
    (fast, fast_end, fast_grad), (ref, ref_end, ref_grad) = outs
    assert_close_scaled(fast, ref.float(), FP32, "outputs")
    assert_close_scaled(fast_end, ref_end.float(), FP32, "end state")
    assert_close_scaled(fast_grad, ref_grad.float(), FP32, "gradients")


def _fwd_bwd(k, v, w, u, chunk):
    ins = [t.detach().clone().requires_grad_() for t in (k, v, w, u)]
    out, end = wkv4(*ins, chunk=chunk)
    g = torch.Generator().manual_seed(0)
    ((out * torch.randn(out.shape, generator=g)).sum() + _real(end).sum() / _real(end).abs().max().detach()).backward()
    return out, [t.grad for t in ins]


def test_wkv_never_asks_exp_for_a_subnormal_or_zero_result():
    """torch's vectorised exp is 2 to 30 times slower for inputs below log(smallest normal fp32)
    (-87.3; -inf and the -1e30 of padding included): with fast decays and padding, forward and
    backward of the chunked WKV never hand it one."""
    from torch.utils._python_dispatch import TorchDispatchMode
    smallest = []

    class Exps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.exp.default, torch.ops.aten.exp_.default) and args[0].numel():
                smallest.append(float(args[0].min()))
            return func(*args, **(kwargs or {}))
    k, v, w, u = _wkv_inputs(2, 45, 6, seed=0, key_scale=3.0)       # decays up to e^3 per step
    with Exps():
        _fwd_bwd(k, v, w, u, chunk=16)                               # 45 = 2 chunks + 13 padding keys
    assert smallest and min(smallest) >= math.log(torch.finfo(torch.float32).tiny), min(smallest)


def test_the_exponent_floor_changes_nothing_in_fp32(monkeypatch):
    """Weights below exp(-87) raised to it change no output and no gradient: against sums of at
    least 1 they round away."""
    import attnlab.nn.wkv as wkv
    k, v, w, u = _wkv_inputs(3, 45, 8, seed=4, key_scale=3.0)
    for chunk in (5, 16):
        floored = _fwd_bwd(k, v, w, u, chunk)
        with monkeypatch.context() as m:
            m.setattr(wkv, "EXPONENT_FLOOR", float("-inf"))
            exact = _fwd_bwd(k, v, w, u, chunk)
        assert torch.equal(floored[0], exact[0]), f"chunk {chunk}: outputs"
        for name, a, b in zip("kvwu", floored[1], exact[1]):
            assert torch.equal(a, b), f"chunk {chunk}: gradient of {name}"


def _direct_state(k, v, w, extra_age=0):
    """The state after the last key as the paper's two sums in float64: sum_i e^(k_i - (l-1-i) w) v_i
    and sum_i e^(k_i - (l-1-i) w) (the bonus u weighs only the current token, never the state);
    ``extra_age`` ages every term by more steps, for the negative check."""
    k, v, w = k.double(), v.double(), w.double()
    age = (k.size(1) - 1 + extra_age - torch.arange(k.size(1))).double()[:, None]      # (l, 1)
    weight = torch.exp(k - age * w)                                                    # (b, l, c)
    return torch.cat([(weight * v).sum(1), weight.sum(1)]).float()


def test_state_and_one_more_step_equal_the_papers_sums():
    """The end state (the numerator and denominator sums that transformers' recurrence carries too)
    and one step from it, against the literal sums in float64 (FP32 = 1e-5 of the scale); the state
    aged by one step too many, and the step without the bonus u, are far outside it."""
    k, v, w, u = _wkv_inputs(2, 9, 4, seed=3, key_scale=5.0)
    ours, state = wkv4(k, v, w, u, chunk=4)
    assert_close_scaled(ours, _direct(k, v, w, u), FP32, "wkv")
    assert_close_scaled(_real(state), _direct_state(k, v, w), FP32, "state")
    assert scaled_error(_real(state), _direct_state(k, v, w, extra_age=1)) > 100 * FP32, "decay off by one step"
    out, _ = wkv4_step(state, k[:, 0], v[:, 0], w, u)
    want = _direct(torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1), w, u)[:, -1]
    assert_close_scaled(out, want, FP32, "one more step")
    no_bonus, _ = wkv4_step(state, k[:, 0], v[:, 0], w, torch.zeros_like(u))
    assert scaled_error(no_bonus, want) > 100 * FP32, "the bonus u must matter"


# ----------------------------------------------------------------------------- transformers
def test_logits_equal_transformers_at_several_lengths(pair):
    model, hf, _ = pair
    for length in (1, 7, 16, 70):
        ids = _ids((3, length), seed=length)
        with torch.no_grad():
            assert_close_scaled(model(ids), hf(ids, use_cache=False).logits, FP32, f"logits at length {length}")


def test_rescaling_in_eval_and_none_in_training_as_transformers(tmp_path):
    # a large LayerNorm eps makes the norms see the halved residual stream, so a wrong rescale shows
    model = _tiny(num_layers=5, rescale_every=2, layer_norm_eps=0.5)
    attnlab.save_pretrained(model, tmp_path)
    hf = transformers.RwkvForCausalLM.from_pretrained(tmp_path)
    ids = _ids((2, 12))
    with torch.no_grad():
        got = {mode: model.train(mode)(ids) for mode in (True, False)}
        want = {mode: hf.train(mode)(ids, use_cache=False).logits for mode in (True, False)}
    for mode in (True, False):
        assert_close_scaled(got[mode], want[mode], FP32, f"training={mode}")
    assert (got[True] - got[False]).abs().max() > 1e-3 * got[True].abs().max(), "the rescaling must matter here"
    # transformers divides its weights in place in eval mode; ours stay as they were loaded
    assert torch.equal(model.state_dict()["layers.2.time_mix.output.weight"],
                       attnlab.from_pretrained(tmp_path).state_dict()["layers.2.time_mix.output.weight"])


def test_base_model_equals_transformers_rwkv_model(tmp_path):
    model = _tiny(RwkvModel)
    attnlab.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["RwkvModel"]
    hf = transformers.RwkvModel.from_pretrained(tmp_path).eval()
    ids = _ids((2, 33))
    with torch.no_grad():
        assert_close_scaled(model(ids), hf(ids).last_hidden_state, FP32, "last hidden state")


def test_transformers_checkpoint_loads_and_round_trips(tmp_path):
    torch.manual_seed(0)
    hf = transformers.RwkvForCausalLM(transformers.RwkvConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, attention_hidden_size=24, intermediate_size=48,
        rescale_every=0)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours) is Rwkv and (ours.config.attention_hidden_size, ours.config.d_ff) == (24, 48)
    ids = _ids((2, 20))
    with torch.no_grad():
        assert_close_scaled(ours(ids), hf(ids, use_cache=False).logits, FP32, "from transformers")
        ours.save_pretrained(tmp_path / "again")
        back = transformers.RwkvForCausalLM.from_pretrained(tmp_path / "again").eval()
        assert torch.equal(back(ids, use_cache=False).logits, hf(ids, use_cache=False).logits)


def test_greedy_generation_equals_transformers_for_32_tokens(pair):
    """Against transformers' generate one row at a time: its one-token step adds the (b, c) shift
    state to the (b, 1, c) hidden states, which broadcasts to (b, b, c) when b > 1."""
    model, hf, _ = pair
    prompt = _ids((2, 6), seed=4)
    ours = model.generate(prompt, 32)
    for i in range(2):
        with torch.no_grad():
            theirs = hf.generate(prompt[i:i + 1], max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert torch.equal(ours[i:i + 1], theirs), f"row {i}"


# ----------------------------------------------------------------------------- decoding
def test_step_by_step_logits_equal_the_full_forward(pair):
    recurrent_contract.check_pieces_equal_the_full_forward(pair[0], _ids((3, 19), seed=5), [4, 11])


def test_the_state_has_a_constant_size_per_token(pair):
    c = pair[0].config
    recurrent_contract.check_the_state_has_a_constant_size(
        pair[0], c.num_layers * 2 * (2 * c.d_model + 3 * c.attention_hidden_size), steps=30)


def test_cached_equals_uncached_greedy(pair):
    recurrent_contract.check_cached_equals_uncached(pair[0])


def test_left_padded_batch_gives_each_row_what_it_gives_alone(pair):
    model, hf, _ = pair          # transformers' RWKV ignores the mask: its reference is each row alone
    recurrent_contract.check_left_padding_changes_no_row(model, alone=lambda p: hf(p[None]).logits[0])


def test_speculative_decoding_equals_greedy_with_rejections_per_row(pair):
    recurrent_contract.check_speculative_decoding_equals_greedy(pair[0], _tiny(seed=0), noise=0.08)


def test_beam_search_runs_through_the_recurrent_state(pair):
    recurrent_contract.check_beam_search(pair[0])


# ----------------------------------------------------------------------------- training surface
def test_decays_bonuses_and_mixes_do_not_decay():
    model = _tiny()
    exempt = no_decay_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in exempt}
    assert {"layers.0.time_mix.time_decay", "layers.0.time_mix.time_first", "layers.1.time_mix.mix_r",
            "layers.0.channel_mix.mix_k", "layers.0.norm1.weight"} <= names
    assert "layers.0.time_mix.key.weight" not in names


def test_initialisation_spreads_the_decays_and_gives_small_logits():
    model = Rwkv(RWKV.preset("tiny"))
    decay = model.layers[1].time_mix.time_decay.detach()
    assert float(decay[0]) == -5.0 and float(decay[-1]) == 3.0 and bool((decay[1:] > decay[:-1]).all())
    with torch.no_grad():
        assert model(_ids((2, 16))).abs().max() < 1.0


def test_sizing_builder_and_bad_input():
    config = RWKV.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2)
    assert (config.d_ff, config.attention_hidden_size, config.rescale_every) == (192, 48, 0)
    assert RWKV.input_limits(config) == {"vocab_size": 50, "context": None}
    with pytest.raises(ValueError, match="rwkv: an RWKV has no dropout"):
        RWKV.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, dropout=0.1)
    with pytest.raises(ValueError, match="RwkvConfig: num_layers must be positive, got 0"):
        RwkvConfig(num_layers=0)
    model = _tiny()
    with pytest.raises(ValueError, match="cache must be the model's decoding state"):
        model(_ids((1, 3)), cache=attnlab.models.GPT(attnlab.models.GPTConfig(
            vocab_size=96, n_positions=8, d_model=8, num_heads=2, num_layers=1)).new_cache())
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, cached \+ new tokens\) = \(1, 3\)"):
        model(_ids((1, 3)), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match=r"Rwkv: token id 96 is out of range \[0, vocab_size=96\)"):
        model(torch.tensor([[1, 96]]))
    with pytest.raises(ValueError, match="wkv4: chunk must be a positive int"):
        wkv4(*_wkv_inputs(1, 3, 2, 0), chunk=0)
    with pytest.raises(TypeError, match="RwkvModel has no language-model head"):
        _tiny(RwkvModel).generate(_ids((1, 3)), 2)


def test_train_lm_with_rwkv_from_the_command_line(tmp_path):
    meta = recurrent_contract.check_train_lm_from_the_command_line(tmp_path, "rwkv", [])
    assert (meta["model_type"], meta["architecture"], meta["config"]["d_model"]) == ("rwkv", "RwkvForCausalLM", 16)


def test_gradient_checkpointing_gives_the_same_gradients():
    recurrent_contract.check_gradient_checkpointing(_tiny())
