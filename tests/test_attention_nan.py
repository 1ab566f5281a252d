"""A NaN query or scale gives NaN on both attention paths (torch's fused CPU kernel alone
returns zeros for it, which would hide a divergence from a guard that checks the output)."""
import math

import pytest
import torch

from attnlab.nn.attention import scaled_dot_product_attention


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_a_nan_query_row_is_nan_on_both_paths_and_only_there(bad, causal, with_mask):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g) for _ in range(3))
    q[1, 0, 3, 2] = bad
    mask = torch.ones(5, 5, dtype=torch.bool) if with_mask else None
    fused, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    explicit, _ = scaled_dot_product_attention(q, k, v, mask, is_causal=causal, return_weights=True)
    expected = torch.zeros(2, 2, 5, dtype=torch.bool)
    expected[1, 0, 3] = True
    assert torch.equal(explicit.isnan().any(-1), expected)
    assert torch.equal(fused.isnan().any(-1), expected)
    ok = ~expected
    torch.testing.assert_close(fused[ok], explicit[ok], rtol=1e-5, atol=1e-6)


def test_a_nan_scale_is_nan_on_both_paths():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    for weights in (False, True):
        out, _ = scaled_dot_product_attention(q, k, v, scale=math.nan, return_weights=weights)
        assert out.isnan().all(), weights


def test_an_empty_row_stays_zero_even_with_a_nan_query():
    q, k, v = (torch.randn(1, 1, 3, 4) for _ in range(3))
    q[0, 0, 0] = float("nan")
    mask = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])
    for weights in (False, True):
        out, _ = scaled_dot_product_attention(q, k, v, mask, return_weights=weights)
        assert torch.equal(out[0, 0, 0], torch.zeros(4)) and not out[0, 0, 1:].isnan().any()
