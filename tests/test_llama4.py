"""Llama 4 (text) against a tiny random transformers Llama4ForCausalLM, through the converter users
call: logits (with chunks, no-RoPE layers, QK-norm and the query temperature all active at these
lengths), left and right padding, cached decoding against the full forward, greedy tokens,
save_pretrained read back by transformers. Tolerance: FP32 (1e-5 of the logits' scale); tokens exact."""
import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, Llama4TextConfig as HFConfig  # noqa: E402

import attnlab  # noqa: E402
from attnlab.models.llama4 import Llama4, Llama4Config  # noqa: E402
from attnlab.nn import SparseMoE  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)
from contract import randomize_ as _randomize  # noqa: E402

V, CTX = 96, 64
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=16, intermediate_size_mlp=48, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, interleave_moe_layer_step=2,
             no_rope_layer_interval=2, attention_chunk_size=4, max_position_embeddings=CTX, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
# "tuned": the temperature changes every 2 positions; "long-floor": it stays 1 within these lengths, where
# transformers' slot-counted temperature and our position-counted one agree under left padding too
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
VARIANTS = {"tuned": dict(floor_scale=2, attn_scale=0.5, rope_parameters=LLAMA3), "long-floor": dict(floor_scale=CTX, use_qk_norm=False,
                                                                            rope_parameters={"rope_type": "default",
                                                                                             "rope_theta": 100.0})}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache = {}

    def get(variant):
        if variant not in cache:
            hf = AutoModelForCausalLM.from_config(HFConfig(**SIZES, **VARIANTS[variant]), attn_implementation="eager")
            _randomize(hf)
            path = tmp_path_factory.mktemp(variant)
            hf.eval().save_pretrained(path)
            cache[variant] = (hf, path)
        return cache[variant]
    return get


def _ids(B=2, T=14, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _close(a, b, what):
    assert_close_scaled(a, b, FP32, f"{what}: attnlab vs transformers")


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(saved, variant):
    hf, path = saved(variant)
    ours = attnlab.from_pretrained(path)
    assert type(ours) is Llama4
    assert [isinstance(layer.ff, SparseMoE) for layer in ours.layers] == [False, True, False, True]
    assert ours.config.layer_types == ["chunked_attention", "full_attention"] * 2
    assert (ours.config.rope_scaling or {}).get("rope_type") == ("llama3" if variant == "tuned" else None)
    with torch.no_grad():
        _close(ours(_ids()), hf(_ids()).logits, f"{variant} logits")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_logits_equal_transformers(saved, side):
    hf, path = saved("long-floor")
    ours = attnlab.from_pretrained(path)
    ids = _ids(3, 13, seed=2)
    mask = torch.ones(3, 13, dtype=torch.long)
    if side == "right":
        mask[1, 6:], mask[2, 3:] = 0, 0
    else:
        mask[1, :3], mask[2, :7] = 0, 0            # 3 pad slots: chunks shift with the true positions
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    _close(got[real], want[real], f"{side}-padded logits (real tokens)")


@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_equals_full_forward(saved, padded):
    ours = attnlab.from_pretrained(saved("tuned")[1])
    ids = _ids(2, 14, seed=7)
    mask = torch.ones(2, 14, dtype=torch.bool)
    if padded:
        mask[1, :3] = False
    given = mask if padded else None
    with torch.no_grad():
        full = ours(ids, attention_mask=given)
        cache = ours.new_cache()
        steps = [ours(ids[:, :5], attention_mask=None if given is None else mask[:, :5], cache=cache)]
        for t in range(5, 14):
            steps.append(ours(ids[:, t:t + 1], attention_mask=None if given is None else mask[:, :t + 1], cache=cache))
    _close(torch.cat(steps, 1)[mask], full[mask], f"cached vs full forward (padded={padded})")


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_equals_transformers(saved, variant):
    hf, path = saved(variant)
    ours = attnlab.from_pretrained(path)
    prompt = _ids(2, 6, seed=8)
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(prompt, 24)
    assert torch.equal(got, want), f"greedy tokens differ\nattnlab {got.tolist()}\nHF      {want.tolist()}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_in_transformers(saved, variant, tmp_path):
    hf, path = saved(variant)
    ours = attnlab.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama4_text" and config["architectures"] == ["Llama4ForCausalLM"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(path / "model.safetensors"))
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    with torch.no_grad():
        _close(back.eval()(_ids(seed=3)).logits, hf(_ids(seed=3)).logits, f"{variant} attnlab save -> transformers")


def test_every_mechanism_changes_the_logits(saved):
    """Switching off chunks, QK-norm or the temperature changes the output: each is exercised above."""
    ours = attnlab.from_pretrained(saved("tuned")[1])
    with torch.no_grad():
        base = ours(_ids())
        for change in (dict(attention_chunk_size=None, layer_types=None), dict(use_qk_norm=False),
                       dict(attn_temperature_tuning=False)):
            other = Llama4(Llama4Config(**{**ours.config.__dict__, **change})).eval()
            other.load_state_dict(ours.state_dict())
            assert (other(_ids()) - base).abs().max() > 1e-3, f"{change} made no difference"


def test_config_is_checked():
    with pytest.raises(ValueError, match="no_rope_layers must be 2 values of 0 or 1"):
        Llama4Config(d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, no_rope_layers=[1, 2])
    with pytest.raises(ValueError, match="moe_layers \\[5\\] must be layer indices below 2"):
        Llama4Config(d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, moe_layers=[5])
