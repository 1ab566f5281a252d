"""The named places where today's decoder families differ, each against the formula written out
in plain torch: logit soft-capping, a sliding window and chunks, QK-norm per head and over all
heads, an explicit score scale, the (1 + w) RMSNorm, and norms on each sublayer's output."""
import pytest
import torch
from torch import nn

from attnlab.nn import CausalLayer, JointHeadsRMSNorm, MultiHeadAttention, RMSNorm, scaled_dot_product_attention
from attnlab.nn.cache import KVCache
from attnlab.nn.position import RotaryEmbedding
from _tolerance import FP32, FP32_OP, assert_close_scaled

B, T, E, H, G, D = 2, 11, 32, 4, 2, 8


def _reference(q, k, v, allowed, scale, softcap=None):
    """softmax(cap(q k^T scale) masked) v in float64, grouped heads repeated."""
    q, k, v = q.double(), k.double().repeat_interleave(q.size(1) // k.size(1), 1), \
        v.double().repeat_interleave(q.size(1) // v.size(1), 1)
    s = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed, float("-inf"))
    return (s.softmax(-1) @ v).float()


def test_softcap_caps_the_scaled_scores_before_the_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) * 4 for _ in range(3))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for cap in (50.0, 2.0):
        got, w = scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, softcap=cap, return_weights=True)
        assert_close_scaled(got, _reference(q, k, v, causal, 0.3, cap), FP32_OP, f"softcap {cap}")
        fused, _ = scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, softcap=cap)
        assert torch.equal(fused, got), "without weights the capped path is the same computation"
    plain, _ = scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    assert not torch.allclose(plain, got, atol=1e-3), "a cap of 2 must change the output (the check can fail)"
    with pytest.raises(ValueError, match="softcap must be None or > 0"):
        scaled_dot_product_attention(q, k, v, softcap=0.0)


def _attn(**kw):
    torch.manual_seed(0)
    return MultiHeadAttention(E, H, num_kv_heads=G, causal=True, **kw).eval()


def _heads(attn, x):
    q, k, v = attn._project(x, x, x, None)
    return q, k, v


@pytest.mark.parametrize("local", [dict(window=4), dict(chunk=4), dict(window=5, chunk=4)])
def test_window_and_chunk_in_true_positions_with_left_padding(local):
    """Sequences longer than the window; a left-padded row attends as the same tokens unpadded."""
    attn = _attn(**local)
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)
    allowed = (pos[None] <= pos[:, None])
    if "window" in local:
        allowed &= pos[:, None] - pos[None] < local["window"]
    if "chunk" in local:
        allowed &= pos[:, None] // local["chunk"] == pos[None] // local["chunk"]
    with torch.no_grad():
        got, _ = attn(x)
        q, k, v = _heads(attn, x)
        want = attn.out_proj(_reference(q, k, v, allowed, D ** -0.5).transpose(1, 2).reshape(B, T, H * D))
        assert_close_scaled(got, want, FP32, f"{local} attention")
        pad = 3
        padded = torch.cat([torch.zeros(B, pad, E), x], 1)
        mask = torch.ones(B, T + pad, dtype=torch.bool)
        mask[:, :pad] = False
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        out, _ = attn(padded, key_padding_mask=mask, positions=positions, key_positions=positions)
        assert_close_scaled(out[:, pad:], got, FP32, f"{local} left-padded")
        cache = KVCache()
        steps = [attn(x[:, :3], cache=cache)[0]] + [attn(x[:, t:t + 1], cache=cache)[0] for t in range(3, T)]
        assert_close_scaled(torch.cat(steps, 1), got, FP32, f"{local} cached step by step")


def test_qk_norm_per_head_and_over_all_heads_before_rope():
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(2))
    rope = RotaryEmbedding(D)
    for q_norm, k_norm in ((RMSNorm(D), RMSNorm(D)), (JointHeadsRMSNorm(H * D), JointHeadsRMSNorm(G * D))):
        attn = _attn(position=rope, q_norm=q_norm, k_norm=k_norm, scale=0.7)
        with torch.no_grad():
            for n in (q_norm, k_norm):
                n.weight.normal_(1.0, 0.3)
            got, _ = attn(x)
            q, k, v = _heads(attn, x)
            if isinstance(q_norm, JointHeadsRMSNorm):       # the norm over the projection's whole width
                flat = RMSNorm(H * D)
                flat.weight.copy_(q_norm.weight)
                qn = flat(attn.q_proj(x)).view(B, T, H, D).transpose(1, 2)
                flat = RMSNorm(G * D)
                flat.weight.copy_(k_norm.weight)
                kn = flat(attn.k_proj(x)).view(B, T, G, D).transpose(1, 2)
            else:
                qn, kn = q_norm(q), k_norm(k)
            qn, kn = rope.transform(qn, kn, torch.arange(T))
            allowed = torch.ones(T, T, dtype=torch.bool).tril()
            want = attn.out_proj(_reference(qn, kn, v, allowed, 0.7).transpose(1, 2).reshape(B, T, H * D))
        assert_close_scaled(got, want, FP32, f"QK-norm {type(q_norm).__name__}")


def test_unit_offset_rmsnorm_computes_in_fp32():
    norm = RMSNorm(E, 1e-6, unit_offset=True)
    assert torch.equal(norm.weight, torch.zeros(E)), "(1 + w) starts at the identity gain"
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    x = torch.randn(3, E).to(torch.bfloat16)
    x32 = x.double()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight.double())).to(torch.bfloat16)
    assert torch.equal(norm(x), want), "bf16: normalised and scaled in fp32, rounded once"


def test_output_norms_wrap_each_sublayer():
    torch.manual_seed(3)
    layer = CausalLayer(E, H, 48, 0.0, norm_first=True, norm="rmsnorm", self_attn_out_norm=RMSNorm(E),
                        ff_out_norm=RMSNorm(E), ff_norm=nn.Identity()).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0, 0.2) if p.dim() == 1 else None
        x = torch.randn(B, T, E)
        h = x + layer.self_attn_out_norm(layer.self_attn(layer.self_attn_norm(x), is_causal=True)[0])
        want = h + layer.ff_out_norm(layer.ff(h))
        assert_close_scaled(layer(x), want, FP32_OP, "x + OutNorm(F(Norm(x)))")
    assert {"self_attn_out_norm.weight", "ff_out_norm.weight"} <= set(layer.state_dict())
    assert "ff_norm.weight" not in layer.state_dict()
    with pytest.raises(ValueError, match="output norms .* need norm_first=True"):
        CausalLayer(E, H, 48, norm_first=False, ff_out_norm=RMSNorm(E))
