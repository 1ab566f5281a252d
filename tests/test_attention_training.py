"""Attention on the CPU where autograd will differentiate it. bf16: the fused kernel runs on fp32
copies of q, k, v (and of a float mask) and returns bf16, under autocast too; its gradients are
those of that fp32 computation; without a gradient the bf16 kernel runs as before. A learned float
mask (a relative position bias): the explicit path, equal to torch's SDPA in values and gradients."""
import pytest
import torch
import torch.nn.functional as F

import attnlab.nn.attention as attention_mod
from attnlab.nn import MultiHeadAttention
from attnlab.nn.attention import scaled_dot_product_attention
from _tolerance import assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)


def _qkv(shape=(3, 2, 49, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3)]


def _fp32_reference(q, k, v, mask=None, **kw):
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, **kw)
    return out, leaves


@pytest.mark.parametrize("masked", [False, True])
def test_bf16_with_grad_computes_in_fp32(masked):
    q, k, v = _qkv()
    mask = None
    if masked:                                       # a Swin-like float mask: a bias and blocked keys
        g = torch.Generator().manual_seed(1)
        mask = torch.randn(1, 2, 49, 49, generator=g).masked_fill(torch.rand(49, 49, generator=g) < 0.3, float("-inf"))
        mask.diagonal(dim1=-2, dim2=-1).fill_(0.0)   # no empty row
    out, _ = scaled_dot_product_attention(q, k, v, mask)
    want, leaves = _fp32_reference(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16)), "the fp32 kernel's output, rounded once to bf16"
    bf16_kernel = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                 attn_mask=None if mask is None else mask.to(torch.bfloat16))
    assert not torch.equal(out, bf16_kernel), "the test must tell the two kernels apart"
    g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out.backward(g_out)
    want.backward(g_out.float())
    for t, ref in zip((q, k, v), leaves):
        assert t.grad.dtype == torch.bfloat16
        assert torch.equal(t.grad, ref.grad.to(torch.bfloat16))


def test_without_grad_the_bf16_kernel_runs():
    q, k, v = _qkv()
    with torch.no_grad():
        out, _ = scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach()))


def test_under_autocast_a_module_trains_in_fp32_attention(monkeypatch):
    """MultiHeadAttention under CPU bf16 autocast: the projections are bf16 (autocast's), the
    attention core is the fp32 kernel on them (autocast would otherwise cast it back to bf16)."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 4, fused_qkv=True)
    x = torch.randn(2, 20, 32)
    seen = {}
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen["dtype"] = q.dtype
        return real(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = mha(x)
    assert seen["dtype"] == torch.float32 and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert mha.qkv_proj.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_learned_mask_takes_the_explicit_path_with_the_same_values_and_gradients(dtype, monkeypatch):
    """A float mask that autograd differentiates (a relative position bias, plus blocked keys):
    torch's SDPA would run its slow math fallback; the explicit path gives the same output and
    gradients (fp32: 1e-5 of their scale; bf16: within bf16's rounding, 2 %), the bias's included."""
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(6, 3, 49, 16, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    bias = torch.randn(1, 3, 49, 49, generator=g).requires_grad_()
    blocked = torch.rand(6, 1, 49, 49, generator=g) < 0.3
    blocked.diagonal(dim1=-2, dim2=-1).fill_(False)
    go = torch.randn(6, 3, 49, 16, generator=g).to(dtype)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
    want = F.scaled_dot_product_attention(*ref_leaves[:3], attn_mask=(ref_leaves[3].masked_fill(blocked, float("-inf"))
                                                                      .to(dtype)))
    want.backward(go)
    explicit = []
    real = attention_mod._explicit
    monkeypatch.setattr(attention_mod, "_explicit", lambda *a: explicit.append(1) or real(*a))
    out, weights = scaled_dot_product_attention(q, k, v, bias.masked_fill(blocked, float("-inf")))
    assert explicit and weights is None and out.dtype == dtype
    out.backward(go)
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_scaled(out.float(), want.float(), rtol)
    for t, ref in zip((q, k, v, bias), ref_leaves):
        assert_close_scaled(t.grad.float(), ref.grad.float(), rtol)
    with torch.no_grad():                                  # no gradient: the fused kernel
        scaled_dot_product_attention(q, k, v, bias.masked_fill(blocked, float("-inf")))
    assert len(explicit) == 1
