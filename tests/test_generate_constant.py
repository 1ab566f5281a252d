"""A decoding step of a recurrent LM does the same work whatever the context: the house loop's
adaptor hands the model only the new token and a fixed-size state, and allocates nothing that
grows with the history (it writes one column into buffers with room to spare instead of
concatenating the whole token history and mask each step).

Work is counted, not timed: every allocation torch's CPU allocator makes during one step, seen
by torch.profiler, must be the same multiset of sizes after a 16-token prompt as after a
600-token one.
"""
from collections import Counter

import pytest
import torch

from attnlab.generate import CausalState, generate
from attnlab.models.mamba import MAMBA, Mamba
from attnlab.models.mamba2 import MAMBA2, Mamba2
from attnlab.models.mamba3 import MAMBA3, Mamba3
from attnlab.models.rwkv import RWKV, Rwkv
from attnlab.models.rwkv7 import RWKV7, Rwkv7

FAMILIES = {"mamba": (Mamba, MAMBA), "mamba2": (Mamba2, MAMBA2), "mamba3": (Mamba3, MAMBA3), "rwkv": (Rwkv, RWKV),
            "rwkv7": (Rwkv7, RWKV7)}


def _tiny(name: str):
    cls, family = FAMILIES[name]
    torch.manual_seed(0)
    return cls(family.preset("tiny")).eval()


def _allocations(fn) -> Counter:
    """The sizes of the blocks torch's CPU allocator hands out during ``fn()``, as a multiset."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes, stack = Counter(), list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        extra = event.typed[1]
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.alloc_size > 0:
            sizes[extra.alloc_size] += 1
    return sizes


def _step_record(model, context: int):
    """What one decoding step, a few tokens after a prompt of ``context`` tokens, allocates, and
    the shapes of the ids and the state tensors the model receives in it."""
    g = torch.Generator().manual_seed(context)
    state = CausalState(model, torch.randint(0, 96, (1, context), generator=g))
    seen = []

    def hook(module, args, kwargs):
        ids, cache = args[0], kwargs["cache"]
        seen.append((tuple(ids.shape), [tuple(t.shape) for t in cache.tensors if t is not None]))

    with torch.no_grad():
        token = state.next_logits().argmax(-1)
        for _ in range(3):                       # past the prefill and the first step's set-up
            state.append(token)
            token = state.next_logits().argmax(-1)
        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            def step():
                state.append(token)
                state.next_logits()
            allocations = _allocations(step)
        finally:
            handle.remove()
    return allocations, seen


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_decoding_step_work_does_not_grow_with_the_context(name):
    model = _tiny(name)
    short, short_seen = _step_record(model, 16)
    long, long_seen = _step_record(model, 600)
    assert short_seen == long_seen and short_seen[0][0] == (1, 1), (short_seen, long_seen)
    grown = (long - short) + (short - long)
    assert not grown, f"{name}: a decoding step allocates differently after 600 tokens than after 16: {dict(grown)}"


def test_history_buffers_leave_the_callers_tensors_alone_and_grow():
    """The adaptor copies the prompt and mask (rewinding edits its mask in place) and keeps every
    token when appends outrun the spare room."""
    model = _tiny("mamba")
    ids, mask = torch.randint(0, 96, (2, 5)), torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    before = mask.clone()
    state = CausalState(model, ids, mask)
    added = torch.randint(0, 96, (2, 200))
    for t in range(200):
        state.append(added[:, t])
    state.rewind(150, torch.tensor([2, 0]))
    assert torch.equal(mask, before)
    assert torch.equal(state.seq, torch.cat([ids, added[:, :147]], 1))
    assert state.mask[:, 150:].tolist() == [[True, True], [False, False]]
    assert bool(state.mask[:, 5:150].all()) and torch.equal(state.mask[:, :5], before)


@pytest.mark.parametrize("name", ["mamba", "rwkv7"])
def test_long_greedy_equals_the_uncached_loop(name):
    """Past the buffers' first growth (prompt 5 -> room 74), cached greedy decoding still gives
    the tokens of recomputing the whole prefix each step."""
    model = _tiny(name)
    ids = torch.randint(0, 96, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    cached = generate(model, ids, 90, attention_mask=mask)
    assert torch.equal(cached, generate(model, ids, 90, attention_mask=mask, use_cache=False))


@pytest.mark.parametrize("width, bias", [(4, True), (4, False), (9, True)])
def test_causal_conv_equals_conv1d(width, bias):
    """The decoding step's depthwise convolution (a weighted sum over a kernel-wide window) and the
    prefill's (conv1d over a longer window) both equal torch's conv1d."""
    from attnlab.models.recurrent import causal_conv
    conv = torch.nn.Conv1d(12, 12, 4, groups=12, bias=bias)
    window = torch.randn(3, 12, width)
    expected = torch.nn.functional.conv1d(window, conv.weight, conv.bias, groups=12)
    assert torch.allclose(causal_conv(window, conv), expected, rtol=1e-6, atol=1e-6)
