"""Mamba-2's SSD (attnlab.nn.ssd): the chunked algorithm equals the sequential reference, forward
and gradients, for random shapes, groups, chunk lengths and sequence lengths that the chunks do
not divide; the one-step update equals the full scan; the reference is the recurrence written
out by hand for a tiny case, and the matrix form of the module docstring; the state is fp32; the
backward keeps one state per chunk, not one per position."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnlab.nn.ssd import ssd_reference, ssd_scan, ssd_step
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)


def _inputs(b, l, h, p, g, n, seed, grad=True, h0=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, h, p, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(b, l, h, generator=gen))       # steps up to a few units
    A = -torch.exp(torch.randn(h, generator=gen))
    B, C = torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    D = torch.randn(h, generator=gen)
    state = torch.randn(b, h, p, n, generator=gen) if h0 else None
    return [t.requires_grad_(grad) if t is not None else None for t in (x, dt, A, B, C, D, state)]


def _grads(out, ins, seed):
    gen = torch.Generator().manual_seed(seed)
    y, h = out
    loss = (y * torch.randn(y.shape, generator=gen)).sum() + (h * torch.randn(h.shape, generator=gen)).sum()
    return torch.autograd.grad(loss, [t for t in ins if t is not None])


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), l=st.integers(1, 60), g=st.integers(1, 3), hg=st.integers(1, 3), p=st.integers(1, 4),
       n=st.integers(1, 5), chunk=st.integers(1, 16), h0=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_ssd_equals_the_reference_with_gradients(b, l, g, hg, p, n, chunk, h0, seed):
    ins = _inputs(b, l, g * hg, p, g, n, seed, h0=h0)
    want, got = ssd_reference(*ins), ssd_scan(*ins, chunk=chunk)
    assert got[0].shape == (b, l, g * hg, p) and got[1].shape == (b, g * hg, p, n)
    for x, w, what in zip(got, want, ("y", "last state")):
        assert_close_scaled(x, w, FP32, what)
    for name, x, w in zip("x dt A B C D h0".split(), _grads(got, ins, seed), _grads(want, ins, seed)):
        assert_close_scaled(x, w, FP32, f"d{name}")


@pytest.mark.parametrize("l, chunk", [(64, 16), (100, 16), (5, 32), (129, None), (200, None)])
def test_chunked_ssd_at_lengths_the_chunk_does_and_does_not_divide(l, chunk):
    ins = _inputs(2, l, 4, 8, 2, 6, seed=l)
    got, want = ssd_scan(*ins, chunk=chunk), ssd_reference(*ins)
    assert_close_scaled(got[0], want[0], FP32, "y")
    assert_close_scaled(got[1], want[1], FP32, "last state")
    for name, x, w in zip("x dt A B C D h0".split(), _grads(got, ins, 0), _grads(want, ins, 0)):
        assert_close_scaled(x, w, FP32, f"d{name}")


def test_reference_is_the_recurrence_by_hand():
    """One head, p = n = 1, two positions: h1 = Δ1 x1 B1, h2 = exp(Δ2 A) h1 + Δ2 x2 B2, y = C h + D x."""
    x, dt = torch.tensor([2.0, 3.0]).view(1, 2, 1, 1), torch.tensor([0.5, 0.25]).view(1, 2, 1)
    A, D = torch.tensor([-2.0]), torch.tensor([0.1])
    B, C = torch.tensor([1.5, -1.0]).view(1, 2, 1, 1), torch.tensor([0.5, 2.0]).view(1, 2, 1, 1)
    h1 = 0.5 * 2.0 * 1.5
    h2 = math.exp(0.25 * -2.0) * h1 + 0.25 * 3.0 * -1.0
    y, h = ssd_reference(x, dt, A, B, C, D)
    assert torch.allclose(y.view(-1), torch.tensor([0.5 * h1 + 0.2, 2.0 * h2 + 0.3]))
    assert torch.allclose(h.view(-1), torch.tensor([h2]))


def test_the_recurrence_is_a_masked_matrix_product():
    """The duality of the module docstring, for one head: y = (L ∘ C Bᵀ) (Δ x), with
    L[t, s] = exp(A Σ_{s<r<=t} Δ_r) on and below the diagonal, 0 above."""
    x, dt, A, B, C, _, _ = (t.detach().double() if t is not None else None
                            for t in _inputs(1, 9, 1, 3, 1, 4, seed=2, h0=False))
    steps = torch.cumsum(dt[0, :, 0], 0)
    L = torch.exp(A[0] * (steps[:, None] - steps[None, :])).tril()
    M = L * (C[0, :, 0] @ B[0, :, 0].T)
    want = M @ (dt[0, :, 0, None] * x[0, :, 0])
    assert torch.allclose(ssd_reference(x, dt, A, B, C)[0][0, :, 0], want)


def test_heads_read_their_groups_in_blocks():
    """4 heads, 2 groups: heads 0 and 1 read group 0, heads 2 and 3 group 1."""
    x, dt, A, B, C, D, h0 = (t.detach() for t in _inputs(1, 12, 4, 2, 2, 3, seed=3))
    y, _ = ssd_scan(x, dt, A, B, C, D, h0, chunk=4)
    for head, group in ((0, 0), (1, 0), (2, 1), (3, 1)):
        one = slice(head, head + 1)
        alone, _ = ssd_reference(x[:, :, one], dt[:, :, one], A[one], B[:, :, group:group + 1],
                                 C[:, :, group:group + 1], D[one], h0[:, one])
        assert_close_scaled(y[:, :, one], alone, FP32, f"head {head}")


def test_step_by_step_equals_the_full_scan():
    x, dt, A, B, C, D, h0 = (t.detach() for t in _inputs(2, 23, 4, 3, 2, 5, seed=4))
    y_full, h_full = ssd_scan(x, dt, A, B, C, D, h0, chunk=8)
    h, ys = h0, []
    for t in range(x.size(1)):
        y, h = ssd_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    assert_close_scaled(torch.stack(ys, 1), y_full, FP32, "y")
    assert_close_scaled(h, h_full, FP32, "state")


def test_zero_step_carries_the_state_unchanged():
    x, dt, A, B, C, D, h0 = (t.detach() for t in _inputs(1, 6, 2, 3, 1, 2, seed=5))
    dt[:, 2:4] = 0.0
    _, before = ssd_scan(x[:, :2], dt[:, :2], A, B[:, :2], C[:, :2], D, h0, chunk=4)
    _, after = ssd_scan(x[:, :4], dt[:, :4], A, B[:, :4], C[:, :4], D, h0, chunk=4)
    assert_close_scaled(after, before, 1e-6, "state over Δ = 0")


def test_the_state_is_fp32_whatever_the_input_dtype():
    ins = [t.detach() if t is not None else None for t in _inputs(1, 40, 4, 4, 2, 3, seed=6)]
    y16, h16 = ssd_scan(*[t.bfloat16() for t in ins], chunk=8)
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    want, _ = ssd_reference(*[t.bfloat16().float() for t in ins])
    assert_close_scaled(y16.float(), want, 1e-2, "bf16 inputs, fp32 state")


def _saved_states(fn, shape) -> int:
    """How many numbers autograd keeps for ``fn``'s backward in tensors whose last dims are ``shape``."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(t.numel() for t in saved if t.dim() >= 3 and tuple(t.shape[-2:]) == shape)


def test_backward_keeps_one_state_per_chunk_not_every_state():
    """What autograd keeps of (p, n)-shaped states through the chunked form: the state entering
    each chunk, l/q per row and head (measured: exactly that); through the loop, every one."""
    b, l, h, p, n, q = 2, 256, 4, 8, 6, 32
    ins = _inputs(b, l, h, p, 1, n, seed=7)
    chunked = _saved_states(lambda: ssd_scan(*ins, chunk=q), (p, n))
    assert chunked <= 2 * b * (l // q) * h * p * n
    reference = _saved_states(lambda: ssd_reference(*ins), (p, n))
    assert reference >= b * l * h * p * n > 4 * chunked


def test_bad_chunk_and_shapes_are_refused():
    ins = [t.detach() if t is not None else None for t in _inputs(1, 5, 4, 2, 2, 3, seed=8)]
    with pytest.raises(ValueError, match="ssd_scan: chunk must be a positive int, got 0"):
        ssd_scan(*ins, chunk=0)
    shapes = r"ssd_scan: shapes x \(1, 5, 4, 2\), dt \(1, 5, 4\), A \(4,\), B \(1, 5, 3, 3\)"
    with pytest.raises(ValueError, match=shapes):
        ssd_scan(ins[0], ins[1], ins[2], torch.zeros(1, 5, 3, 3), torch.zeros(1, 5, 3, 3))
