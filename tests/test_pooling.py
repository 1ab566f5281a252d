"""attnlab.nn.pooling: mean, cls and attention pooling ignore padding; a row without a real token
pools to zeros; gradients never reach the padding."""
import pytest
import torch

from attnlab.nn.pooling import POOLINGS, Pooling, attention_pool, mean_pool
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 8, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    return x, mask


@pytest.mark.parametrize("kind", POOLINGS)
def test_padding_changes_nothing(kind):
    """Each row pooled alone (no padding) equals the row pooled in the padded batch, whatever the
    padding holds; more padding changes nothing either."""
    torch.manual_seed(0)
    pool = Pooling(kind, 8)
    x, mask = _batch()
    x_noisy = torch.where(mask[..., None], x, torch.randn_like(x) * 100)     # garbage in the padding
    padded = pool(x_noisy, mask)
    for b in range(3):
        n = int(mask[b].sum())
        alone = pool(x[b:b + 1, :n], None)
        assert_close_scaled(padded[b], alone[0], FP32_OP, f"{kind} row {b}")
    longer = torch.cat([x_noisy, torch.randn(3, 4, 8)], 1)
    longer_mask = torch.cat([mask, torch.zeros(3, 4, dtype=torch.bool)], 1)
    assert_close_scaled(pool(longer, longer_mask), padded, FP32_OP, f"{kind} with more padding")


def test_mean_is_the_mean_of_the_real_tokens():
    x, mask = _batch()
    got = mean_pool(x, mask)
    assert torch.allclose(got[1], x[1, :3].mean(0)) and torch.allclose(got[2], x[2, 0])
    # the chapter's x.mean(dim=1) averages the padding too: different, which is why it is wrong
    assert not torch.allclose(x.mean(1)[1], got[1])


def test_attention_weights_follow_the_query():
    """A query aligned with one token's vector puts (almost) all weight on it."""
    x = torch.zeros(1, 3, 4)
    x[0, 0, 0], x[0, 1, 1], x[0, 2, 2] = 1.0, 1.0, 1.0
    q = torch.tensor([0.0, 200.0, 0.0, 0.0])
    assert torch.allclose(attention_pool(x, q), x[:, 1], atol=1e-6)
    mask = torch.tensor([[True, False, True]])                  # that token is padding: it gets nothing
    out = attention_pool(x, q, mask)
    assert torch.allclose(out, (x[:, 0] + x[:, 2]) / 2, atol=1e-6)


@pytest.mark.parametrize("kind", POOLINGS)
def test_a_row_of_padding_only_gives_zeros_and_no_nan(kind):
    pool = Pooling(kind, 8)
    x = torch.randn(2, 4, 8, requires_grad=True)
    mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
    out = pool(x, mask)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(8))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[0, 2:], torch.zeros(2, 8)) and torch.equal(x.grad[1], torch.zeros(4, 8))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kind must be one of mean, cls, attention"):
        Pooling("max", 8)
    with pytest.raises(ValueError, match="needs d_model"):
        Pooling("attention")
    with pytest.raises(ValueError, match="mask must be bool"):
        mean_pool(torch.zeros(2, 3, 4), torch.ones(2, 3))
    assert not list(Pooling("mean").parameters()) and len(list(Pooling("attention", 4).parameters())) == 1
