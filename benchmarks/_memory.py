"""Peak memory of one call measured from outside torch: the resident memory of a fresh process.

``benchmarks/_util.py``'s CPU meter runs the call under ``torch.profiler`` and replays every
allocation of torch's allocator; its record of every allocation costs memory of its own, and at
8,192 tokens a Mamba-3 forward+backward under it reached 17.7 GB and was killed. This meter costs
nothing during the call: the kernel already keeps the high-water mark of a process's resident set
(``VmHWM`` in ``/proc/self/status``), and writing ``5`` to ``/proc/self/clear_refs`` resets it.

What :func:`peak_rss_during` returns: the high-water mark of the process's resident memory during
one call, minus the resident memory when the call started, in bytes. Against the allocator's
figure it also counts what is not a tensor (autograd's graph nodes, Python objects, oneDNN/MKL
scratch buffers, glibc's bookkeeping, pages of libraries touched for the first time) and counts a
tensor only for the pages written (``torch.empty`` never filled is free), so it reads a few MiB
above the allocator's figure on small calls and about equal on large ones. Two things keep it
close to the tensors: the caller warms the call up first (code pages and one-time caches are then
in the baseline), and :func:`child_env` fixes glibc's mmap threshold at 128 KiB, so that every
block above it is its own mapping, returned to the kernel when freed (glibc otherwise raises the
threshold as blocks are freed, and later blocks come from a heap that keeps freed pages resident:
the resident set would then remember earlier calls and hide what this one needed).

Each measurement runs in its own process (:func:`run_child`), under an address-space limit
(:func:`cap_memory`): a call that would need more fails with torch's "can't allocate memory"
(or a MemoryError), which the child reports as over the cap, instead of taking the machine down.
Linux only (``/proc``).
"""
from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable, Sequence

MARK = "@measured "          # prefix of the child's result lines on stdout
GIB = 2**30


def status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM, VmSize) in bytes."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field} line")
    return int(m.group(1)) * 1024


def reset_peak() -> None:
    """Set the resident high-water mark (VmHWM) back to the present resident memory."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_during(fn: Callable[[], object]) -> int:
    """Bytes: the resident high-water mark during one call of ``fn`` above the resident memory
    before it (see the module doc)."""
    reset_peak()
    base = status_bytes("VmRSS")
    fn()
    return max(0, status_bytes("VmHWM") - base)


def cap_memory(limit_bytes: int) -> None:
    """Limit this process's address space so that its resident memory cannot pass ``limit_bytes``:
    the present address space plus what the limit leaves above the present resident memory."""
    room = limit_bytes - status_bytes("VmRSS")
    if room <= 0:
        raise RuntimeError(f"the process already holds {status_bytes('VmRSS') / GIB:.2f} GiB, "
                           f"over the cap of {limit_bytes / GIB:.2f} GiB")
    resource.setrlimit(resource.RLIMIT_AS, (status_bytes("VmSize") + room, resource.RLIM_INFINITY))


def is_out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation refused under the cap."""
    return isinstance(err, MemoryError) or (isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def report(**fields) -> None:
    """A child's result line (one JSON object), flushed at once so that it survives a later crash."""
    print(MARK + json.dumps(fields), flush=True)


def child_env(threads: int = 1) -> dict:
    """The environment of a measuring child: ``threads`` OpenMP threads, glibc's mmap and trim
    thresholds fixed (see the module doc)."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": "131072",
            "MALLOC_TRIM_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore"}


def parse(stdout: str) -> list[dict]:
    """The result lines (:func:`report`) of a child's output, in order."""
    return [json.loads(line[len(MARK):]) for line in stdout.splitlines() if line.startswith(MARK)]


def run_child(argv: Sequence[str], timeout: float, threads: int = 1) -> tuple[list[dict], str]:
    """Run ``python argv`` in a fresh process; its result lines and, when it failed or reported
    nothing, one line saying how (else "")."""
    try:
        proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout,
                              env=child_env(threads))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return parse(out), f"over the time limit of {timeout:g} s"
    results = parse(proc.stdout)
    if proc.returncode != 0 or not results:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return results, f"exit {proc.returncode}: {tail[:200]}"
    return results, ""
