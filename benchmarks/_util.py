"""Small timing and memory helpers shared by the benchmarks in this folder.

Timing: every callable is warmed up, then timed call by call with ``time.perf_counter``
(the device is synchronised before and after each call on CUDA); the median is reported.
The number of timed calls adapts to the cost of one call: at most ``repeats``, at least
``min_repeats``, and otherwise as many as fit in ``budget_s`` seconds. Several callables
compared with each other are timed round-robin (a, b, c, a, b, c, ...), so that a slow
drift of the machine (another process, clock changes) spreads over all of them alike.

Peak memory: the high-water mark of memory allocated by torch *during one call*, above
what was allocated when the call started, in bytes. It counts everything torch's
allocator hands out while the call runs: temporaries inside kernels, the activations
saved for backward, the output and the gradients. Tensors that exist before the call
(inputs, parameters) are not counted.
- CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` around the
  call, after ``reset_peak_memory_stats``.
- CPU: torch has no CPU peak counter, and tracemalloc / RSS do not see torch's allocator
  reliably, so the call is run once under ``torch.profiler.profile(profile_memory=True)``;
  every allocation and free of torch's CPU allocator is recorded with its address, size and
  time, and the peak of the running sum of the blocks allocated during the call (minus those
  of them freed again) is taken. This call is separate from the timed ones
  (the profiler slows calls down).
"""
from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


def cpu_name() -> str:
    """The CPU model, as /proc/cpuinfo names it (what a result file records beside its figures)."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def sync(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Timing:
    """Seconds per call of one callable."""
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def n(self) -> int:
        return len(self.times)


def cpu_seconds(fn: Callable[[], object]) -> float:
    """The CPU time of the process (all its threads) during one call of ``fn``."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def lm_call(model: torch.nn.Module, ids: torch.Tensor, mode: str) -> Callable[[], None]:
    """A call of a language model on ``ids`` for the benchmarks that time or meter one: ``"fwd"``
    (eval mode, no gradient) or ``"fwd+bwd"`` (train mode, the mean of the squared logits, backward,
    gradients dropped). The model's mode is set here; its output is logits or has ``.logits``."""
    model.train(mode == "fwd+bwd")

    def logits():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits

    def fwd():
        with torch.no_grad():
            logits()

    def fwd_bwd():
        logits().float().square().mean().backward()
        for p in model.parameters():
            p.grad = None
    return fwd if mode == "fwd" else fwd_bwd


def _time_once(fn: Callable[[], object], device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def time_calls(fns: dict[str, Callable[[], object]], *, device="cpu", warmup: int = 1,
               repeats: int = 10, min_repeats: int = 3, budget_s: float = 4.0) -> dict[str, Timing]:
    """Time each callable of ``fns`` round-robin and return its :class:`Timing`.

    Each callable is first called ``warmup`` times untimed. Its first timed call sets how many
    timed calls it gets in all: ``clamp(budget_s / duration, min_repeats, repeats)``.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out = {name: Timing([_time_once(fn, device)]) for name, fn in fns.items()}
    wanted = {name: max(min_repeats, min(repeats, int(budget_s / max(t.times[0], 1e-9))))
              for name, t in out.items()}
    while any(out[name].n < wanted[name] for name in fns):
        for name, fn in fns.items():
            if out[name].n < wanted[name]:
                out[name].times.append(_time_once(fn, device))
    return out


def measure(fns: dict[str, Callable[[], object]], *, device="cpu", warmup: int = 1, repeats: int = 10,
            min_repeats: int = 3, budget_s: float = 4.0) -> dict[str, tuple[Timing, int]]:
    """Peak memory and timing of each callable: ``{name: (Timing, peak bytes)}``.

    Each callable is warmed up (``warmup`` calls, so that one-time allocations such as kernel
    caches are neither timed nor counted as its peak), then measured for memory by one more
    call, then timed by :func:`time_calls`.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    peaks = {name: peak_memory(fn, device) for name, fn in fns.items()}
    timings = time_calls(fns, device=device, warmup=0, repeats=repeats, min_repeats=min_repeats,
                         budget_s=budget_s)
    return {name: (timings[name], peaks[name]) for name in fns}


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the C++ profiler's start/stop log lines (written straight to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _cpu_peak_bytes(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        extra = ev.typed[1]
        if type(extra).__name__ == "_ExtraFields_Allocation" and extra.device.type == "cpu":
            events.append((ev.start_time_ns, extra.ptr, extra.alloc_size))
    events.sort(key=lambda e: e[0])
    # frees of blocks allocated before this call (an earlier call's gradients, say) are left out:
    # only memory allocated during the call is counted, and freed when the call frees it
    blocks: dict[int, int] = {}
    live = peak = 0
    for _, ptr, size in events:
        if size > 0:
            blocks[ptr] = size
            live += size
            peak = max(peak, live)
        elif ptr in blocks:
            live -= blocks.pop(ptr)
    return peak


def peak_memory(fn: Callable[[], object], device="cpu") -> int:
    """Bytes: high-water mark of torch allocations during one call of ``fn`` (see module doc)."""
    device = torch.device(device)
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    return _cpu_peak_bytes(fn)


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def step_rows(names: Sequence[str], timings: dict, ref: str, tokens: int, phases: dict,
              phase_names: Sequence[str]) -> list[list[object]]:
    """Training-table rows: name, median and min ms, steps, tokens/s, speed ratio and min-time
    speed ratio against ``ref``, then the median ms of each phase (``phases[name][phase]``)."""
    ref_t, ref_best = timings[ref].median, min(timings[ref].times)
    return [[n, fmt_ms(t.median), fmt_ms(min(t.times)), t.n, f"{tokens / t.median:.0f}", f"{ref_t / t.median:.2f}",
             f"{ref_best / min(t.times):.2f}"] + [fmt_ms(statistics.median(phases[n][p])) for p in phase_names]
            for n, t in ((n, timings[n]) for n in names)]


def fmt_mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:.2f}" if mib < 10 else f"{mib:.0f}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    """A plain-text table with aligned columns, or a GitHub markdown table (numeric columns right-aligned)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    if markdown:
        def numeric(col: int) -> bool:
            try:
                for r in cells[1:]:
                    float(r[col])
            except ValueError:
                return False
            return True

        lines = ["| " + " | ".join(cells[0]) + " |",
                 "|" + "|".join("---:" if numeric(i) else "---" for i in range(len(headers))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in cells[1:]]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells[0], widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(lines)


def environment(device, dtype) -> str:
    """One line naming torch, the device, dtype and thread count, for the report header."""
    device = torch.device(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    return f"torch {torch.__version__}; {where}; {str(dtype).replace('torch.', '')}"
