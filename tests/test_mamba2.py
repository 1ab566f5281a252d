"""Mamba-2 (attnlab.models.mamba2): parity with transformers' Mamba2ForCausalLM and Mamba2Model
(their pure-PyTorch torch_forward on CPU) with the same weights, with one and with two groups of
heads and at lengths the chunk does not divide; generation through the recurrent state (greedy
equals transformers' generate, step by step equals the full forward, left padding changes no row,
speculative decoding equals greedy); the gated norm per group; A_log, D and dt_bias do not decay;
`attnlab train lm --model mamba2` trains and generates."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401
import contract
import recurrent_contract
from attnlab.models.mamba2 import MAMBA2, Mamba2, Mamba2Config, Mamba2Model
from attnlab.nn.norm import GatedRMSNorm
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def _tiny(cls=Mamba2, seed=0, **overrides) -> Mamba2:
    torch.manual_seed(seed)
    model = cls(MAMBA2.preset("tiny", **overrides))
    contract.randomize_(model, seed)
    with torch.no_grad():                      # A = -exp(A_log) spread over the heads as the paper's
        for layer in model.layers:
            H = layer.mixer.A_log.numel()
            layer.mixer.A_log.copy_(torch.log(torch.arange(1.0, H + 1)) + 0.3 * torch.randn(H))
    return model.eval()


def _ids(shape, seed=1, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _hf_copy(model, path):
    attnlab.save_pretrained(model, path)
    cls = transformers.Mamba2Model if isinstance(model, Mamba2Model) else transformers.Mamba2ForCausalLM
    return cls.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Our tiny Mamba-2 (4 heads in 2 groups) and transformers' Mamba2ForCausalLM from its save_pretrained."""
    model = _tiny()
    return model, _hf_copy(model, tmp_path_factory.mktemp("mamba2"))


# ----------------------------------------------------------------------------- transformers
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_logits_equal_transformers_at_lengths_the_chunk_does_not_divide(groups, tmp_path):
    """Groups map to heads in blocks (head i reads group i // (heads / groups)): with more than
    one group a cyclic mapping gives other logits. 70 positions are one chunk of 64 and a part."""
    model = _tiny(n_groups=groups)
    hf = _hf_copy(model, tmp_path)
    assert hf.config.n_groups == groups and hf.config.chunk_size == 256
    for length in (1, 7, 70, 130):
        ids = _ids((3, length), seed=length)
        with torch.no_grad():
            assert_close_scaled(model(ids), hf(ids).logits, FP32, f"{groups} groups, logits at length {length}")


def test_base_model_equals_transformers_mamba2_model(tmp_path):
    model = _tiny(Mamba2Model)
    hf = _hf_copy(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Mamba2Model"]
    ids = _ids((2, 33))
    with torch.no_grad():
        assert_close_scaled(model(ids), hf(ids).last_hidden_state, FP32, "last hidden state")


def test_a_time_step_limit_clamps_the_steps_as_transformers(tmp_path):
    model = _tiny(time_step_limit=(0.05, 0.4))
    hf = _hf_copy(model, tmp_path)
    assert tuple(hf.config.time_step_limit) == (0.05, 0.4)
    ids = _ids((2, 40))
    with torch.no_grad():
        got = model(ids)
        assert_close_scaled(got, hf(ids).logits, FP32, "clamped steps")
        model.layers[0].mixer.c.time_step_limit = (0.0, math.inf)
        assert not torch.allclose(model(ids), got), "the clamp changed nothing; the test could not fail"


def test_transformers_checkpoint_loads_and_round_trips(tmp_path):
    """transformers' own initialisation and its defaults (untied head, infinity in the config as
    {"__float__": "Infinity"}) -> attnlab -> save_pretrained -> transformers: the same numbers."""
    config = transformers.Mamba2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8,
                                       head_dim=16, num_heads=4, n_groups=2, expand=2, chunk_size=16)
    torch.manual_seed(3)
    hf = transformers.Mamba2ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours) is Mamba2 and not ours.config.tie_word_embeddings
    assert ours.config.time_step_limit == (0.0, math.inf) and ours.config.chunk_size == 16
    ids = _ids((2, 37))
    with torch.no_grad():
        assert_close_scaled(ours(ids), hf(ids).logits, FP32, "from transformers")
        ours.save_pretrained(tmp_path / "again")
        back = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "again").eval()
        assert torch.equal(back(ids).logits, hf(ids).logits)
    assert attnlab.from_pretrained(tmp_path / "again").config == ours.config


def test_greedy_generation_equals_transformers_for_32_tokens(pair):
    model, hf = pair
    prompt = _ids((2, 6), seed=4)
    ours = model.generate(prompt, 32)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours, theirs)


def _gated_rms_norm_reference(x, z, weight, group_size, eps):
    """Mamba-2's gated norm as the paper's reference code states it (Dao & Gu 2024, section 7.1:
    the output is gated by SiLU(z) before the norm, and with ngroups > 1 each group of
    ``group_size`` channels is normalised on its own): y = x * silu(z);
    y_g <- y_g / sqrt(mean(y_g^2) + eps) for every group g; out = weight * y. Written here from the
    equations rather than imported: transformers' class for it is private and was renamed in 5.x
    (the full model's parity above goes through its public Mamba2ForCausalLM with ngroups = 2)."""
    y = x.double() * torch.nn.functional.silu(z.double())
    groups = y.unflatten(-1, (-1, group_size))
    groups = groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * groups.flatten(-2)).float()


def test_gated_norm_equals_the_reference_per_group():
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(3, 5, 24, generator=g), torch.randn(3, 5, 24, generator=g)
    ours = GatedRMSNorm(24, groups=3, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(1.0, 0.2, generator=g)
        want = _gated_rms_norm_reference(x, z, ours.weight, group_size=8, eps=1e-5)
        assert_close_scaled(ours(x, z), want, FP32_OP, "gated norm")
        # one group over the whole width is a different function: the grouping is really applied
        assert not torch.allclose(_gated_rms_norm_reference(x, z, ours.weight, group_size=24, eps=1e-5),
                                  ours(x, z), rtol=1e-3)
    with pytest.raises(ValueError, match="GatedRMSNorm: 5 groups do not divide the width 24"):
        GatedRMSNorm(24, groups=5)


# ----------------------------------------------------------------------------- decoding
def test_step_by_step_logits_equal_the_full_forward(pair):
    recurrent_contract.check_pieces_equal_the_full_forward(pair[0], _ids((3, 75), seed=5), [67])


def test_the_state_has_a_constant_size_per_token(pair):
    c = pair[0].config
    recurrent_contract.check_the_state_has_a_constant_size(
        pair[0], c.num_layers * 2 * (c.conv_dim * (c.d_conv - 1) + c.num_heads * c.head_dim * c.d_state))


def test_cached_equals_uncached_greedy(pair):
    recurrent_contract.check_cached_equals_uncached(pair[0])


def test_left_padded_batch_gives_each_row_what_it_gives_alone(pair):
    """The state is carried over padding unchanged (Δ = 0 there, zeros into the convolution).
    transformers' Mamba2 zeroes the padded inputs but its state still decays there, so it is no
    reference for this."""
    recurrent_contract.check_left_padding_changes_no_row(pair[0])


def test_speculative_decoding_equals_greedy_with_rejections_per_row(pair):
    recurrent_contract.check_speculative_decoding_equals_greedy(pair[0], _tiny(seed=0))


# ----------------------------------------------------------------------------- training surface
def test_a_log_d_and_dt_bias_do_not_decay():
    model = _tiny()
    exempt = no_decay_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in exempt}
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.1.mixer.dt_bias", "layers.0.mixer.norm.weight"} <= names
    assert "layers.0.mixer.in_proj.weight" not in names


def test_initialisation_is_the_papers_and_gives_small_logits():
    model = Mamba2(MAMBA2.preset("tiny"))
    mixer = model.layers[0].mixer
    assert torch.equal(-torch.exp(mixer.A_log), -torch.arange(1.0, 5.0))
    steps = torch.nn.functional.softplus(mixer.dt_bias.detach())
    assert 1e-3 * 0.99 <= float(steps.min()) and float(steps.max()) <= 0.1 * 1.01
    with torch.no_grad():
        assert model(_ids((2, 16))).abs().max() < 1.0


def test_sizing_builder_and_bad_input():
    config = MAMBA2.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, d_state=8,
                                 n_groups=2)
    assert (config.num_heads, config.head_dim, config.d_inner, config.n_groups) == (4, 24, 96, 2)
    assert MAMBA2.input_limits(config) == {"vocab_size": 50, "context": None}
    with pytest.raises(ValueError, match="mamba2: a Mamba-2 has no feed-forward block and no dropout"):
        MAMBA2.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, d_ff=64)
    with pytest.raises(ValueError, match=r"mamba2: the heads \(5\) must divide the inner width"):
        MAMBA2.build_config(vocab_size=50, context=24, d_model=48, num_heads=5, num_layers=2)
    with pytest.raises(ValueError, match=r"Mamba2Config: num_heads \* head_dim \(3 \* 64\) must equal"):
        Mamba2Config(d_model=128, num_heads=3)
    with pytest.raises(ValueError, match=r"Mamba2Config: n_groups \(3\) must divide num_heads \(4\)"):
        Mamba2Config(d_model=128, n_groups=3)
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, cached \+ new tokens\) = \(1, 3\)"):
        _tiny()(_ids((1, 3)), attention_mask=torch.ones(1, 4))
    with pytest.raises(TypeError, match="Mamba2Model has no language-model head"):
        _tiny(Mamba2Model).generate(_ids((1, 3)), 2)


def test_train_lm_with_mamba2_from_the_command_line(tmp_path):
    meta = recurrent_contract.check_train_lm_from_the_command_line(
        tmp_path, "mamba2", ["--heads", "2", "--d-state", "8", "--n-groups", "2"])
    assert (meta["model_type"], meta["architecture"]) == ("mamba2", "Mamba2ForCausalLM")
    assert (meta["config"]["num_heads"], meta["config"]["head_dim"], meta["config"]["n_groups"]) == (2, 16, 2)


def test_gradient_checkpointing_gives_the_same_gradients():
    recurrent_contract.check_gradient_checkpointing(_tiny())


def test_ssm_benchmark_quick_runs_for_mamba2():
    """benchmarks/ssm.py --models mamba2 keeps running: its smoke test on tiny shapes, which also
    checks that attnlab's Mamba2 and transformers' agree on the same weights before timing them."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ssm.py"), "--quick", "--threads", "1",
                           "--models", "mamba2"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same weights: logits agree" in proc.stdout
    for name in ("attnlab Mamba2 (chunked SSD)", "transformers Mamba2ForCausalLM (torch_forward)"):
        rows = [line for line in proc.stdout.splitlines() if line.startswith("fwd") and name in line]
        assert len(rows) == 4, name                          # 2 lengths x 2 modes
