"""The selective scan (attnlab.nn.ssm): the chunked fast path equals the sequential reference,
forward and gradients, for random shapes, chunk lengths and sequence lengths that the chunks do
not divide; the one-step update equals the full scan; the reference itself is checked against the
recurrence written out by hand for a tiny case."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from attnlab.nn.ssm import _ChunkedScan, selective_scan, selective_scan_reference, selective_step
from _tolerance import FP32, assert_close_scaled  # noqa: E402  (tests/ is on sys.path)


def _inputs(b, l, d, n, seed, grad=True, h0=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, d, generator=g)
    delta = torch.nn.functional.softplus(torch.randn(b, l, d, generator=g))      # steps up to a few units
    A = -torch.exp(torch.randn(d, n, generator=g))
    B, C = torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    D = torch.randn(d, generator=g)
    h = torch.randn(b, d, n, generator=g) if h0 else None
    ins = [x, delta, A, B, C, D, h]
    return [t.requires_grad_(grad) if t is not None else None for t in ins]


def _grads(out, ins, seed):
    g = torch.Generator().manual_seed(seed)
    y, h = out
    loss = (y * torch.randn(y.shape, generator=g)).sum() + (h * torch.randn(h.shape, generator=g)).sum()
    return torch.autograd.grad(loss, [t for t in ins if t is not None])


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), l=st.integers(1, 70), d=st.integers(1, 6), n=st.integers(1, 5),
       chunk=st.integers(1, 16), h0=st.booleans(), seed=st.integers(0, 10_000))
def test_chunked_scan_equals_the_reference_with_gradients(b, l, d, n, chunk, h0, seed):
    ins = _inputs(b, l, d, n, seed, h0=h0)
    want, got = selective_scan_reference(*ins), selective_scan(*ins, chunk=chunk)
    assert got[0].shape == (b, l, d) and got[1].shape == (b, d, n)
    for g, w, what in zip(got, want, ("y", "last state")):
        assert_close_scaled(g, w, FP32, what)
    for name, g, w in zip("x delta A B C D h0".split(), _grads(got, ins, seed), _grads(want, ins, seed)):
        assert_close_scaled(g, w, FP32, f"d{name}")


@pytest.mark.parametrize("l, chunk", [(64, 8), (100, 8), (5, 32), (129, 16)])
def test_chunked_scan_at_lengths_the_chunk_does_and_does_not_divide(l, chunk):
    ins = _inputs(2, l, 8, 4, seed=l)
    got, want = selective_scan(*ins, chunk=chunk), selective_scan_reference(*ins)
    assert_close_scaled(got[0], want[0], FP32, "y")
    for name, g, w in zip("x delta A B C D h0".split(), _grads(got, ins, 0), _grads(want, ins, 0)):
        assert_close_scaled(g, w, FP32, f"d{name}")


def test_reference_is_the_recurrence_by_hand():
    """d = n = 1, two positions: h1 = Δ1 B1 x1, h2 = exp(Δ2 A) h1 + Δ2 B2 x2, y = C h + D x."""
    x, delta = torch.tensor([[[2.0], [3.0]]]), torch.tensor([[[0.5], [0.25]]])
    A, B, C, D = torch.tensor([[-2.0]]), torch.tensor([[[1.5], [-1.0]]]), torch.tensor([[[0.5], [2.0]]]), torch.tensor([0.1])
    h1 = 0.5 * 1.5 * 2.0
    h2 = math.exp(0.25 * -2.0) * h1 + 0.25 * -1.0 * 3.0
    y, h = selective_scan_reference(x, delta, A, B, C, D)
    assert torch.allclose(y.view(-1), torch.tensor([0.5 * h1 + 0.2, 2.0 * h2 + 0.3]))
    assert torch.allclose(h.view(-1), torch.tensor([h2]))


def test_step_by_step_equals_the_full_scan():
    x, delta, A, B, C, D, h0 = (t.detach() for t in _inputs(2, 23, 6, 4, seed=3))
    y_full, h_full = selective_scan(x, delta, A, B, C, D, h0, chunk=8)
    h, ys = h0, []
    for t in range(x.size(1)):
        y, h = selective_step(h, x[:, t], delta[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    assert_close_scaled(torch.stack(ys, 1), y_full, FP32, "y")
    assert_close_scaled(h, h_full, FP32, "state")


def test_zero_step_carries_the_state_unchanged():
    x, delta, A, B, C, D, h0 = (t.detach() for t in _inputs(1, 6, 3, 2, seed=4))
    delta[:, 2:4] = 0.0
    _, h_before = selective_scan(x[:, :2], delta[:, :2], A, B[:, :2], C[:, :2], D, h0, chunk=4)
    _, h_after = selective_scan(x[:, :4], delta[:, :4], A, B[:, :4], C[:, :4], D, h0, chunk=4)
    assert torch.equal(h_before, h_after)


def test_the_state_is_fp32_whatever_the_input_dtype():
    ins = [t.detach() if t is not None else None for t in _inputs(1, 40, 4, 3, seed=5)]
    y16, h16 = selective_scan(*[t.bfloat16() for t in ins], chunk=8)
    assert y16.dtype == torch.bfloat16 and h16.dtype == torch.float32
    want, _ = selective_scan_reference(*[t.bfloat16().float() for t in ins])
    assert_close_scaled(y16.float(), want, 1e-2, "bf16 inputs, fp32 state")


def _saved_states(fn) -> int:
    """How many numbers autograd keeps for ``fn``'s backward in tensors shaped like states
    (..., d=8, n=4), or (..., n, d) as the scan in order holds them."""
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(t.numel() for t in saved if t.dim() >= 3 and t.shape[-2:] in ((8, 4), (4, 8)))


def test_backward_keeps_the_chunk_starts_not_every_state():
    """What the chunked scan saves for backward: its inputs and one state per chunk, l·d·n / q
    numbers of states (the chunk decays it recomputes); autograd through the loop keeps every state."""
    b, l, d, n, q = 2, 256, 8, 4, 16
    ins = _inputs(b, l, d, n, seed=6)
    states = _saved_states(lambda: _ChunkedScan.apply(*ins[:5], ins[6], q))
    assert states == b * (l // q) * d * n, "chunk starts only"
    reference = _saved_states(lambda: selective_scan_reference(*ins))
    assert reference >= b * l * d * n > 4 * states


# _GROUP_BUDGET numbers for backward groups of 1 chunk, of 2 chunks with a shorter last group (of
# 5 chunks), and of all 5, for the shapes below (d = 3, n = 2, q = 4, b = 2: 48 numbers per chunk
# and buffer; the backward holds 3 buffers, the forward 1, so its groups are 3 times larger)
_BUDGETS = {"one chunk per group": 3 * 48, "two chunks per group": 3 * 96, "one group": 1 << 23}


@pytest.mark.parametrize("budget", _BUDGETS.values(), ids=_BUDGETS.keys())
def test_groups_of_chunks_equal_the_reference_with_gradients(budget, monkeypatch):
    """The scan works a group of chunks at a time, the group's size set by its buffer budget:
    every grouping, the last group shorter than the others included, gives the reference's
    outputs and gradients."""
    monkeypatch.setattr("attnlab.nn.ssm._GROUP_BUDGET", budget)
    ins = _inputs(2, 19, 3, 2, seed=11)                                   # 5 chunks of 4, the last padded
    got, want = selective_scan(*ins, chunk=4), selective_scan_reference(*ins)
    for g, w, what in zip(got, want, ("y", "last state")):
        assert_close_scaled(g, w, FP32, what)
    for name, g, w in zip("x delta A B C D h0".split(), _grads(got, ins, 1), _grads(want, ins, 1)):
        assert_close_scaled(g, w, FP32, f"d{name}")


@pytest.mark.parametrize("budget", _BUDGETS.values(), ids=_BUDGETS.keys())
def test_hand_written_backward_passes_gradcheck_in_float64(budget, monkeypatch):
    """The backward of the chunked scan against finite differences of its own forward (float64
    inputs keep float64 arithmetic), for the last state's gradient as well as the outputs'."""
    monkeypatch.setattr("attnlab.nn.ssm._GROUP_BUDGET", budget)
    x, delta, A, B, C, _, h0 = (t.detach().double().requires_grad_() for t in _inputs(2, 19, 3, 2, seed=12))
    assert torch.autograd.gradcheck(lambda *t: _ChunkedScan.apply(*t, 4), (x, delta, A, B, C, h0))
    y, h = selective_scan(x, delta, A, B, C, None, h0, chunk=4)
    assert y.dtype == h.dtype == torch.float64


@pytest.mark.parametrize("b, l, d, n, chunk", [(2, 21, 1024, 16, 4), (1, 9, 2048, 16, 64), (4, 30, 640, 16, 7)])
def test_scan_in_order_equals_the_reference_with_gradients(b, l, d, n, chunk):
    """States of 16,384 numbers and more (b·d·n) take the path that runs position by position on
    a (b, n, d) state: the same outputs and gradients as the reference, chunks that do and do
    not divide the length, one chunk longer than the sequence."""
    ins = _inputs(b, l, d, n, seed=d)
    got, want = selective_scan(*ins, chunk=chunk), selective_scan_reference(*ins)
    for g, w, what in zip(got, want, ("y", "last state")):
        assert_close_scaled(g, w, FP32, what)
    for name, g, w in zip("x delta A B C D h0".split(), _grads(got, ins, 2), _grads(want, ins, 2)):
        assert_close_scaled(g, w, FP32, f"d{name}")


def test_scan_in_order_passes_gradcheck_and_keeps_only_chunk_starts(monkeypatch):
    """The path in order on small float64 shapes (its threshold lowered to every shape): its
    hand-written backward against finite differences, and what it saves for backward is one state
    per chunk, as the chunked path."""
    monkeypatch.setattr("attnlab.nn.ssm._IN_ORDER_FROM", 0)
    x, delta, A, B, C, _, h0 = (t.detach().double().requires_grad_() for t in _inputs(2, 19, 3, 2, seed=13))
    assert torch.autograd.gradcheck(lambda *t: _ChunkedScan.apply(*t, 4), (x, delta, A, B, C, h0))
    ins = _inputs(2, 256, 8, 4, seed=6)
    assert _saved_states(lambda: _ChunkedScan.apply(*ins[:5], ins[6], 16)) == 2 * (256 // 16) * 8 * 4


def test_bad_chunk_and_shapes_are_refused():
    ins = [t.detach() if t is not None else None for t in _inputs(1, 5, 3, 2, seed=7)]
    with pytest.raises(ValueError, match="selective_scan: chunk must be a positive int, got 0"):
        selective_scan(*ins, chunk=0)
    with pytest.raises(ValueError, match="selective_scan: shapes x"):
        selective_scan(ins[0], ins[1], ins[2], ins[3][:, :4], ins[4])


def test_ssm_benchmark_quick_runs():
    """benchmarks/ssm.py must keep running: its smoke test on tiny shapes, which also checks that
    attnlab's Mamba and transformers' agree on the same weights before timing them."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "ssm.py"), "--quick", "--threads", "1",
                           "--models", "mamba", "--reference-max-length", "16"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "same weights: logits agree" in proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("fwd")]
    for name in ("attnlab Mamba (chunked scan)", "transformers MambaForCausalLM (slow path)", "attnlab GPT (SDPA)"):
        assert sum(name in line for line in table) == 4, name            # 2 lengths x 2 modes
    # above --reference-max-length transformers' row stands, not run, in forward+backward only
    skipped = [line for line in proc.stdout.splitlines() if "not run" in line]
    assert len(skipped) == 1 and "fwd+bwd" in skipped[0] and " 40 " in skipped[0] and "transformers" in skipped[0]
    assert "time vs GPT" in proc.stdout
