"""The scans keep their state in fp32 under the Trainer's bf16 autocast: inside them autocast is
off, so a chunked product that would round to bf16 (8 bits of mantissa) stays fp32."""
import torch

from attnlab.nn.ssd import ssd_scan, ssd_step
from attnlab.nn.ssm import selective_scan, selective_step


def _mamba_inputs(b=2, l=40, d=6, n=5):
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(b, l, d, generator=g), torch.rand(b, l, d, generator=g) * 0.5
    A = -torch.rand(d, n, generator=g) - 0.5
    B, C = torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    return x, delta, A, B, C


def _mamba2_inputs(b=2, l=40, h=4, p=8, g=2, n=16):
    gen = torch.Generator().manual_seed(1)
    x, dt = torch.randn(b, l, h, p, generator=gen), torch.rand(b, l, h, generator=gen) * 0.5
    A = -torch.rand(h, generator=gen) - 0.5
    B, C = torch.randn(b, l, g, n, generator=gen), torch.randn(b, l, g, n, generator=gen)
    return x, dt, A, B, C


def _same_under_autocast(fn, *args):
    want = fn(*args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fn(*args)
    for w, o in zip(want, got):
        assert o.dtype == w.dtype == torch.float32
        # bf16 products would be off by ~1e-3 of the scale; fp32 ones agree to round-off
        assert (o - w).abs().max() <= 1e-6 * w.abs().max()


def test_mamba_scan_and_step_stay_fp32_under_bf16_autocast():
    x, delta, A, B, C = _mamba_inputs()
    _same_under_autocast(lambda *a: selective_scan(*a, chunk=8), x, delta, A, B, C)
    h = torch.randn(2, 6, 5)
    _same_under_autocast(selective_step, h, x[:, 0], delta[:, 0], A, B[:, 0], C[:, 0])


def test_mamba2_scan_and_step_stay_fp32_under_bf16_autocast():
    x, dt, A, B, C = _mamba2_inputs()
    _same_under_autocast(lambda *a: ssd_scan(*a, chunk=8), x, dt, A, B, C)
    state = torch.randn(2, 4, 8, 16)
    _same_under_autocast(ssd_step, state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0])
