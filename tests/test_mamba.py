"""Mamba (attnlab.models.mamba): parity with transformers' MambaForCausalLM and MambaModel (their
pure-PyTorch path on CPU) with the same weights; generation through the recurrent state (step by
step equals the full forward, cached equals uncached, left padding changes no row, speculative
decoding equals greedy, the state's size does not grow); A_log and D do not decay; `attnlab train
lm --model mamba` trains and generates."""
import json

import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401
import contract
import recurrent_contract
from attnlab.models.mamba import MAMBA, Mamba, MambaConfig, MambaModel
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)

transformers = pytest.importorskip("transformers")


def _tiny(cls=Mamba, seed=0, **overrides) -> Mamba:
    torch.manual_seed(seed)
    model = cls(MAMBA.preset("tiny", **overrides))
    contract.randomize_(model, seed)
    with torch.no_grad():                      # A = -exp(A_log) of the paper's spread, positive steps
        for layer in model.layers:
            layer.mixer.A_log.copy_(torch.log(torch.arange(1, 5.0)).repeat(layer.mixer.D.numel(), 1)
                                    + 0.3 * torch.randn(layer.mixer.A_log.shape))
    return model.eval()


def _ids(shape, seed=1, vocab=96):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Our tiny Mamba and transformers' MambaForCausalLM loaded from its save_pretrained."""
    model = _tiny()
    d = attnlab.save_pretrained(model, tmp_path_factory.mktemp("mamba"))
    hf = transformers.MambaForCausalLM.from_pretrained(d).eval()
    return model, hf, d


# ----------------------------------------------------------------------------- transformers
def test_logits_equal_transformers_at_lengths_the_chunk_does_not_divide(pair):
    model, hf, _ = pair
    for length in (1, 7, 70):
        ids = _ids((3, length), seed=length)
        with torch.no_grad():
            assert_close_scaled(model(ids), hf(ids).logits, FP32, f"logits at length {length}")


def test_base_model_equals_transformers_mamba_model(tmp_path):
    model = _tiny(MambaModel)
    attnlab.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MambaModel"]
    hf = transformers.MambaModel.from_pretrained(tmp_path).eval()
    ids = _ids((2, 33))
    with torch.no_grad():
        assert_close_scaled(model(ids), hf(ids).last_hidden_state, FP32, "last hidden state")


def test_transformers_checkpoint_loads_and_round_trips(pair, tmp_path):
    _, hf, _ = pair
    hf.save_pretrained(tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert type(ours) is Mamba and ours.config.dt_rank == 3
    assert ours.lm_head.weight is ours.token_embedding.weight
    ids = _ids((2, 20))
    with torch.no_grad():
        assert_close_scaled(ours(ids), hf(ids).logits, FP32, "from transformers")
        ours.save_pretrained(tmp_path / "again")
        back = transformers.MambaForCausalLM.from_pretrained(tmp_path / "again").eval()
        assert torch.equal(back(ids).logits, hf(ids).logits)


def test_greedy_generation_equals_transformers_for_32_tokens(pair):
    model, hf, _ = pair
    prompt = _ids((2, 6), seed=4)
    ours = model.generate(prompt, 32)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(ours, theirs)


# ----------------------------------------------------------------------------- decoding
def test_step_by_step_logits_equal_the_full_forward(pair):
    recurrent_contract.check_pieces_equal_the_full_forward(pair[0], _ids((3, 19), seed=5), [4])


def test_the_state_has_a_constant_size_per_token(pair):
    c = pair[0].config
    recurrent_contract.check_the_state_has_a_constant_size(pair[0], c.num_layers * 2 * c.d_inner * (c.d_conv - 1 + c.d_state),
                                                           steps=40)


def test_cached_equals_uncached_greedy(pair):
    recurrent_contract.check_cached_equals_uncached(pair[0])


def test_left_padded_batch_gives_each_row_what_it_gives_alone(pair):
    recurrent_contract.check_left_padding_changes_no_row(pair[0])


def test_speculative_decoding_equals_greedy_with_rejections_per_row(pair):
    recurrent_contract.check_speculative_decoding_equals_greedy(pair[0], _tiny(seed=0), noise=0.08)


def test_beam_search_runs_through_the_recurrent_state(pair):
    recurrent_contract.check_beam_search(pair[0])


# ----------------------------------------------------------------------------- training surface
def test_a_log_and_d_do_not_decay():
    model = _tiny()
    exempt = no_decay_parameters(model)
    names = {n for n, p in model.named_parameters() if id(p) in exempt}
    assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.1.mixer.A_log", "layers.0.norm.weight"} <= names
    assert "layers.0.mixer.in_proj.weight" not in names


def test_initialisation_is_the_papers_and_gives_small_logits():
    model = Mamba(MAMBA.preset("tiny"))
    mixer = model.layers[0].mixer
    assert torch.equal(-torch.exp(mixer.A_log[0]), -torch.arange(1.0, 5.0))
    steps = torch.nn.functional.softplus(mixer.dt_proj.bias.detach())
    assert 1e-3 * 0.99 <= float(steps.min()) and float(steps.max()) <= 0.1 * 1.01
    with torch.no_grad():
        assert model(_ids((2, 16))).abs().max() < 1.0


def test_sizing_builder_and_bad_input():
    config = MAMBA.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, d_state=8, expand=3)
    assert (config.d_state, config.d_inner, config.dt_rank, config.d_conv) == (8, 144, 3, 4)
    assert MAMBA.input_limits(config) == {"vocab_size": 50, "context": None}
    with pytest.raises(ValueError, match="mamba: a Mamba has no feed-forward block and no dropout"):
        MAMBA.build_config(vocab_size=50, context=24, d_model=48, num_heads=4, num_layers=2, d_ff=64)
    with pytest.raises(ValueError, match="MambaConfig: d_state must be positive, got 0"):
        MambaConfig(d_state=0)
    model = _tiny()
    with pytest.raises(ValueError, match="cache must be the model's decoding state"):
        model(_ids((1, 3)), cache=attnlab.models.GPT(attnlab.models.GPTConfig(
            vocab_size=96, n_positions=8, d_model=8, num_heads=2, num_layers=1)).new_cache())
    with pytest.raises(ValueError, match=r"attention_mask must be \(batch, cached \+ new tokens\) = \(1, 3\)"):
        model(_ids((1, 3)), attention_mask=torch.ones(1, 4))
    with pytest.raises(TypeError, match="MambaModel has no language-model head"):
        _tiny(MambaModel).generate(_ids((1, 3)), 2)


def test_train_lm_with_mamba_from_the_command_line(tmp_path):
    meta = recurrent_contract.check_train_lm_from_the_command_line(
        tmp_path, "mamba", ["--d-state", "4", "--expand", "2"])
    assert (meta["model_type"], meta["architecture"], meta["config"]["d_state"]) == ("mamba", "MambaForCausalLM", 4)


def test_gradient_checkpointing_gives_the_same_gradients():
    recurrent_contract.check_gradient_checkpointing(_tiny())
