"""Layers overwrite their own intermediates in inference (attnlab.nn.inplace): same bits, and
never a tensor that autograd, a hook or the caller can still see."""
import pytest
import torch
from torch import nn

from attnlab.nn import CausalLayer, DecoderLayer, EncoderLayer, FeedForward, GatedMLP, inplace
from attnlab.nn import block, mlp


@pytest.fixture
def spy(monkeypatch):
    """Every decision of may_overwrite, in the blocks and the MLPs; any size qualifies."""
    monkeypatch.setattr(inplace, "MIN_ELEMENTS", 0)
    calls = []

    def record(layer, t, *sources):
        calls.append(inplace.may_overwrite(layer, t, *sources))
        return calls[-1]
    monkeypatch.setattr(block, "may_overwrite", record)
    monkeypatch.setattr(mlp, "may_overwrite", record)
    return calls


LAYERS = [
    pytest.param(lambda: EncoderLayer(32, 4, 64, 0.1, activation="gelu"), id="encoder-post-gelu"),
    pytest.param(lambda: EncoderLayer(32, 4, 64, 0.1, norm_first=True, activation="relu"), id="encoder-pre-relu"),
    pytest.param(lambda: CausalLayer(32, 4, 64, 0.1, norm_first=True, activation="gelu_tanh",
                                     ff=GatedMLP(32, 64, activation="silu")), id="causal-gated"),
]


@pytest.mark.parametrize("make", LAYERS)
def test_inference_overwrites_and_gives_the_same_bits(make, spy):
    torch.manual_seed(0)
    layer = make().eval()
    x = torch.randn(2, 7, 32)
    x_before = x.clone()
    want = layer(x.clone().requires_grad_()).detach()     # autograd on: out of place
    assert spy and not any(spy)
    spy.clear()
    with torch.inference_mode():
        got = layer(x)
    assert spy and all(spy)                 # both residual sums and the activation were overwritten
    assert torch.equal(got, want)
    assert torch.equal(x, x_before)         # the layer's input is never touched
    spy.clear()
    with torch.no_grad():
        assert torch.equal(layer(x), want)
    assert all(spy)


def test_decoder_layer_overwrites_in_inference(spy):
    torch.manual_seed(0)
    layer = DecoderLayer(32, 4, 64, 0.0, activation="relu").eval()
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    want = layer(x.requires_grad_(), memory).detach()
    spy.clear()
    with torch.no_grad():
        got = layer(x.detach(), memory)
    assert len(spy) == 4 and all(spy)       # three residual sums and the activation
    assert torch.equal(got, want)


def test_training_gradients_unchanged(spy):
    """With autograd recording, nothing is overwritten: backward sees the values it saved."""
    torch.manual_seed(0)
    layer = EncoderLayer(32, 4, 64, 0.0, activation="gelu")
    x = torch.randn(2, 7, 32, requires_grad=True)
    layer(x).square().sum().backward()
    assert spy and not any(spy)
    g = x.grad.clone()
    x.grad = None
    spy.clear()
    with torch.no_grad():
        layer(x)                             # an inference call in between changes nothing
    layer(x).square().sum().backward()
    assert torch.equal(x.grad, g)


def test_a_hook_sees_the_value_it_was_given(spy):
    torch.manual_seed(0)
    layer = EncoderLayer(32, 4, 64, 0.0, activation="gelu").eval()
    x = torch.randn(2, 7, 32)
    seen = {}
    handle = layer.ff.linear1.register_forward_hook(lambda m, i, o: seen.setdefault("pre", o))
    with torch.no_grad():
        out = layer(x)
        h = layer.self_attn_norm(x + layer.self_attn(x)[0])
        pre = layer.ff.linear1(h)
    handle.remove()
    assert not any(spy)
    assert torch.equal(seen["pre"], pre)     # the pre-activation, not overwritten by the GELU
    spy.clear()
    with torch.no_grad():
        assert torch.equal(layer(x), out)
    assert all(spy)


def test_a_global_hook_turns_it_off(spy):
    layer = EncoderLayer(32, 4, 64, 0.0).eval()
    outputs = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: outputs.append(o))
    try:
        with torch.no_grad():
            layer(torch.randn(2, 7, 32))
    finally:
        handle.remove()
    assert spy and not any(spy)


class _Cached(nn.Module):
    """A user's feed-forward that returns a tensor it keeps: it must not be written into."""

    def __init__(self):
        super().__init__()
        self.kept = torch.ones(2, 7, 32)

    def forward(self, x):
        return self.kept


def test_a_plugged_in_module_output_is_not_overwritten(spy):
    layer = EncoderLayer(32, 4, 64, 0.0, ff=_Cached()).eval()
    with torch.no_grad():
        layer(torch.randn(2, 7, 32))
        layer(torch.randn(2, 7, 32))
    assert torch.equal(layer.ff.kept, torch.ones(2, 7, 32))
    assert spy == [True, False, True, False]  # the attention's sum overwritten, the plugged-in module's not


def test_small_tensors_stay_out_of_place():
    layer = FeedForward(32, 64).eval()
    h = torch.randn(3, 32)
    with torch.no_grad():
        assert not inplace.may_overwrite(layer, layer.linear1(h), layer.linear1)
        big = torch.randn(inplace.MIN_ELEMENTS)
        assert inplace.may_overwrite(layer, big, layer.linear1)
        assert not inplace.may_overwrite(layer, big, nn.Identity())


@pytest.mark.parametrize("act", [nn.ReLU(), nn.SiLU(), nn.GELU(), nn.GELU(approximate="tanh")])
def test_activate_in_place_matches_the_module(act):
    h = torch.randn(1000) * 4
    want = act(h)
    got = inplace.activate_in_place(act, h)
    assert got is h and torch.equal(got, want)
    assert inplace.activate_in_place(nn.Tanh(), h) is None
