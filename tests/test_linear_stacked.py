"""StackedLinear: attention's q/k/v and a gated MLP's gate/up computed as one product after
optimize_for_inference, with the parameters as views of the stacked weight (same objects, same
state dict), and the separate products wherever the stack cannot stand in."""
import torch
from torch import nn

from attnlab.nn import MultiHeadAttention, optimize_for_inference
from attnlab.nn.mlp import GatedMLP

from _tolerance import FP32, assert_close_scaled


def _pair(seed=0):
    torch.manual_seed(seed)
    plain = MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, bias=True, causal=True).eval()
    fast = MultiHeadAttention(32, 4, 0.0, num_kv_heads=2, bias=True, causal=True).eval()
    fast.load_state_dict(plain.state_dict())
    return plain, optimize_for_inference(fast)


def test_stacked_qkv_keeps_values_parameters_and_state_dict():
    plain, fast = _pair()
    stacked = fast.__dict__["_stacked_qkv"]
    assert fast.q_proj.weight.data_ptr() == stacked.linear.weight.data_ptr()
    assert list(fast.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 5, 32)
    calls = []
    stacked.linear.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    with torch.no_grad():
        assert_close_scaled(fast(x)[0], plain(x)[0], FP32)
    assert calls == [(2, 5, 64)], "one product of q (32) + k (16) + v (16) outputs"
    with torch.no_grad():                    # an in-place update of one parameter reaches the stack
        fast.k_proj.weight.mul_(2)
        plain.k_proj.weight.mul_(2)
        assert_close_scaled(fast(x)[0], plain(x)[0], FP32)


def test_stack_steps_aside_for_gradients_hooks_and_swapped_layers():
    plain, fast = _pair(1)
    stacked = fast.__dict__["_stacked_qkv"]
    calls = []
    stacked.linear.register_forward_hook(lambda m, i, o: calls.append(1))
    x = torch.randn(1, 3, 32)
    out = fast(x)[0]                          # gradients wanted: the three layers, so q/k/v get theirs
    out.sum().backward()
    assert fast.q_proj.weight.grad is not None and calls == []
    with torch.no_grad():
        h = fast.v_proj.register_forward_hook(lambda m, i, o: None)
        fast(x)
        h.remove()
        fast.q_proj = nn.Linear(32, 32)       # swapped (as LoRA or int8 would): the stack is not this layer's
        fast(x)
    assert calls == []
    assert not stacked.usable(x, fast.q_proj, fast.k_proj, fast.v_proj)


def test_gated_mlp_stacks_gate_and_up():
    torch.manual_seed(2)
    plain = GatedMLP(32, 48).eval()
    fast = GatedMLP(32, 48).eval()
    fast.load_state_dict(plain.state_dict())
    optimize_for_inference(fast)
    stacked = fast.__dict__["_stacked_gate_up"]
    assert stacked.sizes == [48, 48] and fast.up_proj.weight.data_ptr() == stacked.linear.weight.data_ptr() + 48 * 32 * 4
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert_close_scaled(fast(x), plain(x), FP32)
    fast.to(torch.float64)                    # moved: the parameters no longer view the stack
    assert not stacked.intact()
    with torch.no_grad():
        assert_close_scaled(fast(x.double()), plain.double()(x.double()), FP32)
