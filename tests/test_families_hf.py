"""Today's decoder families against tiny random transformers models, both ways, through the
converter users call: logits at rtol 1e-5 (FP32) of their scale, left padding, KV cache = no
cache, greedy tokens, transformers' save read by attnlab.from_pretrained and ours read by
AutoModelForCausalLM. Each config turns on what its family differs by (sliding windows shorter
than the sequences, biases, QK-norm, no-RoPE layers, partial rotary, soft-capping, ...)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

import attnlab  # noqa: E402
from attnlab.nn.cache import LayerCaches  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402

V, CTX, T = 96, 64, 20          # T > every window below
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=CTX, bos_token_id=None, eos_token_id=None,
            pad_token_id=None, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}

CONFIGS = {      # family -> (model_type, config fields beyond BASE)
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=2)),
    "qwen2-yarn": ("qwen2", dict(rope_parameters=YARN)),
    "mistral": ("mistral", dict(sliding_window=6, head_dim=16)),
    "qwen3": ("qwen3", dict(head_dim=16, attention_bias=False, use_sliding_window=True, sliding_window=6,
                            max_window_layers=3)),
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0, 1, 0], use_sliding_window=True, sliding_window=6,
                                layer_types=["full_attention", "sliding_attention"] * 2)),
    "phi3": ("phi3", dict(num_attention_heads=4, num_key_value_heads=1, partial_rotary_factor=0.5,
                          original_max_position_embeddings=12,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                           "short_factor": [1.0, 1.2], "long_factor": [2.0, 5.0],
                                           "original_max_position_embeddings": 40})),
    "olmo2": ("olmo2", dict(attention_bias=True)),
    "gemma": ("gemma", dict(head_dim=16, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)),
    "gemma3": ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=6, sliding_window_pattern=2,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6}})),
}


# LongRoPE switches to its long factors past 12 tokens: transformers' Phi-3 generate recomputes its
# cache there, and so does attnlab's Phi-3 (test_phi3_greedy_across_the_longrope_switch); the
# cached-decoding test starts past it (a cache fed by hand crosses it with its keys as they were)
PROMPT = {"phi3": 13}


def _randomize(model):
    """Weights of order 0.2 (norm gains around 1) so logits are O(1) and mapping errors show."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") and "norm" in name else 0.0
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (transformers model, the directory its save_pretrained wrote), built once."""
    cache = {}

    def get(family):
        if family not in cache:
            model_type, extra = CONFIGS[family]
            config = AutoConfig.for_model(model_type, **{**BASE, **extra})
            hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
            _randomize(hf)
            path = tmp_path_factory.mktemp(family)
            hf.eval().save_pretrained(path)
            cache[family] = (hf, path)
        return cache[family]
    return get


def _ids(B, L, seed):
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


def _padded(seed):
    ids = _ids(3, T, seed)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :4], mask[2, :9] = 0, 0                       # left padding
    return ids, mask


@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_and_left_padding_equal_transformers(saved, family):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    assert type(ours).__name__.lower().startswith(family.split("-")[0][:4])
    ids, mask = _padded(1)
    with torch.no_grad():
        assert_close_scaled(ours(ids), hf(ids).logits, FP32, f"{family} logits")
        got = ours(ids, attention_mask=mask)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    assert_close_scaled(got[real], want[real], FP32, f"{family} left-padded logits (real tokens)")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_cached_decoding_equals_full_forward(saved, family):
    ours = attnlab.from_pretrained(saved(family)[1])
    ids, mask = _padded(2)
    mask = mask.bool()
    with torch.no_grad():
        full = ours(ids, attention_mask=mask)
        cache = ours.new_cache()
        P = PROMPT.get(family, 10)
        steps = [ours(ids[:, :P], attention_mask=mask[:, :P], cache=cache)]
        for t in range(P, T):
            steps.append(ours(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache))
    assert_close_scaled(torch.cat(steps, 1)[mask], full[mask], FP32, f"{family} cached vs full forward")


@pytest.mark.parametrize("family", list(CONFIGS))
def test_greedy_tokens_equal_transformers(saved, family):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    prompt = _ids(2, PROMPT.get(family, 5), seed=3)
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=T, min_new_tokens=T,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(prompt, T)
    assert torch.equal(got, want), f"{family}: greedy tokens differ\nattnlab {got.tolist()}\nHF      {want.tolist()}"


def test_phi3_greedy_across_the_longrope_switch(saved):
    """A 5-token prompt decoded past the switch at 12 tokens: transformers drops its cache there and
    recomputes every key with the long factors; so does attnlab's Phi-3, token for token. The
    switch changes the logits (the test would not see a wrong recomputation otherwise)."""
    hf, path = saved("phi3")
    ours = attnlab.from_pretrained(path)
    prompt = _ids(2, 5, seed=3)
    with torch.no_grad():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=T, min_new_tokens=T,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        got = ours.generate(prompt, T)
        ours.new_cache = lambda: LayerCaches(len(ours.layers))     # a plain cache keeps the short rotations
        kept = ours.generate(prompt, T)
    assert torch.equal(got, want), f"phi3: greedy tokens differ\nattnlab {got.tolist()}\nHF      {want.tolist()}"
    assert not torch.equal(kept, want), "the switch changed nothing here: the test could not fail"


@pytest.mark.parametrize("family", list(CONFIGS))
def test_our_save_reads_back_in_transformers(saved, family, tmp_path):
    hf, path = saved(family)
    ours = attnlab.from_pretrained(path)
    ours.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == CONFIGS[family][0] and written["architectures"] == [type(hf).__name__]
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                                      output_loading_info=True)
    assert not any(info.values()), f"{family}: transformers reports {info}"
    ids = _ids(2, T, seed=4)
    with torch.no_grad():
        assert_close_scaled(back.eval()(ids).logits, hf(ids).logits, FP32, f"{family}: attnlab save -> transformers")
