"""Mamba (attnlab.models.mamba): parity with transformers' MambaForCausalLM and MambaModel (their
pure-PyTorch path on CPU) with the same weights; generation through the recurrent state (step by
step equals the full forward, cached equals uncached, left padding changes no row, speculative
decoding equals greedy, the state's size does not grow); A_log and D do not decay; `attnlab train
lm --model mamba` trains and generates."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401
import contract
from attnlab.generate import GenerationStats, generate
from attnlab.models.mamba import MAMBA, Mamba, MambaConfig, MambaModel
from attnlab.train.optim import no_decay_parameters
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


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
    model = pair[0]
    ids = _ids((3, 19), seed=5)
    with torch.no_grad():
        full = model(ids)
        state = model.new_cache()
        steps = [model(ids[:, :4], cache=state)] + [model(ids[:, t:t + 1], cache=state) for t in range(4, 19)]
    assert state.length == 19
    assert_close_scaled(torch.cat(steps, 1), full, FP32, "stepwise logits")


def test_the_state_has_a_constant_size_per_token(pair):
    model = pair[0]
    sizes = []
    with torch.no_grad():
        state = model.new_cache()
        model(_ids((2, 3)), cache=state)
        for t in range(40):
            model(_ids((2, 1), seed=t), cache=state)
            sizes.append(sum(x.numel() for x in state.tensors))
    c = model.config
    assert set(sizes) == {c.num_layers * 2 * c.d_inner * (c.d_conv - 1 + c.d_state)}


def test_cached_equals_uncached_greedy(pair):
    model = pair[0]
    prompt = _ids((3, 5), seed=6)
    stats = GenerationStats()
    cached = generate(model, prompt, 16, stats=stats)
    assert stats.target_passes == 16
    assert torch.equal(cached, generate(model, prompt, 16, use_cache=False))


def _left_padded():
    prompts = [_ids((1, n), seed=10 + n)[0] for n in (6, 2, 4)]
    ids, mask = torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, 6 - len(p):], mask[i, 6 - len(p):] = p, 1
    return prompts, ids, mask


def test_left_padded_batch_gives_each_row_what_it_gives_alone(pair):
    model = pair[0]
    prompts, ids, mask = _left_padded()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask)
        for i, p in enumerate(prompts):
            assert_close_scaled(padded[i, 6 - len(p):], model(p[None])[0], FP32, f"row {i} logits")
    for use_cache in (True, False):
        out = generate(model, ids, 12, attention_mask=mask, use_cache=use_cache)
        for i, p in enumerate(prompts):
            assert out[i, 6:].tolist() == generate(model, p[None], 12)[0, len(p):].tolist(), f"row {i}"


def test_speculative_decoding_equals_greedy_with_rejections_per_row(pair):
    model = pair[0]
    prompts, ids, mask = _left_padded()
    plain = generate(model, ids, 14, attention_mask=mask)
    draft = _tiny(seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in draft.parameters():
            p.add_(0.08 * torch.randn(p.shape, generator=g))
    for k in (1, 3):
        stats = GenerationStats()
        got = generate(model, ids, 14, attention_mask=mask, draft_model=draft, num_draft_tokens=k, stats=stats)
        assert torch.equal(got, plain), f"k={k}"
        assert 0 < stats.accepted < stats.drafted, (k, stats)
    assert torch.equal(model.generate(ids, 14, attention_mask=mask, draft_model=model), plain)


def test_beam_search_runs_through_the_recurrent_state(pair):
    model = pair[0]
    prompt = _ids((2, 4), seed=8)
    beams = generate(model, prompt, 6, num_beams=3)
    assert torch.equal(beams, generate(model, prompt, 6, num_beams=3, use_cache=False))
    assert torch.equal(generate(model, prompt, 6, num_beams=1), generate(model, prompt, 6))


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
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["train", "lm", "--model", "mamba", "--data", tmp_path / "text.txt", "--out", tmp_path / "run",
            "--steps", "12", "--d-model", "16", "--layers", "1", "--d-state", "4", "--expand", "2", "--context", "24",
            "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--eval-every", "6", "--no-progress"]
    r = subprocess.run([sys.executable, "-m", "attnlab.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "run" / "best" / "run.json").read_text())
    assert (meta["model_type"], meta["architecture"], meta["config"]["d_state"]) == ("mamba", "MambaForCausalLM", 4)
    train = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert train[-1] < train[0], train
    g = subprocess.run([sys.executable, "-m", "attnlab.cli", "generate", str(tmp_path / "run"), "--prompt", "the",
                        "--max-new-tokens", "40"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert g.returncode == 0, g.stderr
    assert len(g.stdout) >= 40


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _tiny().train()
    ids = _ids((2, 30))

    def grads():
        model.zero_grad()
        model(ids).square().mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    plain = grads()
    model.gradient_checkpointing = True
    assert_close_scaled(grads(), plain, FP32, "checkpointed gradients")
