"""Multi-head latent attention (attnlab.nn.MultiHeadLatentAttention): the block against transformers'
DeepseekV3Attention with the same weights, the absorbed projections against the expanded form
(full sequences, padding, step-by-step decoding), and what the cache holds per token.
Tolerance: FP32 (1e-5 of the values' scale) for every comparison of two fp32 computations."""
import pytest
import torch

from attnlab.nn import KVCache, LayerCaches, MultiHeadLatentAttention, RotaryEmbedding
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

E, H, C, DN, DR, DV = 32, 4, 12, 8, 6, 10


def _mla(q_lora_rank=16, interleaved=True, **kw):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(E, H, kv_lora_rank=C, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
                                 q_lora_rank=q_lora_rank, position=RotaryEmbedding(DR, interleaved=interleaved), **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_((1.0 if name.endswith("layernorm.weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return m.eval()


def _x(B=3, T=9, seed=2):
    return torch.randn(B, T, E, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_lora_rank", [None, 16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_block_equals_transformers_deepseek_v3_attention(q_lora_rank, interleaved):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DeepseekV3Config(hidden_size=E, num_attention_heads=H, num_key_value_heads=H,
                                        kv_lora_rank=C, q_lora_rank=q_lora_rank, qk_nope_head_dim=DN,
                                        qk_rope_head_dim=DR, v_head_dim=DV, rope_interleave=interleaved,
                                        max_position_embeddings=64, num_hidden_layers=1, vocab_size=8)
    ours = _mla(q_lora_rank, interleaved)
    # the attention and rotary modules read through the public model class
    base = transformers.AutoModel.from_config(cfg, attn_implementation="eager").eval()    # DeepseekV3Model
    hf = base.layers[0].self_attn
    state = {k.replace("out_proj", "o_proj"): v for k, v in ours.state_dict().items()}
    hf.load_state_dict(state)
    x = _x()
    B, T, _ = x.shape
    pos = torch.arange(T)[None].expand(B, T)
    cos_sin = base.rotary_emb(x, pos)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None].expand(B, 1, T, T)
    with torch.no_grad():
        want, _ = hf(x, cos_sin, causal)
        got, _ = ours(x)
    assert_close_scaled(got, want, FP32, f"MLA vs DeepseekV3Attention (q_lora_rank={q_lora_rank})")


def test_absorbed_equals_expanded_on_a_padded_batch():
    m = _mla()
    x = _x()
    pad = torch.ones(3, 9, dtype=torch.bool)
    pad[1, :4] = False
    pad[2, :8] = False                                     # one real token: a row that attends itself only
    with torch.no_grad():
        m.absorb = False
        want, w_want = m(x, key_padding_mask=pad, return_weights=True)
        m.absorb = True
        got, w_got = m(x, key_padding_mask=pad, return_weights=True)
    assert_close_scaled(got, want, FP32, "absorbed vs expanded output")
    assert_close_scaled(w_got, w_want, FP32, "absorbed vs expanded attention weights")
    assert w_got.shape == (3, H, 9, 9)


@pytest.mark.parametrize("absorb", [None, False])
def test_cached_decoding_equals_full_forward(absorb):
    """Prefill 4 tokens, then 5 single steps: the default absorbs the steps, False expands them; both
    equal the full forward (and so each other)."""
    m = _mla(absorb=absorb)
    x = _x(2, 9, seed=3)
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[1, :2] = False
    with torch.no_grad():
        full, _ = m(x, key_padding_mask=pad)
        cache = KVCache()
        steps = [m(x[:, :4], key_padding_mask=pad[:, :4], cache=cache)[0]]
        steps += [m(x[:, t:t + 1], key_padding_mask=pad[:, :t + 1], cache=cache)[0] for t in range(4, 9)]
    assert_close_scaled(torch.cat(steps, 1)[pad], full[pad], FP32, f"cached (absorb={absorb}) vs full forward")


def test_absorbed_path_reads_only_the_latent_cache(monkeypatch):
    """A decoding step's attention runs on one shared key/value head of width C + Dr and C, never on
    H expanded heads, and kv_b_proj never runs on the cache."""
    m = _mla()
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return real(q, k, v, **kw)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    seen = []
    m.kv_b_proj.register_forward_hook(lambda mod, i, o: seen.append(i[0].shape))
    cache = KVCache()
    with torch.no_grad():
        m(_x(2, 5), cache=cache)                            # prefill: expanded
        seen.clear(), calls.clear()
        m(_x(2, 1, seed=4), cache=cache)                    # one decoding step: absorbed
    assert not seen, "the absorbed step must not decompress the cached latents"
    assert calls == [((2, 1, H, C + DR), (2, 1, 6, C + DR), (2, 1, 6, C))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_the_latent_and_rope_key_per_token(dtype):
    m = _mla().to(dtype)
    caches = LayerCaches(1)
    with torch.no_grad():
        m(_x(2, 7).to(dtype), cache=caches.self_attn[0])
        m(_x(2, 1, seed=5).to(dtype), cache=caches.self_attn[0])
    c = caches.self_attn[0]
    S = caches.length
    held = c.k[:, :, :S], c.v[:, :, :S]
    per_token = sum(t.numel() * t.element_size() for t in held) // (2 * S)
    size = torch.empty((), dtype=dtype).element_size()
    assert per_token == (C + DR) * size == m.cache_bytes_per_token(dtype)
    assert held[0].shape == (2, 1, S, C) and held[1].shape == (2, 1, S, DR)
    assert per_token < 2 * H * (DN + DR) * size / 3, "MLA's cache must be far smaller than expanded keys/values"


def test_bad_inputs_are_named():
    m = _mla()
    x = _x()
    with pytest.raises(ValueError, match="self-attention only"):
        m(x, _x(seed=9))
    with pytest.raises(ValueError, match="d_model=32"):
        m(x[..., :8])
    with pytest.raises(ValueError, match=r"key_padding_mask must be a bool \(batch, keys\)"):
        m(x, key_padding_mask=torch.ones(3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_lora_rank=0"):
        MultiHeadLatentAttention(E, H, kv_lora_rank=0, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV)
