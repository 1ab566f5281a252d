"""attnlab.nn.linear in training: on an AVX-512 CPU off Intel (compute_bound_onednn), an
InferenceLinear's fp32 products of many rows that autograd will differentiate run oneDNN for the
forward and the input's gradient; values and every gradient equal F.linear's under autograd
(fp32, 1e-5 relative), second derivatives included. Few rows, autocast and CPUs without the
fast route keep F.linear."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import attnlab.nn.linear as linear_mod
from attnlab.nn import InferenceLinear
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

needs_onednn = pytest.mark.skipif(not linear_mod.onednn_available(), reason="this torch has no usable oneDNN linear")
ROWS = linear_mod.MAX_FP32_ONEDNN_ROWS


@pytest.fixture
def spy(monkeypatch):
    """Records oneDNN calls (the input's shape), with the fast route on as on an AVX-512 AMD CPU."""
    monkeypatch.setattr(linear_mod, "_FP32_ONEDNN", linear_mod.onednn_available())
    monkeypatch.setattr(linear_mod, "_AVX512", True)
    calls = []
    real = linear_mod._dnn_linear

    def counted(*args):
        calls.append(tuple(args[0].shape))
        return real(*args)
    monkeypatch.setattr(linear_mod, "_dnn_linear", counted)
    return calls


def _pair(k, n, bias, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    twin = nn.Linear(k, n, bias=bias)
    twin.load_state_dict(lin.state_dict())
    return twin, InferenceLinear.from_linear(lin)


def _grads(out, inputs, g):
    return torch.autograd.grad(out, [t for t in inputs if t is not None and t.requires_grad], g)


@needs_onednn
@pytest.mark.parametrize("shape", [(2, ROWS, 48), (3 * ROWS, 48)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("wanted", ["all", "input only", "weights only"])
def test_training_products_take_onednn_and_give_autograds_gradients(shape, bias, wanted, spy):
    plain, fast = _pair(48, 80, bias)
    for m in (plain, fast):
        m.requires_grad_(wanted != "input only")
    x = torch.randn(*shape, requires_grad=wanted != "weights only")
    out, want = fast(x), plain(x)
    assert spy == [shape], "the forward ran oneDNN"
    assert_close_scaled(out, want, FP32)
    g = torch.randn_like(want)
    got = _grads(out, (x, fast.weight, fast.bias), g)
    ref = _grads(want, (x, plain.weight, plain.bias), g)
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref):
        assert a.shape == b.shape
        assert_close_scaled(a, b, FP32)
    assert spy == [shape] + ([(*shape[:-1], 80)] if x.requires_grad else []), \
        "the input's gradient ran oneDNN, and only when the input wants one"


@needs_onednn
def test_a_training_step_equals_plain_linears(spy):
    """Two layers with a non-contiguous input, backward through both and into the parameters of
    each, as a model's step does; then an optimizer step keeps them equal."""
    (p1, f1), (p2, f2) = _pair(32, 64, True), _pair(64, 16, True, seed=1)
    x = torch.randn(ROWS * 2, 3, 32).transpose(0, 1)                     # (3, 128, 32), strided
    outs = [l2(torch.tanh(l1(x))) for l1, l2 in ((f1, f2), (p1, p2))]
    assert len(spy) == 2
    for o in outs:
        o.square().mean().backward()
    for fast, plain in ((f1, p1), (f2, p2)):
        for a, b in zip(fast.parameters(), plain.parameters()):
            assert_close_scaled(a.grad, b.grad, FP32)


@needs_onednn
def test_second_derivatives_exist_and_equal_autograds(spy):
    plain, fast = _pair(24, 40, True)
    x = torch.randn(2 * ROWS, 24, requires_grad=True)
    got, want = [torch.autograd.grad(m(x).tanh().sum(), x, create_graph=True)[0] for m in (fast, plain)]
    assert_close_scaled(got, want, FP32)
    assert_close_scaled(torch.autograd.grad(got.square().sum(), fast.weight)[0],
                        torch.autograd.grad(want.square().sum(), plain.weight)[0], FP32)


@needs_onednn
def test_few_rows_autocast_and_other_cpus_keep_f_linear(spy, monkeypatch):
    plain, fast = _pair(48, 80, True)
    few = torch.randn(ROWS, 48, requires_grad=True)
    fast(few).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        x = torch.randn(2 * ROWS, 48, requires_grad=True)
        out = fast(x)
        assert out.dtype == torch.bfloat16                              # autocast's own bf16 product
        assert torch.equal(out, plain(x))
    monkeypatch.setattr(linear_mod, "_AVX512", False)
    fast(x).sum().backward()
    assert spy == []
