"""Mamba-3 (attnlab.models.mamba3, attnlab.nn.mamba3_scan): the layer equals the authors' recurrence,
written out below from the paper's equations (exponential-trapezoidal step, the complex state as a
rotation by the accumulated angle, B/C norms and biases, SISO and MIMO), with each of the trapezoid,
the rotations (rope_fraction 0, 0.5, 1.0) and MIMO on and off; the chunked scan equals the one-step
recurrence with gradients for random shapes, chunk lengths and lengths the chunk does not divide;
step-by-step logits equal the full forward; greedy, beam and speculative decoding run through the
recurrent state (speculative equals greedy); a directory round trip; bad input gets one clear line;
`attnlab train lm --model mamba3` trains and generates."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import attnlab
import attnlab.models  # noqa: F401
import contract
from attnlab.nn import optimize_for_inference
import recurrent_contract
from attnlab.models.mamba3 import MAMBA3, Mamba3, Mamba3Config, Mamba3Mixer
from attnlab.nn.mamba3_scan import mamba3_scan, mamba3_scan_reference, rotate_pairs
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)


# ----------------------------------------------------------------------------- the authors' recurrence
def _authors_recurrence(m: Mamba3Mixer, x: torch.Tensor, steps: int | None = None) -> torch.Tensor:
    """The layer, token by token in float64, from the paper's equations and the authors' module
    layout (in_proj's outputs in the order z, x, B, C, Δ, A, λ, angles; B and C of shape (rank,
    groups, n), groups serving blocks of heads). Per head, with ⊗ the outer product summed over the
    rank r:

        Δ = softplus(Δ_raw + dt_bias)     A = -softplus(A_raw), at most -A_floor     λ = sigmoid(λ_raw)
        θ ← θ + π tanh(angles) Δ  (mod 2π)        k_r = rot_θ(RMSNorm(B_r) + B_bias_r), q_r likewise from C
        v_r = x ⊙ mimo_x_r
        h ← e^{AΔ} h + (1 - λ) Δ e^{AΔ} (v_prev ⊗ k_prev) + λ Δ (v ⊗ k)
        y = Σ_r (h q_r + D v_r) ⊙ SiLU(z ⊙ mimo_z_r) ⊙ mimo_o_r   (SISO: one rank, no mimo_*)

    and rot_θ multiplies each pair (k_{2i}, k_{2i+1}), read as the complex number k_{2i} + i k_{2i+1},
    by e^{iθ_i}: one angle per pair for the first rope_fraction of the n entries, the rest as they are."""
    c = m.c
    H, R, G, N, P = c.nheads, c.rank, c.ngroups, c.d_state, c.headdim
    k_ang = int(N * c.rope_fraction) // 2
    W = {name: p.double() for name, p in m.named_parameters()}      # differentiable: gradients compare too
    proj = x.double() @ W["in_proj.weight"].T
    sizes = [c.d_inner, c.d_inner, R * G * N, R * G * N, H, H, H if c.trapezoidal else 0, k_ang]
    z, u, Braw, Craw, dt_raw, A_raw, lam_raw, ang = torch.split(proj, sizes, dim=-1)
    b, length = x.shape[:2]
    group_of = [j * G // H for j in range(H)]

    def bc(raw, weight, bias):                        # (b, R*G*N) -> (b, R, H, N)
        t = raw.view(b, R, G, N)
        t = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        return t[:, :, group_of] + bias.permute(1, 0, 2)

    def rot(t, theta):                                # t (b, R, H, N), theta (b, H, k_ang)
        if k_ang == 0:
            return t
        pairs = torch.view_as_complex(t[..., :2 * k_ang].reshape(b, R, H, k_ang, 2).contiguous())
        turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(theta), theta)[:, None]).flatten(-2)
        return torch.cat([turned, t[..., 2 * k_ang:]], dim=-1)

    ones = torch.ones(H, R, P, dtype=torch.float64)
    mx, mz, mo = (W.get(f"mimo_{n}", ones).permute(1, 0, 2) for n in "xzo")   # (R, H, P)
    h = torch.zeros(b, H, P, N, dtype=torch.float64)
    theta = torch.zeros(b, H, k_ang, dtype=torch.float64)
    k_prev = torch.zeros(b, R, H, N, dtype=torch.float64)
    v_prev = torch.zeros(b, R, H, P, dtype=torch.float64)
    out = []
    for t in range(length if steps is None else steps):
        dt = F.softplus(dt_raw[:, t] + W["dt_bias"])                                   # (b, H)
        A = torch.clamp(-F.softplus(A_raw[:, t]), max=-c.A_floor)
        lam = torch.sigmoid(lam_raw[:, t]) if c.trapezoidal else torch.ones_like(dt)
        theta = torch.remainder(theta + math.pi * torch.tanh(ang[:, t])[:, None, :] * dt[..., None], 2 * math.pi)
        k = rot(bc(Braw[:, t], W["B_norm.weight"], W["B_bias"]), theta)
        q = rot(bc(Craw[:, t], W["C_norm.weight"], W["C_bias"]), theta)
        v = u[:, t].view(b, 1, H, P) * mx
        decay = torch.exp(A * dt)[..., None, None]
        h = decay * h + ((1 - lam) * dt)[..., None, None] * decay * torch.einsum("brhp,brhn->bhpn", v_prev, k_prev) \
            + (lam * dt)[..., None, None] * torch.einsum("brhp,brhn->bhpn", v, k)
        y = torch.einsum("bhpn,brhn->brhp", h, q) + W["D"][:, None] * v
        y = y * F.silu(z[:, t].view(b, 1, H, P) * mz) * mo
        out.append(y.sum(1).reshape(b, -1) @ W["out_proj.weight"].T)
        k_prev, v_prev = k, v
    return torch.stack(out, dim=1).float()


def _mixer(seed=0, **overrides) -> Mamba3Mixer:
    c = Mamba3Config(**{**dict(vocab_size=10, d_model=16, num_layers=1, d_state=8, expand=2, headdim=8, ngroups=2,
                               chunk_size=5), **overrides})
    torch.manual_seed(seed)
    m = Mamba3Mixer(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                           # every parameter away from its neutral start value
        for name, p in m.named_parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        m.in_proj.weight.mul_(2.0)                  # angles and steps of order one: the rotations turn
    return m.eval()


def _x(shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


SWITCHES = [dict(is_mimo=mimo, trapezoidal=trap, rope_fraction=rope)
            for mimo in (False, True) for trap in (True, False) for rope in (0.5, 1.0, 0)]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_layer_equals_the_authors_recurrence(switches):
    m = _mixer(**switches, mimo_rank=3)
    x = _x((2, 23, 16))                             # the chunk of 5 does not divide 23
    with torch.no_grad():
        got, _ = m(x)
    assert_close_scaled(got, _authors_recurrence(m, x), FP32, f"layer output with {switches}")


@pytest.mark.parametrize("mimo", [False, True])
def test_layer_gradients_equal_the_authors_recurrence(mimo):
    """Every parameter's gradient and the input's, through the chunked scan, against autograd
    through the float64 recurrence."""
    m = _mixer(is_mimo=mimo, mimo_rank=2)
    x = _x((2, 13, 16), seed=4).requires_grad_()
    weights = torch.randn(2, 13, 16, generator=torch.Generator().manual_seed(7))
    params = [x, *m.parameters()]
    got = torch.autograd.grad((m(x)[0] * weights).sum(), params)
    want = torch.autograd.grad((_authors_recurrence(m, x) * weights).sum(), params)
    flat = [torch.cat([g.flatten().float() for g in grads]) for grads in (got, want)]
    assert_close_scaled(*flat, FP32, f"gradients, mimo={mimo}")
    assert all(g.abs().max() > 0 for g in got)


@pytest.mark.parametrize("d_state, angles", [(6, 1), (8, 2), (10, 2)])
def test_rope_fraction_one_half_rotates_whole_pairs(d_state, angles):
    m = _mixer(d_state=d_state, rope_fraction=0.5)
    assert m.c.num_rope_angles == angles and m.widths[-1] == angles
    x = _x((1, 9, 16))
    with torch.no_grad():
        assert_close_scaled(m(x)[0], _authors_recurrence(m, x), FP32, f"d_state {d_state}")


def test_layer_continues_from_its_state():
    """A prefix, then the rest from the returned state (chunked and one step) equals the whole."""
    for mimo in (False, True):
        m = _mixer(is_mimo=mimo, mimo_rank=2)
        x = _x((2, 17, 16), seed=3)
        with torch.no_grad():
            whole = _authors_recurrence(m, x)
            head, state = m(x[:, :7])
            rest, state = m(x[:, 7:16], state=state)
            last, _ = m(x[:, 16:], state=state)
        assert_close_scaled(torch.cat([head, rest, last], 1), whole, FP32, f"continued, mimo={mimo}")


# ----------------------------------------------------------------------------- the scan itself
def _scan_inputs(b, l, r, h, p, n, seed, state):
    g = torch.Generator().manual_seed(seed)
    C, B, X = (torch.randn(b, l, r, h, k, generator=g) for k in (n, n, p))
    dt = F.softplus(torch.randn(b, l, h, generator=g))
    lam = torch.rand(b, l, h, generator=g)
    a = -torch.rand(b, l, h, generator=g) * 2 * dt
    ins = [C, B, X, a, lam * dt, (1 - lam) * dt]
    s = [torch.randn(b, h, p, n, generator=g), torch.randn(b, r, h, n, generator=g),
         torch.randn(b, r, h, p, generator=g)] if state else []
    return [t.detach().requires_grad_() for t in ins + s]


def _grads(out, ins, seed):
    g = torch.Generator().manual_seed(seed)
    Y, state = out
    loss = (Y * torch.randn(Y.shape, generator=g)).sum()
    loss = loss + sum((t * torch.randn(t.shape, generator=g)).sum() for t in state)
    return torch.autograd.grad(loss, ins)


def _compare(ins, chunk, seed):
    state = tuple(ins[6:]) or None
    want, got = mamba3_scan_reference(*ins[:6], state), mamba3_scan(*ins[:6], state, chunk=chunk)
    assert got[0].shape == want[0].shape
    assert_close_scaled(got[0], want[0], FP32, "Y")
    for g, w, what in zip(got[1], want[1], ("state", "last B", "last X")):
        assert_close_scaled(g, w, FP32, what)
    # a gradient that is zero in exact arithmetic (the decay's, with one position and no state)
    # holds only round-off: each is compared within the whole, as one vector
    flat = [torch.cat([t.flatten() for t in _grads(out, ins, seed)]) for out in (got, want)]
    assert_close_scaled(*flat, FP32, "gradients of C B X a gamma beta (and the state)")


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), l=st.integers(1, 40), r=st.integers(1, 3), h=st.integers(1, 3), p=st.integers(1, 4),
       n=st.integers(1, 5), chunk=st.integers(1, 12), state=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_scan_equals_the_recurrence_with_gradients(b, l, r, h, p, n, chunk, state, seed):
    _compare(_scan_inputs(b, l, r, h, p, n, seed, state), chunk, seed)


@pytest.mark.parametrize("l, chunk", [(64, 16), (70, 16), (5, 64), (130, 32)])
def test_chunked_scan_at_lengths_the_chunk_does_and_does_not_divide(l, chunk):
    _compare(_scan_inputs(2, l, 2, 2, 3, 4, seed=l, state=True), chunk, seed=l)


def test_the_scan_stays_fp32_under_bf16_autocast():
    ins = [t.detach() for t in _scan_inputs(2, 40, 2, 2, 8, 16, seed=3, state=True)]
    want = mamba3_scan(*ins[:6], tuple(ins[6:]), chunk=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = mamba3_scan(*ins[:6], tuple(ins[6:]), chunk=16)
        step = mamba3_scan_reference(*ins[:6], tuple(ins[6:]))
    for g, s, w in zip((got[0], *got[1]), (step[0], *step[1]), (want[0], *want[1])):
        assert g.dtype == torch.float32
        assert_close_scaled(g, w, FP32, "chunked under autocast")
        assert_close_scaled(s, w, FP32, "stepwise under autocast")


def test_the_recurrence_by_hand():
    """One head, rank, channel and state entry, two positions:
    s1 = γ1 x1 b1, s2 = e^{a2} s1 + β2 e^{a2} x1 b1 + γ2 x2 b2 (β1 reads the empty state), y = s c."""
    C, B, X = (torch.tensor(v).view(1, 2, 1, 1, 1) for v in ([0.5, 2.0], [1.5, -1.0], [2.0, 3.0]))
    a, gamma, beta = (torch.tensor(v).view(1, 2, 1) for v in ([-0.3, -0.7], [0.4, 0.25], [0.6, 0.5]))
    s1 = 0.4 * 2.0 * 1.5
    s2 = math.exp(-0.7) * s1 + 0.5 * math.exp(-0.7) * 2.0 * 1.5 + 0.25 * 3.0 * -1.0
    want = torch.tensor([s1 * 0.5, s2 * 2.0])
    for Y, s in (mamba3_scan_reference(C, B, X, a, gamma, beta), mamba3_scan(C, B, X, a, gamma, beta, chunk=2)):
        assert torch.allclose(Y.flatten(), want, rtol=1e-6) and math.isclose(float(s[0]), s2, rel_tol=1e-6)


def test_rotations_make_the_readout_see_angle_differences():
    """C_t · B_s after rotating each by its own angle equals C_t rotated by θ_t - θ_s, dotted with
    B_s unrotated: the complex state's relative phase. Entries past the rotated pairs stay."""
    g = torch.Generator().manual_seed(0)
    C, B = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    t_c, t_b = torch.randn(5, 2, generator=g) * 4, torch.randn(5, 2, generator=g) * 4
    both = (rotate_pairs(C, t_c) * rotate_pairs(B, t_b)).sum(-1)
    assert_close_scaled(both, (rotate_pairs(C, t_c - t_b) * B).sum(-1), FP32, "relative phase")
    assert torch.equal(rotate_pairs(C, t_c)[:, 4:], C[:, 4:])
    assert torch.equal(rotate_pairs(C, torch.zeros(5, 0)), C)


# ----------------------------------------------------------------------------- the language model
def _tiny(preset="tiny", seed=0, **overrides) -> Mamba3:
    torch.manual_seed(seed)
    model = Mamba3(MAMBA3.preset(preset, **overrides))
    contract.randomize_(model, seed)
    return model.eval()


def _ids(shape, seed=1, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["tiny", "tiny-mimo"])
def model(request):
    return _tiny(request.param)


def test_step_by_step_logits_equal_the_full_forward(model):
    tokens = _ids((3, 19), seed=5)
    recurrent_contract.check_pieces_equal_the_full_forward(model, tokens, [4])
    recurrent_contract.check_pieces_equal_the_full_forward(model, tokens, [1])    # one at a time from the start


def test_the_state_has_a_constant_size_per_token(model):
    c = model.config
    per_row = c.nheads * (c.num_rope_angles + c.headdim * c.d_state + c.rank * (c.d_state + c.headdim))
    recurrent_contract.check_the_state_has_a_constant_size(model, 2 * c.num_layers * per_row, steps=30)


def test_cached_equals_uncached_greedy_and_beam_search(model):
    recurrent_contract.check_cached_equals_uncached(model, 12)
    recurrent_contract.check_beam_search(model)


def test_left_padded_batch_gives_each_row_what_it_gives_alone(model):
    recurrent_contract.check_left_padding_changes_no_row(model, 10)


def test_speculative_decoding_equals_greedy_with_rejections_per_row(model):
    draft = _tiny("tiny-mimo" if model.config.is_mimo else "tiny")
    recurrent_contract.check_speculative_decoding_equals_greedy(model, draft)


def test_directory_round_trip_in_attnlabs_layout(model, tmp_path):
    model.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    c = model.config
    assert (raw["model_type"], raw["architectures"], raw["is_mimo"], raw["rope_fraction"]) == \
        ("mamba3", ["Mamba3ForCausalLM"], c.is_mimo, c.rope_fraction)
    back = attnlab.from_pretrained(tmp_path)
    assert type(back) is Mamba3 and back.config == c and back.lm_head.weight is back.token_embedding.weight
    ids = _ids((2, 11))
    optimize_for_inference(model)       # as from_pretrained readies ``back``: the same products, bit for bit
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_no_weight_decay_on_the_dynamics():
    model = _tiny("tiny-mimo")
    exempt = no_decay_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in exempt}
    want = {f"layers.0.mixer.{k}" for k in ("dt_bias", "D", "B_norm.weight", "C_norm.weight")}
    assert want <= names
    assert not names & {f"layers.0.mixer.{k}" for k in ("in_proj.weight", "mimo_x", "B_bias", "C_bias")}


def test_gradient_checkpointing_gives_the_same_gradients():
    recurrent_contract.check_gradient_checkpointing(_tiny("tiny-mimo"))


def test_sizing_builder_and_bad_input():
    config = MAMBA3.build_config(vocab_size=50, context=24, d_model=32, num_heads=4, num_layers=2, d_state=16,
                                 mimo_rank=2, d_ff=48)
    assert (config.nheads, config.rank, config.d_intermediate, config.chunk_size) == (4, 2, 48, 32)
    assert MAMBA3.input_limits(config) == {"vocab_size": 50, "context": None}
    with pytest.raises(ValueError, match="mamba3: a Mamba-3 has no dropout"):
        MAMBA3.build_config(vocab_size=50, context=24, d_model=32, num_heads=4, num_layers=2, dropout=0.1)
    for bad, message in ((dict(rope_fraction=0.3), "rope_fraction must be 0 .no rotations., 0.5 or 1.0, got 0.3"),
                         (dict(d_state=2, rope_fraction=0.5), "d_state 2 is too small to rotate 0.5 of it"),
                         (dict(d_model=24, headdim=32), "expand . d_model = 48 is not a multiple of headdim 32"),
                         (dict(ngroups=3), "the 4 heads do not split into ngroups 3"),
                         (dict(headdim=0), "headdim must be positive, got 0")):
        with pytest.raises(ValueError, match=f"^Mamba3Config: {message}"):
            Mamba3Config(**{**dict(d_model=32, headdim=16, d_state=8), **bad})
    with pytest.raises(ValueError, match="mamba3_scan: chunk must be a positive int, got 0"):
        mamba3_scan(*_scan_inputs(1, 3, 1, 1, 1, 2, 0, False), chunk=0)
    with pytest.raises(ValueError, match=r"mamba3_scan: shapes C \(1, 3, 1, 1, 2\), B \(1, 3, 1, 1, 3\)"):
        ins = _scan_inputs(1, 3, 1, 1, 1, 2, 0, False)
        mamba3_scan(ins[0], torch.randn(1, 3, 1, 1, 3), *ins[2:])
    model = _tiny()
    with pytest.raises(ValueError, match="Mamba3: cache must be the model's decoding state"):
        model(_ids((1, 3)), cache=attnlab.models.GPT(attnlab.models.GPTConfig(
            vocab_size=96, n_positions=8, d_model=8, num_heads=2, num_layers=1)).new_cache())
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, cached \+ new tokens\) = \(1, 3\)"):
        model(_ids((1, 3)), attention_mask=torch.ones(1, 4))


def test_train_lm_with_mamba3_from_the_command_line(tmp_path):
    meta = recurrent_contract.check_train_lm_from_the_command_line(
        tmp_path, "mamba3", ["--d-state", "8", "--headdim", "8", "--mimo-rank", "2", "--no-trapezoidal"])
    assert (meta["model_type"], meta["architecture"]) == ("mamba3", "Mamba3ForCausalLM")
    c = meta["config"]
    assert (c["d_state"], c["is_mimo"], c["mimo_rank"], c["trapezoidal"], c["headdim"]) == (8, True, 2, False, 8)


@pytest.mark.parametrize("flags, message", [
    (["--rope-fraction", "0.3"], "--rope-fraction: must be 0, 0.5 or 1, got 0.3"),
    (["--mimo-rank", "-1"], "--mimo-rank: must be 0 (SISO) or positive, got -1"),
    (["--dropout", "0.1"], "mamba3: a Mamba-3 has no dropout; leave dropout unset"),
    (["--d-model", "24", "--headdim", "32"], "Mamba3Config: expand * d_model = 48 is not a multiple of headdim 32"),
])
def test_bad_options_on_the_command_line_get_one_line(flags, message, tmp_path, capsys):
    from attnlab.cli import main
    (tmp_path / "text.txt").write_text("the quick brown fox. " * 20)
    code = main(["train", "lm", "--model", "mamba3", "--data", str(tmp_path / "text.txt"), "--out",
                 str(tmp_path / "run"), "--steps", "1", "--no-progress", *flags])
    err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert code == 2 and len(err) == 1 and err[0].endswith(message), err
