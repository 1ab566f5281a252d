"""The RoPE variants of released checkpoints (attnlab.nn.rope) against transformers: inverse
frequencies and attention factors equal ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS``
for each type, and a tiny LlamaForCausalLM of each type gives transformers' logits through
attnlab.from_pretrained, past the original context where the type depends on the length, and
back through save_pretrained."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig as HFLlamaConfig  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import attnlab  # noqa: E402
from attnlab.models.llama import LlamaConfig, rope_from_hf, rope_to_hf  # noqa: E402
from attnlab.nn.position import RotaryEmbedding  # noqa: E402
from attnlab.nn.rope import rope_frequencies  # noqa: E402
from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402

HEAD, CTX = 16, 32
LONG = [1.0 + 0.5 * i for i in range(HEAD // 2)]
SHORT = [1.0 + 0.05 * i for i in range(HEAD // 2)]
TYPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-no-truncate": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16,
                         "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                              "attention_factor": 0.8},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": 16},
}


def _hf_config(rope: dict, partial: float = 1.0, ctx: int = CTX, **extra) -> HFLlamaConfig:
    params = {**rope, "rope_theta": 500.0}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return HFLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD, max_position_embeddings=ctx,
                         rope_parameters=params, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", list(TYPES))
@pytest.mark.parametrize("seq_len", [None, 12, 40])
def test_frequencies_and_attention_factor_equal_transformers(name, partial, seq_len):
    """Each type at a length inside and past the original context; rtol 1e-6 (FP32_OP): the same
    formula in fp32 (dynamic's base comes from the length in fp32 on both sides)."""
    rope = dict(TYPES[name])
    dim = int(HEAD * partial)
    if name == "longrope":
        rope = dict(rope, short_factor=SHORT[: dim // 2], long_factor=LONG[: dim // 2])
    config = _hf_config(rope, partial)
    kind = rope["rope_type"]
    hf_len = None if seq_len is None else torch.tensor(seq_len)       # what transformers passes at run time
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=hf_len)
    ours = rope_from_hf(config.to_dict(), "test")
    got, factor = rope_frequencies(dim, ours["rope_theta"], ours["rope_scaling"], CTX, seq_len)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert_close_scaled(got, want, FP32_OP, f"{name} inverse frequencies (partial {partial}, length {seq_len})")
    assert factor == pytest.approx(float(want_factor), rel=1e-12), f"{name} attention factor"
    if name != "linear":
        plain, _ = rope_frequencies(dim, 500.0, None)
        if seq_len is None and kind in ("dynamic",):
            assert torch.equal(got, plain), "dynamic inside the trained context is plain RoPE"
        elif seq_len == 40 or kind not in ("dynamic",):
            assert not torch.allclose(got, plain), f"{name} must change the frequencies (the check can fail)"


def test_rotary_module_scales_cos_and_sin_by_the_attention_factor():
    rope = RotaryEmbedding(HEAD, 500.0, scaling=TYPES["yarn"], max_position_embeddings=CTX)
    plain = RotaryEmbedding(HEAD, 500.0)
    plain.inv_freq = rope.inv_freq
    q, k = torch.randn(1, 2, 5, HEAD), torch.randn(1, 1, 5, HEAD)
    pos = torch.arange(5)
    (q1, k1), (q0, k0) = rope.transform(q, k, pos), plain.transform(q, k, pos)
    f = rope.attention_factor
    assert f == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1, rel=1e-6)
    assert_close_scaled(q1, f * q0, FP32_OP, "q times the YaRN factor")
    assert_close_scaled(k1, f * k0, FP32_OP, "k times the YaRN factor")


def test_reading_configs_of_each_generation():
    """4.x's rope_theta + rope_scaling ("type"), 5.x's rope_parameters, Phi-3's top-level
    original_max_position_embeddings (it wins), and a clear refusal of an unknown type."""
    old = {"max_position_embeddings": 64, "rope_theta": 1e6,
           "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}}
    got = rope_from_hf(old, "t")
    assert got == {"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 16}}
    phi3 = {"max_position_embeddings": 128, "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0],
                                "long_factor": [2.0], "original_max_position_embeddings": 99}}
    got = rope_from_hf(phi3, "t")
    assert got["rope_scaling"]["original_max_position_embeddings"] == 32 and got["partial_rotary_factor"] == 0.75
    assert rope_from_hf({"max_position_embeddings": 64, "rope_parameters": {"rope_type": "llama3", "factor": 8,
                         "low_freq_factor": 1, "high_freq_factor": 4}}, "t")["rope_scaling"][
        "original_max_position_embeddings"] == 64, "llama3 without its original context: max_position_embeddings"
    assert rope_to_hf(1e4, {"rope_type": "linear", "factor": 2.0}, 0.5) == {
        "rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="RoPE type 'su' is not supported"):
        LlamaConfig(rope_scaling={"rope_type": "su", "factor": 2.0})
    with pytest.raises(ValueError, match="'llama3' needs low_freq_factor, high_freq_factor"):
        LlamaConfig(rope_scaling={"rope_type": "llama3", "factor": 2.0, "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="short_factor has 1 entries, rotary_dim / 2 = 64 expected"):
        LlamaConfig(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                  "original_max_position_embeddings": 8})
    with pytest.raises(ValueError, match="no Hugging Face equivalent"):
        rope_to_hf(1e4, {"rope_type": "ntk", "factor": 2.0})


# ----------------------------------------------------------------------------- whole models
MODEL_TYPES = {          # name -> (rope parameters, max_position_embeddings, tokens: past the original context)
    "llama3": (TYPES["llama3"], 64, 40),
    "yarn": (TYPES["yarn-mscale"], 64, 40),
    "dynamic": (TYPES["dynamic"], CTX, 48),
    "longrope": (TYPES["longrope"], 64, 40),
}


def _randomize(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if p.dim() == 1 else 0.0) + 0.2 * torch.randn(p.shape, generator=g))


def _hf_model(name, tmp_path):
    rope, ctx, _ = MODEL_TYPES[name]
    hf = AutoModelForCausalLM.from_config(_hf_config(rope, ctx=ctx), attn_implementation="eager")
    _randomize(hf)
    hf.eval().save_pretrained(tmp_path)
    return hf


def _ids(B, T, seed=0):
    return torch.randint(0, 96, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODEL_TYPES))
def test_llama_with_each_rope_type_equals_transformers(name, tmp_path):
    """Logits at rtol 1e-5 (FP32) of their scale, both ways, at a length past the original context
    (a fresh transformers model per length: its dynamic RoPE keeps state between calls)."""
    _, _, T = MODEL_TYPES[name]
    _hf_model(name, tmp_path / "hf")
    ours = attnlab.from_pretrained(tmp_path / "hf")
    assert ours.config.rope_scaling["rope_type"] == name
    for length in (12, T):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
        ids = _ids(2, length)
        with torch.no_grad():
            assert_close_scaled(ours(ids), hf(ids).logits, FP32, f"{name} logits at {length} tokens")
    ours.save_pretrained(tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())["rope_parameters"]
    assert written["rope_type"] == name and written["rope_theta"] == 500.0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    ids = _ids(2, T, seed=1)
    with torch.no_grad():
        assert_close_scaled(ours(ids), back(ids).logits, FP32, f"{name}: attnlab save -> transformers")


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_length_dependent_types_decode_as_transformers(name, tmp_path):
    """Greedy tokens from a prompt inside the original context into the stretched one: each new
    token's frequencies come from the length at its step, cached keys keep theirs (transformers'
    generate does the same); our cached decode equals transformers' greedy tokens."""
    hf = _hf_model(name, tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    prompt = _ids(1, 10, seed=2)
    n = MODEL_TYPES[name][2] - 10
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(prompt, n)
    assert torch.equal(got, want), f"{name}: greedy tokens differ\nattnlab {got.tolist()}\nHF      {want.tolist()}"


# ----------------------------------------------------------------------------- stretching a loaded model
@pytest.mark.parametrize("rope_type", ["linear", "yarn", "default"])
def test_stretch_context_reaches_every_layer_as_transformers_builds_that_rope(rope_type, tmp_path):
    """stretch_context(model, 2, type) on a loaded plain-RoPE checkpoint: every layer's rotary module
    has transformers' inverse frequencies and attention factor for a config of that type (rtol 1e-6,
    FP32_OP), the logits past the trained context equal transformers' model with the same weights
    and that config (rtol 1e-5, FP32), and save_pretrained writes a config transformers reads alike."""
    from attnlab.models.rope_config import stretch_context
    from transformers import LlamaForCausalLM
    plain = AutoModelForCausalLM.from_config(_hf_config({"rope_type": "default"}), attn_implementation="eager")
    _randomize(plain)
    plain.eval().save_pretrained(tmp_path / "plain")
    ours = attnlab.from_pretrained(tmp_path / "plain")
    ids = _ids(2, 2 * CTX - 8)                                     # past the trained context of CTX
    with pytest.raises(ValueError, match="beyond the model's context of 32"):
        ours(ids)
    before = ours.rotary_emb.inv_freq.clone()
    assert stretch_context(ours, 2.0, rope_type) is ours
    rope = {"rope_type": rope_type} if rope_type != "yarn" else \
        {"rope_type": "yarn", "original_max_position_embeddings": CTX}
    if rope_type != "default":
        rope["factor"] = 2.0
    config = _hf_config(rope, ctx=2 * CTX)
    if rope_type == "default":
        want, want_factor = before, 1.0
    else:
        want, want_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        assert not torch.allclose(want, before), "the stretch must change the frequencies (the check can fail)"
    for layer in ours.layers:
        position = layer.self_attn.position
        assert_close_scaled(position.inv_freq, want, FP32_OP, f"{rope_type}: a layer's inverse frequencies")
        assert position.attention_factor == pytest.approx(float(want_factor), rel=1e-12)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(plain.state_dict())
    with torch.no_grad():
        assert_close_scaled(ours(ids), hf(ids).logits, FP32, f"{rope_type} x2: logits at {ids.size(1)} tokens")
    ours.save_pretrained(tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert back.config.max_position_embeddings == 2 * CTX
    with torch.no_grad():
        assert_close_scaled(ours(ids), back(ids).logits, FP32, f"{rope_type} x2: attnlab save -> transformers")


def test_stretch_context_refuses_in_one_line():
    from attnlab.models.rope_config import stretch_context
    from attnlab.models.llama import Llama
    model = Llama(LlamaConfig(vocab_size=96, d_model=32, num_heads=2, num_layers=1, d_ff=48,
                              max_position_embeddings=CTX))
    with pytest.raises(ValueError, match=r"rope_type must be one of default, linear, yarn, got 'ntk'"):
        stretch_context(model, 2.0, "ntk")
    with pytest.raises(ValueError, match="factor must be a number >= 1, got 0.5"):
        stretch_context(model, 0.5)
    stretch_context(model, 2.0, "linear")
    with pytest.raises(ValueError, match=r"RoPE is already scaled \(linear\)"):
        stretch_context(model, 2.0, "yarn")
    with pytest.raises(ValueError, match="not a model whose layers share LLaMA's rotary embedding"):
        stretch_context(torch.nn.Linear(2, 2), 2.0)
