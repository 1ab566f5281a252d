"""Attention core: parity with torch, the mask convention, pitfalls 1-6, bad input.

Tolerance (tests/_tolerance.py): fp32, max |got - want| <= 1e-5 x the largest value compared
(FP32), unless a test says otherwise.
"""
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from torch import nn

import attnlab.nn.attention as attention_mod
from attnlab.nn import (KVCache, MultiHeadAttention, causal_mask, combine_masks, generate_square_subsequent_mask,
                        padding_mask, scaled_dot_product_attention)

from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)


def copy_from_torch(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    """Copy torch's packed/unpacked in-projection into attnlab's layout."""
    E = ref.embed_dim
    with torch.no_grad():
        if ref._qkv_same_embed_dim:
            ws = ref.in_proj_weight.split(E)
        else:
            ws = (ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight)
        bs = ref.in_proj_bias.split(E)
        if ours.fused_qkv:
            ours.qkv_proj.weight.copy_(torch.cat(ws))
            ours.qkv_proj.bias.copy_(torch.cat(bs))
        else:
            for proj, w, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), ws, bs):
                proj.weight.copy_(w)
                proj.bias.copy_(b)
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def pair(E=32, H=4, fused=False, kdim=None, vdim=None, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, batch_first=True, kdim=kdim, vdim=vdim)
    ours = MultiHeadAttention(E, H, fused_qkv=fused, kdim=kdim, vdim=vdim)
    copy_from_torch(ours, ref)
    return ours, ref


def grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


# ------------------------------------------------------------------ parity with nn.MultiheadAttention

@pytest.mark.parametrize("fused", [False, True])
def test_mha_self_attention_matches_torch_with_padding_and_attn_mask(fused):
    ours, ref = pair(fused=fused)
    B, T, E = 3, 7, 32
    x = torch.randn(B, T, E)
    real = padding_mask(torch.tensor([7, 5, 2]))                 # attnlab: True = real token
    allowed = torch.rand(T, T) > 0.3
    allowed |= torch.eye(T, dtype=torch.bool)
    out_ref, w_ref = ref(x, x, x, key_padding_mask=~real, attn_mask=~allowed, average_attn_weights=False)
    out, w = ours(x, x, x, allowed, key_padding_mask=real, return_weights=True)
    assert_close_scaled(out, out_ref, FP32, "output differs from nn.MultiheadAttention")
    assert_close_scaled(w, w_ref, FP32, "per-head weights differ")
    # averaged weights (torch's default) are the mean over heads
    _, w_avg = ref(x, x, x, key_padding_mask=~real, attn_mask=~allowed)
    assert_close_scaled(w.mean(1), w_avg, FP32)
    # gradients, fused path (no weights requested)
    out, _ = ours(x, x, x, allowed, key_padding_mask=real)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    ours_g, ref_g = grads(ours), grads(ref)
    ref_in = ref_g["in_proj_weight"]
    mine_in = ours_g["qkv_proj.weight"] if fused else torch.cat(
        [ours_g["q_proj.weight"], ours_g["k_proj.weight"], ours_g["v_proj.weight"]])
    assert_close_scaled(mine_in, ref_in, FP32, "in-projection gradient differs")
    assert_close_scaled(ours_g["out_proj.weight"], ref_g["out_proj.weight"], FP32)


def test_mha_cross_attention_matches_torch_with_float_mask():
    ours, ref = pair(kdim=24, vdim=20)
    B, T, S = 2, 5, 9
    q, k, v = torch.randn(B, T, 32), torch.randn(B, S, 24), torch.randn(B, S, 20)
    real = padding_mask(torch.tensor([9, 4]))
    additive = torch.randn(T, S)                                    # a float mask is added to the scores
    out_ref, w_ref = ref(q, k, v, key_padding_mask=~real, attn_mask=additive)
    out, w = ours(q, k, v, additive, key_padding_mask=real, return_weights=True)
    assert_close_scaled(out, out_ref, FP32)
    assert_close_scaled(w.mean(1), w_ref, FP32)


def test_fused_cross_attention_projects_memory_with_key_value_rows():
    """Fused cross-attention applies the query rows to the query and only the K/V rows to the memory."""
    ours, ref = pair(fused=True)
    q, mem = torch.randn(2, 4, 32), torch.randn(2, 6, 32)
    out_ref, _ = ref(q, mem, mem)
    out, _ = ours(q, mem, mem)
    assert_close_scaled(out, out_ref, FP32)


def test_padding_mask_polarity_is_true_for_real_tokens():
    ids = torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]])
    assert padding_mask(ids, pad_id=0).tolist() == [[True, True, False, False], [True, False, False, False]]
    assert padding_mask(torch.tensor([2, 1]), max_len=4).equal(padding_mask(ids, pad_id=0))
    # passing torch's polarity (True = ignore) to attnlab attends to padding only: a different result
    ours, ref = pair()
    x = torch.randn(2, 4, 32)
    real = padding_mask(ids, pad_id=0)
    good, _ = ours(x, key_padding_mask=real)
    wrong, _ = ours(x, key_padding_mask=~real)
    assert (good - wrong)[0, :2].abs().max() > 1e-3


# ------------------------------------------------------------------ the function

def test_sdpa_equals_torch_sdpa_and_formula():
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 6, 8), torch.randn(2, 3, 6, 4)
    mask = torch.rand(2, 1, 5, 6) > 0.2
    mask[..., 0] = True
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    exp, w = scaled_dot_product_attention(q, k, v, mask, return_weights=True)
    by_hand = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, -math.inf), -1) @ v
    for got in (out, exp, by_hand):
        assert_close_scaled(got, ref, FP32)
    assert_close_scaled(w.sum(-1), torch.ones(2, 3, 5), FP32)


def test_grouped_query_attention_equals_repeated_heads():
    q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    out, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), is_causal=True)
    assert_close_scaled(out, ref, FP32)


def test_generate_square_subsequent_mask_equals_torch():
    assert torch.equal(generate_square_subsequent_mask(6), nn.Transformer.generate_square_subsequent_mask(6))
    # it is additive: as a boolean "True = attend" mask it would mean the opposite
    assert torch.equal(generate_square_subsequent_mask(6) == 0, causal_mask(6))


def test_combine_masks():
    a = torch.tensor([[True, False, True]])
    b = torch.tensor([[True, True, False]])
    assert combine_masks(a, None, b).tolist() == [[True, False, False]]
    f = combine_masks(a, torch.tensor([[0.5, 0.0, 1.0]]))
    assert f.tolist() == [[0.5, -math.inf, 1.0]]
    assert combine_masks(None, None) is None


# ------------------------------------------------------------------ pitfall 2: empty rows

@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zeros_and_zero_grads(weights, kind):
    q = torch.randn(2, 2, 4, 8, requires_grad=True)
    k = torch.randn(2, 2, 5, 8, requires_grad=True)
    v = torch.randn(2, 2, 5, 8, requires_grad=True)
    allowed = torch.rand(2, 2, 4, 5) > 0.4
    allowed[..., 0] = True
    allowed[0, 1, 2] = False                                          # one query with no key
    mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)
    out, w = scaled_dot_product_attention(q, k, v, mask, return_weights=weights)
    out.square().sum().backward()
    assert torch.isfinite(out).all() and out[0, 1, 2].abs().max() == 0
    if weights:
        assert w[0, 1, 2].abs().max() == 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert q.grad[0, 1, 2].abs().max() == 0


def test_fully_masked_rows_in_module_are_zero():
    ours, _ = pair()
    x = torch.randn(2, 3, 32, requires_grad=True)
    none_real = torch.zeros(2, 3, dtype=torch.bool)
    none_real[1] = True
    out, w = ours(x, key_padding_mask=none_real, return_weights=True)
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    # row 0 has no real key: attention output is 0, so the module returns the out-projection bias
    assert_close_scaled(out[0], ours.out_proj.bias.expand_as(out[0]), FP32)


# ------------------------------------------------------------------ pitfall 3: causal with T != S

def test_causal_aligns_bottom_right_for_chunked_queries():
    q, k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    full, _ = scaled_dot_product_attention(q, k, v, is_causal=True)
    chunk, _ = scaled_dot_product_attention(q[:, :, 4:], k, v, is_causal=True)   # last 3 queries, all keys
    chunk_w, _ = scaled_dot_product_attention(q[:, :, 4:], k, v, is_causal=True, return_weights=True)
    assert_close_scaled(chunk, full[:, :, 4:], FP32)
    assert_close_scaled(chunk_w, full[:, :, 4:], FP32)
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_cached_decoding_equals_full_causal_forward():
    torch.manual_seed(1)
    m = MultiHeadAttention(32, 4, num_kv_heads=2, causal=True).eval()
    x = torch.randn(2, 9, 32)
    full, _ = m(x)
    cache = KVCache(capacity=2)                           # forces the buffer to grow
    steps = [m(x[:, :4], cache=cache)[0]]                 # chunked prefill of 4 tokens
    steps += [m(x[:, t:t + 1], cache=cache)[0] for t in range(4, 9)]
    assert_close_scaled(torch.cat(steps, 1), full, FP32)
    assert cache.length == 9


# ------------------------------------------------------------------ pitfall 4: half precision

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_masks_do_not_overflow(dtype):
    q, k, v = (torch.randn(2, 2, 6, 16) for _ in range(3))
    allowed = torch.rand(2, 1, 6, 6) > 0.5
    allowed[..., 0] = True
    q, k, v = (t.to(dtype) for t in (q, k, v))
    ref, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), allowed, return_weights=True)
    for weights in (True, False):
        out, _ = scaled_dot_product_attention(q, k, v, allowed, return_weights=weights)
        assert torch.isfinite(out).all()
        err = ((out.float() - ref).abs() / (ref.abs() + 1)).max()
        assert err < 0.02, f"half-precision result far from fp32 on the same inputs: {err} (2% relative)"
    floats = combine_masks(allowed, torch.zeros(6, 6, dtype=dtype))
    assert floats.dtype == dtype and torch.isinf(floats).any() and not torch.isnan(floats).any()


# ------------------------------------------------------------------ pitfall 5: weights opt-in

def test_default_path_never_computes_weights():
    m = MultiHeadAttention(32, 4)
    x = torch.randn(2, 5, 32)
    with mock.patch.object(attention_mod, "_explicit", side_effect=AssertionError("explicit path used")):
        out, w = m(x)
    assert w is None and out.shape == (2, 5, 32)
    _, w = m(x, return_weights=True)
    assert w.shape == (2, 4, 5, 5)


# ------------------------------------------------------------------ pitfall 6: padded == unpadded

@pytest.mark.parametrize("train", [False, True])
def test_padding_does_not_change_real_tokens(train):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, dropout=0.0).train(train)
    x = torch.randn(1, 5, 32)
    padded = torch.cat([x, torch.randn(1, 3, 32)], 1)
    real = padding_mask(torch.tensor([5]), max_len=8)
    alone, _ = m(x)
    with_pad, _ = m(padded, key_padding_mask=real)
    assert_close_scaled(with_pad[:, :5], alone, FP32)


# ------------------------------------------------------------------ property: explicit == fused

@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), H=st.sampled_from([1, 2, 4]), G_div=st.sampled_from([1, 2]),
       T=st.integers(1, 9), extra=st.integers(0, 5), D=st.sampled_from([4, 8, 16]),
       kind=st.sampled_from(["none", "bool", "float", "causal", "bool+causal"]),
       p_block=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_explicit_and_fused_paths_agree(B, H, G_div, T, extra, D, kind, p_block, seed):
    g = torch.Generator().manual_seed(seed)
    G = max(1, H // G_div)
    S = T + extra
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, G, S, D, generator=g)
    v = torch.randn(B, G, S, D, generator=g)
    allowed = torch.rand(B, 1, T, S, generator=g) >= p_block          # may block whole rows
    mask = {"none": None, "causal": None, "bool": allowed, "bool+causal": allowed,
            "float": torch.randn(B, 1, T, S, generator=g).masked_fill(~allowed, -math.inf)}[kind]
    causal = "causal" in kind
    fused, none = scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    explicit, w = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=True)
    assert none is None and torch.isfinite(fused).all() and torch.isfinite(w).all()
    assert_close_scaled(fused, explicit, FP32)


# ------------------------------------------------------------------ bad input

def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="not divisible"):
        MultiHeadAttention(30, 4)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiHeadAttention(32, 4, num_kv_heads=3)
    m = MultiHeadAttention(32, 4)
    with pytest.raises(ValueError, match="width"):
        m(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match="batch-first"):
        m(torch.randn(5, 32))
    with pytest.raises(ValueError, match="dtypes"):
        m(torch.randn(2, 5, 32), torch.randn(2, 5, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="mismatch"):
        m(torch.randn(2, 5, 32), torch.randn(3, 5, 32))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 32), key_padding_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key_padding_mask"):
        m(torch.randn(2, 5, 32), key_padding_mask=torch.ones(2, 5))
    q = torch.randn(2, 2, 5, 8)
    with pytest.raises(ValueError, match="does not broadcast"):
        scaled_dot_product_attention(q, q, q, torch.ones(2, 2, 5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool"):
        scaled_dot_product_attention(q, q, q, torch.ones(5, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        scaled_dot_product_attention(q, q.double(), q)
    with pytest.raises(ValueError, match="head dim"):
        scaled_dot_product_attention(q, torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    with pytest.raises(ValueError, match="multiple"):
        scaled_dot_product_attention(torch.randn(1, 3, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))
