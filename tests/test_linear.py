"""attnlab.nn.linear: InferenceLinear equals nn.Linear (fp32, 1e-5 relative), takes the oneDNN path
only when no gradient is needed, and optimize_for_inference keeps a model's ties, state dict,
logits and greedy tokens."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab.nn.linear as linear_mod
from attnlab.models import GPT, GPTConfig, Llama, LlamaConfig
from attnlab.nn import InferenceLinear, optimize_for_inference
from attnlab.quantize import Int8Linear, quantize_int8
from _tolerance import FP32, FP32_OP, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

needs_onednn = pytest.mark.skipif(not linear_mod.onednn_available(), reason="this torch has no usable oneDNN linear")


def _pair(k, n, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    return lin, InferenceLinear.from_linear(lin)


@pytest.fixture
def spy(monkeypatch):
    """Records oneDNN calls; the size threshold is lifted so the tests' small layers qualify, and
    fp32 products take oneDNN whatever the CPU's vendor (where this torch has it), those of many
    rows as on a CPU without AVX-512."""
    monkeypatch.setattr(linear_mod, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", linear_mod.onednn_available())
    monkeypatch.setattr(linear_mod, "_AVX512", False)
    calls = []
    real = linear_mod._dnn_linear

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)
    monkeypatch.setattr(linear_mod, "_dnn_linear", counted)
    return calls


@needs_onednn
@pytest.mark.parametrize("shape", [(1, 768), (8, 96), (2, 5, 40), (64, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_linear_equals_nn_linear_without_grad(shape, bias, spy):
    lin, fast = _pair(shape[-1], 72, bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        ref, out = lin(x), fast(x)
    assert spy == [shape]                                  # the oneDNN path ran
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert_close_scaled(out, ref, FP32)


@needs_onednn
def test_many_rows_stay_on_the_gemm(spy):
    """Compute-bound products (more than MAX_FP32_ONEDNN_ROWS rows, e.g. an encoder's batch) run
    F.linear, which is as fast there; the result is the same either way."""
    lin, fast = _pair(64, 72)
    rows = linear_mod.MAX_FP32_ONEDNN_ROWS
    with torch.no_grad():
        few, many = torch.randn(rows, 64), torch.randn(2, rows, 64)
        assert_close_scaled(fast(few), lin(few), FP32)
        assert_close_scaled(fast(many), lin(many), FP32)
    assert spy == [(rows, 64)], "only the product of at most MAX_FP32_ONEDNN_ROWS rows takes oneDNN"


@needs_onednn
def test_many_rows_take_onednn_on_avx512_whatever_the_weights_size(spy, monkeypatch):
    """With AVX-512 MKL's GEMM is the slower one at compute-bound shapes too: every gradient-free
    fp32 product takes oneDNN, small weights included; the result is F.linear's."""
    monkeypatch.setattr(linear_mod, "MIN_WEIGHT_ELEMENTS", 1 << 30)
    monkeypatch.setattr(linear_mod, "_AVX512", True)
    lin, fast = _pair(64, 72)
    rows = linear_mod.MAX_FP32_ONEDNN_ROWS
    with torch.no_grad():
        few, many = torch.randn(rows, 64), torch.randn(2, rows, 64)
        assert_close_scaled(fast(few), lin(few), FP32)
        assert_close_scaled(fast(many), lin(many), FP32)
    assert spy == [(2, rows, 64)], "the small weight's few-row product stays on F.linear, the many-row one does not"
    x = torch.randn(2, rows, 64, requires_grad=True)
    fast(x).sum().backward()                               # a gradient wanted: oneDNN too (test_linear_training.py)
    assert spy == [(2, rows, 64), (2, rows, 64), (2, rows, 72)]


@needs_onednn
def test_autocast_bf16_uses_the_packed_weight_and_gives_autocasts_product(spy, monkeypatch):
    """Under CPU bf16 autocast a gradient-free call computes from the cached packed bf16 weight what
    autocast's F.linear computes from a fresh cast of it, and returns bf16 as autocast does; the
    oneDNN self-check run first inside autocast still passes."""
    monkeypatch.setattr(linear_mod, "_ONEDNN", None)
    lin, fast = _pair(96, 80)
    x = torch.randn(5, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear_mod.onednn_available()
        with torch.no_grad():
            want, got = lin(x), fast(x)
        # the packed oneDNN product runs where this CPU packs bf16 weights (native bf16: AVX512-BF16 or
        # AMX); elsewhere (AVX2) the cached plain bf16 weight goes through F.linear: same dtype, same values
        packed = linear_mod.packed_bf16_available()
        assert got.dtype == want.dtype == torch.bfloat16 and spy.count((5, 96)) == int(packed)   # besides probes
        assert_close_scaled(got.float(), want.float(), 1e-2)
        fast(x.requires_grad_()).float().sum().backward()   # training under autocast: autocast's own F.linear
    assert spy.count((5, 96)) == int(packed) and fast.weight.grad is not None
    cached = fast.__dict__["_low_precision_cache"]
    assert cached[1].dtype == torch.bfloat16 and cached[3] == packed


def test_shares_parameters_and_falls_back_when_a_gradient_is_needed(spy):
    lin, fast = _pair(40, 24)
    assert fast.weight is lin.weight and fast.bias is lin.bias
    x = torch.randn(3, 40, requires_grad=True)
    fast(x).square().sum().backward()                      # weights require grad: F.linear, autograd works
    gw, gx = lin.weight.grad.clone(), x.grad.clone()
    lin.weight.grad = None
    x.grad = None
    lin(x).square().sum().backward()
    assert spy == []
    torch.testing.assert_close(gw, lin.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)
    with torch.no_grad():                                  # other dtypes fall back too
        y = fast.to(torch.float64)(torch.randn(2, 40, dtype=torch.float64))
    assert y.dtype == torch.float64 and spy == []


def test_bad_input_width_is_named():
    _, fast = _pair(40, 24)
    with torch.no_grad(), pytest.raises(ValueError, match="last dim 39 != in_features 40"):
        fast(torch.randn(2, 39))
    with pytest.raises(TypeError, match="expected an nn.Linear"):
        InferenceLinear.from_linear(nn.Conv1d(3, 3, 1))


def test_small_weights_stay_on_f_linear_large_ones_do_not(monkeypatch):
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", linear_mod.onednn_available())
    calls = []
    real = linear_mod._dnn_linear
    monkeypatch.setattr(linear_mod, "_dnn_linear", lambda *a: calls.append(a[1].shape) or real(*a))
    small, big = _pair(256, 256)[1], _pair(512, 1024)[1]          # 65,536 and 524,288 elements
    with torch.no_grad():
        small(torch.randn(1, 256))
        y = big(torch.randn(2, 512))
    assert calls == ([(1024, 512)] if linear_mod.onednn_available() else [])
    assert y.shape == (2, 1024)


def test_disabled_onednn_gives_plain_linear(monkeypatch, spy):
    monkeypatch.setattr(linear_mod, "_ONEDNN", False)
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", None)
    lin, fast = _pair(40, 24)
    x = torch.randn(3, 40)
    with torch.no_grad():
        assert torch.equal(fast(x), lin(x))
    assert spy == []


@pytest.mark.parametrize("vendor, forced, want", [
    ("AuthenticAMD", "", True), ("GenuineIntel", "", False), ("", "", False),
    ("GenuineIntel", "onednn", True), ("AuthenticAMD", "mkl", False),
])
def test_fp32_products_take_onednn_off_intel_or_when_forced(monkeypatch, vendor, forced, want):
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", None)
    monkeypatch.setattr(linear_mod, "_cpu_vendor", lambda: vendor)
    monkeypatch.setenv("ATTNLAB_FP32_LINEAR", forced)
    assert linear_mod.fp32_onednn() is (want and linear_mod.onednn_available())
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", None)
    monkeypatch.setenv("ATTNLAB_FP32_LINEAR", "blas")
    with pytest.raises(ValueError, match="ATTNLAB_FP32_LINEAR must be"):
        linear_mod.fp32_onednn()


@pytest.mark.parametrize("make", [
    lambda: GPT(GPTConfig(vocab_size=97, n_positions=64, d_model=64, num_heads=4, num_layers=2, dropout=0.0)),
    lambda: Llama(LlamaConfig(vocab_size=97, max_position_embeddings=64, d_model=64, num_heads=4, num_kv_heads=2,
                              num_layers=2, d_ff=128, tie_word_embeddings=False)),
])
def test_optimize_for_inference_keeps_ties_state_dict_logits_and_greedy_tokens(make):
    torch.manual_seed(0)
    model = make().eval()
    keys = list(model.state_dict())
    x = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        ref_logits = model(x)
    ref_tokens = model.generate(x, 16)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert optimize_for_inference(model) is model
    assert sum(type(m) is nn.Linear for m in model.modules()) == 0
    assert sum(isinstance(m, InferenceLinear) for m in model.modules()) == n_linear
    assert list(model.state_dict()) == keys
    if isinstance(model, GPT):
        assert model.lm_head.weight is model.token_embedding.weight
    with torch.no_grad():
        assert_close_scaled(model(x), ref_logits, FP32)
    assert torch.equal(model.generate(x, 16), ref_tokens)
    optimize_for_inference(model)                          # idempotent
    assert sum(isinstance(m, InferenceLinear) for m in model.modules()) == n_linear
    q = quantize_int8(model)                               # quantisation still sees every Linear
    assert not any(isinstance(m, nn.Linear) for m in q.modules())
    assert any(isinstance(m, Int8Linear) for m in q.modules())


def test_an_optimised_model_still_trains():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_positions=32, d_model=32, num_heads=2, num_layers=1, dropout=0.0))
    twin = GPT(GPTConfig(vocab_size=50, n_positions=32, d_model=32, num_heads=2, num_layers=1, dropout=0.0))
    twin.load_state_dict(model.state_dict())
    optimize_for_inference(model)
    x = torch.randint(0, 50, (2, 10))
    for m in (model, twin):
        F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close_scaled(p.grad, q.grad, FP32_OP, name)
