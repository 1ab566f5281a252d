"""attnlab.nn.linear: activations fused into oneDNN's product (post_op, forward_activated,
fused_activation, as FeedForward and GatedMLP call them) give act(F.linear(...)) (fp32: 1e-5
relative to scale; bf16 routes: within bf16's rounding, 1e-2), only on routes that take oneDNN
and never past a forward hook; narrow compute-bound fp32 products (at most
MAX_NARROW_ONEDNN_FEATURES inputs) take oneDNN on any AVX-512 CPU, wider ones stay on MKL."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab.nn.linear as linear_mod
from attnlab.nn import FeedForward, GatedMLP, InferenceLinear, optimize_for_inference, set_inference_dtype
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

needs_onednn = pytest.mark.skipif(not linear_mod.onednn_available(), reason="this torch has no usable oneDNN linear")
ACTS = {"relu": nn.ReLU, "silu": nn.SiLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


@pytest.fixture
def spy(monkeypatch):
    """Records each oneDNN call as (input shape, post-op); small weights qualify, fp32 products of
    few rows take oneDNN, those of many rows MKL (as on an Intel CPU without AVX-512)."""
    monkeypatch.setattr(linear_mod, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", linear_mod.onednn_available())
    monkeypatch.setattr(linear_mod, "_AVX512", False)
    calls = []
    real = linear_mod._dnn_linear

    def counted(x, w, b, post=None):
        calls.append((tuple(x.shape), post))
        return real(x, w, b, post)
    monkeypatch.setattr(linear_mod, "_dnn_linear", counted)
    return calls


def _layer(k=48, n=72, seed=0):
    torch.manual_seed(seed)
    return InferenceLinear(k, n)


@pytest.mark.parametrize("name, want", [("relu", ("relu", "")), ("silu", ("swish", "")), ("gelu", ("gelu", "none")),
                                        ("gelu_tanh", ("gelu", "tanh"))])
def test_post_op_names_the_activations_onednn_fuses(name, want):
    assert linear_mod.post_op(ACTS[name]()) == want


@pytest.mark.parametrize("act", [nn.Tanh(), nn.Identity(), type("MyGELU", (nn.GELU,), {})()])
def test_other_activations_have_no_post_op(act):
    """A user's subclass of GELU may compute something else: only the exact classes fuse."""
    assert linear_mod.post_op(act) is None


@needs_onednn
@pytest.mark.parametrize("name", list(ACTS))
def test_fp32_fused_activation_equals_the_two_calls(name, spy):
    fast, act = _layer(), ACTS[name]()
    x = torch.randn(5, 48)
    with torch.no_grad():
        got, want = fast.forward_activated(x, act), act(F.linear(x, fast.weight, fast.bias))
    assert spy == [((5, 48), linear_mod.post_op(act))], "one oneDNN call with the activation fused"
    assert_close_scaled(got, want, FP32)


@needs_onednn
@pytest.mark.parametrize("route", ["bf16 weight copy", "bf16 autocast"])
def test_bf16_routes_fuse_the_activation_into_the_packed_product(route, spy):
    """With packed bf16 weights (where this CPU packs them) the activation runs on the fp32
    accumulators before the one rounding to bf16: within bf16's rounding of the two calls."""
    fast, act = _layer(), nn.GELU()
    x = torch.randn(5, 48)
    if route == "bf16 weight copy":
        set_inference_dtype(fast, torch.bfloat16, min_elements=0)
    packed = fast._low_precision_weights(torch.bfloat16)[2]
    spy.clear()                                            # the packing's own probe
    ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=route == "bf16 autocast")
    with torch.no_grad(), ctx:
        got, want = fast.forward_activated(x, act), act(fast(x))
    if not packed:
        assert got is None, "an unpacked bf16 weight runs F.linear, which fuses nothing"
        return
    assert got.dtype == want.dtype == (torch.bfloat16 if route == "bf16 autocast" else torch.float32)
    assert spy[0] == ((5, 48), ("gelu", "none"))
    exact = F.gelu(F.linear(x, fast.weight, fast.bias))
    assert_close_scaled(got.float(), exact, 1e-2)
    assert_close_scaled(got.float(), want.float(), 1e-2)


@needs_onednn
def test_no_fusion_off_onednns_routes(spy, monkeypatch):
    """None (the caller runs the two calls) where the product would not take oneDNN: a gradient
    wanted, an activation without a post-op, an empty input, a wide compute-bound product on MKL."""
    fast = _layer()
    x = torch.randn(5, 48)
    assert fast.forward_activated(x.requires_grad_(), nn.GELU()) is None
    with torch.no_grad():
        assert fast.forward_activated(x, nn.Tanh()) is None
        assert fast.forward_activated(torch.randn(0, 48), nn.GELU()) is None
        assert fast.forward_activated(torch.randn(3 * linear_mod.MAX_FP32_ONEDNN_ROWS, 48), nn.GELU()) is None
    assert spy == []


@needs_onednn
@pytest.mark.parametrize("kind", ["feedforward", "gated"])
def test_feedforward_and_gated_mlp_fuse_their_activation_and_keep_their_values(kind, spy):
    torch.manual_seed(0)
    plain = FeedForward(48, 96, activation="gelu") if kind == "feedforward" else GatedMLP(48, 96)
    fast = optimize_for_inference(type(plain)(48, 96, **({"activation": "gelu"} if kind == "feedforward" else {})))
    fast.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 48)
    if kind == "gated":
        # optimize_for_inference stacked gate and up into one product (StackedLinear), which the
        # activation cannot ride on (it applies to half of the outputs): two products in all
        with torch.no_grad():
            got, want = fast(x), plain(x)
        assert_close_scaled(got, want, FP32)
        assert spy == [((2, 3, 48), None), ((2, 3, 96), None)]
        spy.clear()
        fast.__dict__.pop("_stacked_gate_up")         # unstacked: gate's product carries the activation
    with torch.no_grad():
        got, want = fast(x), plain(x)
    assert_close_scaled(got, want, FP32)
    assert spy[0] == ((2, 3, 48), linear_mod.post_op(fast.act)), "the first product carries the activation"
    spy.clear()
    seen = []
    fast.act.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        assert_close_scaled(fast(x), want, FP32)
    assert seen == [(2, 3, 96)], "a hook on the activation is called, with its input unfused"
    assert all(post is None for _, post in spy)


@needs_onednn
@pytest.mark.parametrize("where", ["linear pre-hook", "activation pre-hook", "global pre-hook", "global hook"])
def test_any_hook_that_fusion_would_skip_keeps_the_two_calls(where, spy):
    """Fused, neither the first Linear nor the activation module is called: a pre-hook on either,
    or a global hook of either kind, must see its call, so the feed-forward then runs unfused."""
    torch.manual_seed(0)
    ff = optimize_for_inference(FeedForward(48, 96, activation="gelu"))
    seen = []
    pre = lambda m, args: seen.append(type(m).__name__)      # noqa: E731
    post = lambda m, args, out: seen.append(type(m).__name__)  # noqa: E731
    handle = {"linear pre-hook": lambda: ff.linear1.register_forward_pre_hook(pre),
              "activation pre-hook": lambda: ff.act.register_forward_pre_hook(pre),
              "global pre-hook": lambda: nn.modules.module.register_module_forward_pre_hook(pre),
              "global hook": lambda: nn.modules.module.register_module_forward_hook(post)}[where]()
    try:
        with torch.no_grad():
            ff(torch.randn(2, 3, 48))
    finally:
        handle.remove()
    assert {"linear pre-hook": "InferenceLinear", "activation pre-hook": "GELU"}.get(where, "GELU") in seen
    assert spy and all(post_op is None for _, post_op in spy), "no fused call"


@needs_onednn
@pytest.mark.parametrize("in_features, avx512, want", [(96, True, True), (192, True, True), (384, True, False),
                                                       (96, False, False)])
def test_narrow_compute_bound_products_take_onednn_on_any_avx512_cpu(in_features, avx512, want, spy, monkeypatch):
    """On an Intel CPU (fp32_onednn off) a gradient-free product of many rows runs MKL unless its
    input is at most MAX_NARROW_ONEDNN_FEATURES wide and the CPU has AVX-512; same values."""
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", False)
    monkeypatch.setattr(linear_mod, "_AVX512", avx512)
    assert in_features <= linear_mod.MAX_NARROW_ONEDNN_FEATURES or not want
    fast = _layer(in_features, 64)
    x = torch.randn(3, linear_mod.MAX_FP32_ONEDNN_ROWS, in_features)
    with torch.no_grad():
        assert_close_scaled(fast(x), F.linear(x, fast.weight, fast.bias), FP32)
        assert_close_scaled(fast(x[0, :4]), F.linear(x[0, :4], fast.weight, fast.bias), FP32)   # few rows: MKL on Intel
    assert spy == ([(tuple(x.shape), None)] if want else [])
    assert linear_mod.narrow_onednn(in_features) is want
