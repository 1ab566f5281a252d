"""DeepSeek-V3 against a tiny random transformers DeepseekV3ForCausalLM, through the converter users
call (attnlab.from_pretrained / save_pretrained): logits, left and right padding, cached decoding
(absorbed latent attention) against the full forward, greedy tokens, both checkpoint layouts, and
the cache's size. Tolerance: FP32 (1e-5 of the logits' scale) for every logits comparison; greedy
tokens exactly."""
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, DeepseekV3Config as HFConfig  # noqa: E402

import attnlab  # noqa: E402
from attnlab.hub import to_hf_state_dict  # noqa: E402
from attnlab.models.deepseek_v3 import DEEPSEEK_V3_FUSED_WEIGHT_MAP, DeepseekV3  # noqa: E402
from attnlab.nn import MultiHeadLatentAttention, SparseMoE  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

V, CTX = 96, 64
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
             v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=2,
             first_k_dense_replace=1, routed_scaling_factor=1.5, max_position_embeddings=CTX, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
# q-proj: YaRN with DeepSeek's mscale / mscale_all_dim (the softmax scale changes too) at a 4x stretch
YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = {"q-lora": dict(q_lora_rank=24), "q-proj": dict(q_lora_rank=None, rope_interleave=False, rope_parameters=YARN)}


def _randomize(model, seed=0):
    """Weights of order 0.2 (norm scales around 1) and a non-zero balancing bias, so that logits are
    O(1), routing varies and every mapping error shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn(b.shape, generator=g))


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


def _ids(B=2, T=12, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _close(a, b, what):
    assert_close_scaled(a, b, FP32, f"{what}: attnlab vs transformers")


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(saved, variant):
    hf, path = saved(variant)
    ours = attnlab.from_pretrained(path)
    assert type(ours) is DeepseekV3 and not ours.training
    assert isinstance(ours.layers[0].self_attn, MultiHeadLatentAttention)
    assert not isinstance(ours.layers[0].ff, SparseMoE) and isinstance(ours.layers[1].ff, SparseMoE)
    if variant == "q-proj":
        assert ours.config.rope_scaling["rope_type"] == "yarn"
        assert abs(ours.layers[0].self_attn.scale * 12 ** 0.5 - (0.1 * math.log(4.0) + 1) ** 2) < 1e-12
    with torch.no_grad():
        _close(ours(_ids(T=40)), hf(_ids(T=40)).logits, f"{variant} logits")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_logits_equal_transformers(saved, side):
    hf, path = saved("q-lora")
    ours = attnlab.from_pretrained(path)
    ids = _ids(3, 10, seed=2)
    mask = torch.ones(3, 10, dtype=torch.long)
    if side == "right":
        mask[1, 6:], mask[2, 3:] = 0, 0
    else:
        mask[1, :4], mask[2, :7] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask)
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    _close(got[real], want[real], f"{side}-padded logits (real tokens)")
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("padded", [False, True])
def test_cached_decoding_equals_full_forward(saved, padded):
    """The prompt is expanded, every later step runs the absorbed path over the latent cache."""
    ours = attnlab.from_pretrained(saved("q-lora")[1])
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
    c = ours.config
    for layer in cache.self_attn:                           # only the latent and the rope key per token
        assert layer.k.shape[1:2] + layer.k.shape[-1:] == (1, c.kv_lora_rank)
        assert layer.v.shape[1:2] + layer.v.shape[-1:] == (1, c.qk_rope_head_dim)


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
    assert torch.equal(ours.generate(prompt, 24, use_cache=False), got), "cached != uncached greedy tokens"


@pytest.mark.parametrize("variant", VARIANTS)
def test_save_pretrained_loads_in_transformers(saved, variant, tmp_path):
    hf, path = saved(variant)
    ours = attnlab.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["q_lora_rank"] == VARIANTS[variant]["q_lora_rank"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(path / "model.safetensors")), \
        "attnlab writes the keys transformers writes"
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    with torch.no_grad():
        _close(back.eval()(_ids(seed=3)).logits, hf(_ids(seed=3)).logits, f"{variant} attnlab save -> transformers")


def test_fused_expert_layout_both_ways(saved, tmp_path):
    """transformers 5.x's in-memory experts (gate_up_proj (X, 2F, E), down_proj (X, E, F))."""
    hf, _ = saved("q-lora")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 32, 32)
    hf.config.save_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    ours = attnlab.from_pretrained(tmp_path)
    with torch.no_grad():
        _close(ours(_ids(seed=5)), hf(_ids(seed=5)).logits, "from the fused layout")
    back = to_hf_state_dict(ours, DEEPSEEK_V3_FUSED_WEIGHT_MAP)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), f"fused layout round trip changed {k}"


def test_config_is_checked():
    from attnlab.models.deepseek_v3 import DeepseekV3Config
    with pytest.raises(ValueError, match="num_kv_heads \\(2\\) must equal num_heads \\(4\\)"):
        DeepseekV3Config(d_model=32, num_heads=4, num_kv_heads=2, num_layers=1)
    with pytest.raises(ValueError, match="DeepseekV3Config: need n_group dividing num_experts"):
        DeepseekV3Config(d_model=32, num_heads=4, num_layers=1, num_experts=6, n_group=4)


def test_the_deepseek_v3_preset_has_the_published_size():
    """671B parameters in the technical report (the checkpoint's further 14B are the multi-token
    prediction module, which is not built)."""
    from attnlab.models.registry import family
    fam = family("deepseek_v3")
    with torch.device("meta"):
        model = fam.default.build(fam.preset("deepseek-v3"))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9) == 671
