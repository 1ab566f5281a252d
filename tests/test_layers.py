"""The three layers of attnlab.nn.block: one constructor, hidden states out, readable keys."""
import inspect

import pytest
import torch

from attnlab.nn import CausalLayer, DecoderLayer, EncoderLayer, KVCache, causal_mask
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path under pytest)

E, H, F = 32, 4, 64


def test_causal_layer_takes_its_siblings_arguments():
    enc = inspect.signature(EncoderLayer.__init__).parameters
    causal = inspect.signature(CausalLayer.__init__).parameters
    assert list(causal) == list(enc)
    assert [p.default for p in causal.values()] == [p.default for p in enc.values()]
    assert not issubclass(CausalLayer, EncoderLayer)


@pytest.mark.parametrize("layer", [EncoderLayer, CausalLayer])
def test_dyt_alpha_reaches_both_norms_of_a_layer(layer):
    block = layer(E, H, F, 0.0, norm="dyt", dyt_alpha=0.25)
    assert [block.self_attn_norm.alpha.item(), block.ff_norm.alpha.item()] == [0.25, 0.25]


def test_state_dict_names():
    assert set(EncoderLayer(E, H, F).state_dict()) == set(CausalLayer(E, H, F).state_dict())
    keys = {k.rsplit(".", 1)[0] for k in DecoderLayer(E, H, F).state_dict() if "norm" in k}
    assert keys == {"self_attn_norm", "cross_attn_norm", "ff_norm"}


@pytest.mark.parametrize("norm_first", [False, True])
def test_causal_layer_equals_encoder_layer_with_a_causal_mask(norm_first):
    torch.manual_seed(0)
    enc = EncoderLayer(E, H, F, 0.0, norm_first=norm_first).eval()
    causal = CausalLayer(E, H, F, 0.0, norm_first=norm_first).eval()
    causal.load_state_dict(enc.state_dict())
    x = torch.randn(2, 7, E)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, :2] = False
    with torch.no_grad():
        want = enc(x, causal_mask(7), real)
        got = causal(x, real)
        cache = KVCache()
        steps = torch.cat([causal(x[:, :3], real[:, :3], cache=cache)]
                          + [causal(x[:, t:t + 1], real[:, :t + 1], cache=cache) for t in range(3, 7)], 1)
    assert isinstance(got, torch.Tensor) and got.shape == x.shape
    assert_close_scaled(got[real], want[real], FP32, "CausalLayer vs EncoderLayer with a causal mask")
    assert_close_scaled(steps[real], want[real], FP32, "cached steps vs EncoderLayer")


def test_every_layer_returns_hidden_states_only():
    x, memory = torch.randn(2, 5, E), torch.randn(2, 6, E)
    assert isinstance(EncoderLayer(E, H, F)(x), torch.Tensor)
    assert isinstance(DecoderLayer(E, H, F)(x, memory), torch.Tensor)
    assert isinstance(CausalLayer(E, H, F)(x), torch.Tensor)
