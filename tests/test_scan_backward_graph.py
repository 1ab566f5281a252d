"""The chunked scans' backward stays linear in the length. A loop over chunks that indexes a
stacked tensor (``own[:, :, k]``) gives autograd one select per chunk, and the backward of each
select is a zero tensor of the *whole* stacked shape: m chunks, m full-size tensors, a backward
quadratic in the length (RWKV-7's measured 0.05 s at 512 and 1.7 s at 4,096 positions). The loops
unbind instead; these tests count the graph's select nodes, which must not grow with the chunks."""
import pytest
import torch
import torch.nn.functional as F

from attnlab.nn.mamba3_scan import mamba3_scan
from attnlab.nn.ssd import ssd_scan
from attnlab.nn.wkv import wkv4, wkv7


def _selects(out) -> int:
    """How many SelectBackward nodes the graph of ``out`` (a tensor or nested tuple) holds."""
    roots, seen, count = [], set(), 0
    stack = [out]
    while stack:
        t = stack.pop()
        if isinstance(t, (tuple, list)):
            stack.extend(t)
        elif isinstance(t, torch.Tensor) and t.grad_fn is not None:
            roots.append(t.grad_fn)
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += type(node).__name__.startswith("SelectBackward")
        roots.extend(n for n, _ in node.next_functions)
    return count


def _wkv7(l):
    g = torch.Generator().manual_seed(0)
    r, k, v, kappa = (torch.randn(1, l, 2, 4, generator=g, requires_grad=True) for _ in range(4))
    w = (0.6 + 0.39 * torch.rand(1, l, 2, 4, generator=g)).requires_grad_()
    a = torch.rand(1, l, 2, 4, generator=g, requires_grad=True)
    return wkv7(r, w, k, v, F.normalize(kappa, dim=-1), a, chunk=4)


def _wkv4(l):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, l, 3, generator=g, requires_grad=True) for _ in range(2))
    w, u = torch.ones(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    return wkv4(k, v, w, u, chunk=4)


def _mamba3(l):
    g = torch.Generator().manual_seed(0)
    C, B, X = (torch.randn(1, l, 1, 2, 3, generator=g, requires_grad=True) for _ in range(3))
    dt = F.softplus(torch.randn(1, l, 2, generator=g)).requires_grad_()
    return mamba3_scan(C, B, X, -dt, 0.5 * dt, 0.5 * dt, chunk=4)


def _ssd(l):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, l, 2, 3, generator=g, requires_grad=True)
    dt = F.softplus(torch.randn(1, l, 2, generator=g)).requires_grad_()
    A = -torch.rand(2, generator=g).requires_grad_()
    B, C = (torch.randn(1, l, 1, 4, generator=g, requires_grad=True) for _ in range(2))
    return ssd_scan(x, dt, A, B, C, chunk=4)


@pytest.mark.parametrize("scan", [_wkv7, _wkv4, _mamba3, _ssd], ids=["wkv7", "wkv4", "mamba3", "ssd"])
def test_the_backward_graph_has_no_select_per_chunk(scan):
    short, long = _selects(scan(16)), _selects(scan(64))      # 4 chunks, then 16
    assert long == short, f"{short} select nodes at 4 chunks, {long} at 16: one per chunk"
