"""RWKV-7 (attnlab.models.rwkv7): the full forward equals the RNN-mode recurrence of the paper
written again here, one token and one head at a time with the transition as a matrix, in float64;
generation through the recurrent state (step by step equals the full forward, left padding changes
no row, speculative decoding equals greedy, constant state size); save/load through attnlab's own
layout; `attnlab train lm --model rwkv7`."""
import json
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import attnlab
import attnlab.models  # noqa: F401
import contract
import recurrent_contract
from attnlab.models.rwkv7 import RWKV7, Rwkv7, Rwkv7Config
from attnlab.nn.wkv import wkv7, wkv7_reference, wkv7_step
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)


def _tiny(seed=0, **overrides) -> Rwkv7:
    torch.manual_seed(seed)
    model = Rwkv7(RWKV7.preset("tiny", **overrides))
    contract.randomize_(model, seed)
    return model.eval()


def _ids(shape, seed=1, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return _tiny()


# ----------------------------------------------------------------------------- the RNN-mode reference
def _norm(x, weight, bias, eps):
    return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + eps) * weight + bias


def _reference(model: Rwkv7, ids: torch.Tensor) -> torch.Tensor:
    """Logits (l, V) of one row, token by token in float64, from the paper's equations: per head
    the state S (values x keys) goes to S (diag(w) - kappa (a kappa)^T) + v k^T and is read by r."""
    c = model.config
    P = {n: p.detach().double() for n, p in model.named_parameters()}
    H, N, C = c.num_heads, c.head_size, c.d_model
    last_t = [torch.zeros(C, dtype=torch.float64) for _ in range(c.num_layers)]
    last_c = [torch.zeros(C, dtype=torch.float64) for _ in range(c.num_layers)]
    S = [[torch.zeros(N, N, dtype=torch.float64) for _ in range(H)] for _ in range(c.num_layers)]
    logits = []
    for token in ids.tolist():
        x = _norm(P["token_embedding.weight"][token], P["pre_norm.weight"], P["pre_norm.bias"], c.layer_norm_eps)
        first_value = None
        for i in range(c.num_layers):
            q = lambda name: P[f"layers.{i}.time_mix.{name}"]          # noqa: E731
            h = _norm(x, P[f"layers.{i}.norm1.weight"], P[f"layers.{i}.norm1.bias"], c.layer_norm_eps)
            mixed = {m: h + q(f"mix_{m}") * (last_t[i] - h) for m in "rwkvag"}
            last_t[i] = h
            r = q("receptance.weight") @ mixed["r"]
            k = q("key.weight") @ mixed["k"]
            v = q("value.weight") @ mixed["v"]
            w = torch.exp(-torch.sigmoid(q("w0") + torch.tanh(mixed["w"] @ q("w1")) @ q("w2")) / math.sqrt(math.e))
            if i == 0:
                first_value = v
            else:
                gate = torch.sigmoid(q("v0") + mixed["v"] @ q("v1") @ q("v2"))
                v = (1 - gate) * v + gate * first_value
            a = torch.sigmoid(q("a0") + mixed["a"] @ q("a1") @ q("a2"))
            g = torch.sigmoid(mixed["g"] @ q("g1")) @ q("g2")
            y = torch.zeros(C, dtype=torch.float64)
            for j in range(H):
                s = slice(j * N, (j + 1) * N)
                kappa = k[s] * q("k_k")[s]
                kappa = kappa / max(float(kappa.norm()), 1e-12)
                key = k[s] * (1 + (a[s] - 1) * q("k_a")[s])
                S[i][j] = S[i][j] @ (torch.diag(w[s]) - torch.outer(kappa, a[s] * kappa)) + torch.outer(v[s], key)
                out = _norm(S[i][j] @ r[s], q("ln_x.weight")[s], q("ln_x.bias")[s], c.group_norm_eps)
                y[s] = out + (r[s] * key * q("r_k")[s]).sum() * v[s]
            x = x + q("output.weight") @ (y * g)
            h = _norm(x, P[f"layers.{i}.norm2.weight"], P[f"layers.{i}.norm2.bias"], c.layer_norm_eps)
            mk = P[f"layers.{i}.channel_mix.mix_k"]
            hidden = torch.relu(P[f"layers.{i}.channel_mix.key.weight"] @ (h + mk * (last_c[i] - h))) ** 2
            last_c[i] = h
            x = x + P[f"layers.{i}.channel_mix.value.weight"] @ hidden
        logits.append(P["lm_head.weight"] @ _norm(x, P["norm.weight"], P["norm.bias"], c.layer_norm_eps))
    return torch.stack(logits).float()


def test_full_forward_equals_the_rnn_mode_reference(model):
    ids = _ids((2, 13), seed=3)
    with torch.no_grad():
        got = model(ids)
    for row in range(2):
        assert_close_scaled(got[row], _reference(model, ids[row]), FP32, f"row {row}")


def test_reference_sees_the_value_residual_and_the_removal():
    """The reference is sensitive to what makes RWKV-7: zeroing the rate a (no removal) or the
    value gate (no residual from the first layer) changes its logits."""
    model = _tiny(seed=2)
    ids = _ids((1, 9), seed=4)[0]
    base = _reference(model, ids)
    for name, value in (("layers.0.time_mix.a0", -30.0), ("layers.1.time_mix.v0", -30.0)):
        changed = _tiny(seed=2)
        with torch.no_grad():
            changed.get_parameter(name).fill_(value)
        assert (_reference(changed, ids) - base).abs().max() > 1e-3, name
        with torch.no_grad():
            assert_close_scaled(changed(ids[None])[0], _reference(changed, ids), FP32, name)


def _delta_inputs(b, l, h, n, seed):
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(b, l, h, n, generator=g) for _ in range(3))
    w = torch.exp(-math.exp(-0.5) * torch.rand(b, l, h, n, generator=g))       # the model's range (0.545, 1)
    kappa = torch.nn.functional.normalize(torch.randn(b, l, h, n, generator=g), dim=-1)
    a = torch.rand(b, l, h, n, generator=g)
    return [r, w, k, v, kappa, a], torch.randn(b, h, n, n, generator=g)


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), l=st.integers(1, 45), h=st.integers(1, 3), n=st.integers(1, 6),
       chunk=st.integers(1, 17), with_state=st.booleans(), seed=st.integers(0, 100))
def test_chunked_delta_rule_equals_the_recurrence_with_gradients(b, l, h, n, chunk, with_state, seed):
    """The fast path in fp32 against the one-position recurrence in float64: outputs, end state
    and the gradients of every input (the entering state included)."""
    ins, S0 = _delta_inputs(b, l, h, n, seed)
    results = []
    for fn, dtype in ((lambda *x: wkv7(*x, chunk=chunk), torch.float32), (wkv7_reference, torch.float64)):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in ins + [S0]]
        y, S = fn(*leaves[:6], leaves[6] if with_state else None)
        g = torch.Generator().manual_seed(seed)
        ((y * torch.randn(y.shape, generator=g).to(dtype)).sum()
         + (S * torch.randn(S.shape, generator=g).to(dtype)).sum()).backward()
        grads = [t.grad.flatten() for t in leaves if t.grad is not None]
        results.append((y, S, torch.cat(grads)))
    (y, S, grad), (y_ref, S_ref, grad_ref) = results
    assert_close_scaled(y, y_ref.float(), FP32, "outputs")
    assert_close_scaled(S, S_ref.float(), FP32, "end state")
    assert_close_scaled(grad, grad_ref.float(), FP32, "gradients")


def test_a_step_with_unit_decay_zero_rate_and_zero_key_keeps_the_state():
    g = torch.Generator().manual_seed(0)
    S = torch.randn(2, 3, 4, 4, generator=g)
    r, kappa, v = (torch.randn(2, 3, 4, generator=g) for _ in range(3))
    y, kept = wkv7_step(S, r, torch.ones(2, 3, 4), torch.zeros(2, 3, 4), v, kappa, torch.zeros(2, 3, 4))
    assert torch.equal(kept, S)
    assert_close_scaled(y, (S @ r[..., None])[..., 0], 1e-6, "read-out")
    with pytest.raises(ValueError, match=r"wkv7: r, w, k, v, kappa and a must all be \(b, l, h, n\)"):
        wkv7(r[:, None], r[:, None], r[:, None], v[:, None], kappa[:, None], r[:, None, :2])
    with pytest.raises(ValueError, match="wkv7: chunk must be a positive int, got 0"):
        wkv7(*(t[:, None] for t in (r, r, r, v, kappa, r)), chunk=0)


# ----------------------------------------------------------------------------- decoding
def test_step_by_step_logits_equal_the_full_forward(model):
    recurrent_contract.check_pieces_equal_the_full_forward(model, _ids((3, 17), seed=5), [4, 9])


def test_the_state_has_a_constant_size_per_token(model):
    c = model.config
    recurrent_contract.check_the_state_has_a_constant_size(
        model, c.num_layers * 2 * (2 * c.d_model + c.num_heads * c.head_size ** 2))


def test_left_padded_batch_gives_each_row_what_it_gives_alone(model):
    recurrent_contract.check_left_padding_changes_no_row(model, 10)
    recurrent_contract.check_cached_equals_uncached(model, 10)


def test_speculative_decoding_equals_greedy_with_rejections_per_row(model):
    recurrent_contract.check_speculative_decoding_equals_greedy(model, _tiny(seed=0), 12)


def test_beam_search_runs_through_the_recurrent_state(model):
    recurrent_contract.check_beam_search(model, 5)


# ----------------------------------------------------------------------------- saving and training
def test_save_pretrained_round_trips_in_attnlabs_layout(model, tmp_path):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["head_size"]) == ("rwkv7", ["Rwkv7ForCausalLM"], 8)
    back = attnlab.from_pretrained(tmp_path)
    assert type(back) is Rwkv7 and back.config == model.config
    ids = _ids((2, 11))
    with torch.no_grad():
        assert torch.equal(back.eval()(ids), model(ids))


def test_decays_rates_and_mixes_do_not_decay(model):
    exempt = no_decay_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in exempt}
    assert {"layers.0.time_mix.w0", "layers.0.time_mix.a0", "layers.1.time_mix.v0", "layers.0.time_mix.r_k",
            "layers.1.channel_mix.mix_k", "layers.0.time_mix.ln_x.weight"} <= names
    assert not {"layers.0.time_mix.w1", "layers.0.time_mix.key.weight"} & names
    assert not hasattr(model.layers[0].time_mix, "v0"), "the first layer makes v_first and mixes nothing in"


def test_initialisation_gives_blocks_that_start_as_the_identity():
    model = Rwkv7(RWKV7.preset("tiny"))
    decay = torch.exp(-math.exp(-0.5) * torch.sigmoid(model.layers[0].time_mix.w0.detach()))
    assert 0.5 < float(decay.min()) < float(decay.max()) < 1.0
    ids = _ids((2, 8))
    with torch.no_grad():
        x = model.pre_norm(model.token_embedding(ids))
        assert torch.equal(model.hidden_states(ids), model.norm(x))


def test_sizing_builder_and_bad_input(model):
    config = RWKV7.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2)
    assert (config.head_size, config.num_heads, config.d_ff, config.decay_rank) == (12, 4, 192, 32)
    assert RWKV7.input_limits(config) == {"vocab_size": 50, "context": None}
    assert RWKV7.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2,
                              head_size=16).num_heads == 3
    with pytest.raises(ValueError, match="rwkv7: d_model 50 is not a multiple of num_heads 4"):
        RWKV7.build_config(vocab_size=50, context=24, d_model=50, num_heads=4, num_layers=2)
    with pytest.raises(ValueError, match="Rwkv7Config: d_model 30 is not a multiple of head_size 8"):
        Rwkv7Config(d_model=30, head_size=8)
    with pytest.raises(ValueError, match="rwkv7: an RWKV-7 has no dropout"):
        RWKV7.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, dropout=0.1)
    with pytest.raises(ValueError, match="cache must be the model's decoding state"):
        model(_ids((1, 3)), cache=attnlab.models.GPT(attnlab.models.GPTConfig(
            vocab_size=96, n_positions=8, d_model=8, num_heads=2, num_layers=1)).new_cache())
    with pytest.raises(ValueError, match=r"Rwkv7: input_ids must be a non-empty integer \(batch, seq\) tensor"):
        model(torch.zeros(1, 3))


def test_train_lm_with_rwkv7_from_the_command_line(tmp_path):
    meta = recurrent_contract.check_train_lm_from_the_command_line(tmp_path, "rwkv7", ["--head-size", "8"])
    assert (meta["model_type"], meta["architecture"], meta["config"]["head_size"]) == ("rwkv7", "Rwkv7ForCausalLM", 8)


def test_gradient_checkpointing_gives_the_same_gradients():
    recurrent_contract.check_gradient_checkpointing(_tiny(), length=20)
