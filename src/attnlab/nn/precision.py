"""Does this device compute in bf16 natively? The choice behind ``--precision auto`` and ``--dtype auto``.

bf16 pays where the hardware multiplies bf16 itself: a CPU with AVX512-BF16 (``vdpbf16ps``) or
AMX-BF16 tile instructions, or a GPU that reports bf16 support. A CPU without them emulates bf16
through fp32 conversions and is slower in bf16 than in fp32, so there ``auto`` means fp32.

On Linux the CPU's instruction-set flags are read from /proc/cpuinfo (``avx512_bf16``, ``amx_bf16``).
``torch.backends.mkldnn`` has its own bf16 check, but it also says yes for plain AVX-512 (where
oneDNN emulates bf16), so it is not used for the decision. Elsewhere (macOS, Windows) the answer
is no: fp32 is the safe default. ``ATTNLAB_CPU_BF16=0`` or ``=1`` overrides the detection (a
machine whose flags lie, or a test); :func:`cpu_bf16_flags` is the one place tests patch.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

__all__ = ["asked_bf16", "cpu_bf16_flags", "native_bf16", "resolve_inference_dtype", "BF16_FLAGS", "INFERENCE_DTYPES"]

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def _proc_cpuinfo_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_bf16_flags() -> tuple[str, ...]:
    """The bf16 instruction sets of this CPU that torch's kernels use (a subset of
    :data:`BF16_FLAGS`; empty when unknown). Empty too when torch runs its CPU kernels below
    AVX-512 (``ATEN_CPU_CAPABILITY=avx2`` or ``default``): its bf16 kernels (flash attention's
    VNNI packing among them) then are missing or emulated, whatever the CPU has."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AMX", "AVX512_BF16"):
        return ()
    flags = _proc_cpuinfo_flags()
    return tuple(f for f in BF16_FLAGS if f in flags)


def native_bf16(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(whether ``device`` computes bf16 natively, the reason in words), e.g.
    ``(True, "this CPU has avx512_bf16, amx_bf16")``."""
    device = torch.device(device)
    if device.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return ok, f"this GPU {'supports' if ok else 'does not support'} bf16"
    if device.type != "cpu":
        return False, f"no bf16 detection for {device.type} devices"
    flags = cpu_bf16_flags()
    if flags:
        return True, f"this CPU has {', '.join(flags)}"
    return False, "this CPU has no native bf16 instructions (avx512_bf16 or amx_bf16)"


def asked_bf16(device: torch.device | str = "cpu") -> str:
    """The reason line for an explicit bf16 choice: "asked for", with a warning where ``device``
    only emulates bf16 (several times slower than fp32 there, on transformers' model as on attnlab's;
    benchmarks/results/code.md)."""
    native, why = native_bf16(device)
    if native or torch.device(device).type != "cpu":
        return "asked for"
    return f"asked for; warning: {why}, so bf16 is emulated and several times slower than fp32 here"


INFERENCE_DTYPES = ("auto", "fp32", "bf16")


def resolve_inference_dtype(choice: str, device: torch.device | str = "cpu") -> tuple[torch.dtype | None, str]:
    """``--dtype`` of the inference commands -> (the dtype for
    :func:`attnlab.nn.set_inference_dtype`, None for fp32; the reason in words). "auto" is bf16
    where ``device`` computes it natively (the large weights' products then read half the bytes;
    benchmarks/results/code.md), fp32 elsewhere."""
    if choice not in INFERENCE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(INFERENCE_DTYPES)}, got {choice!r}")
    if choice != "auto":
        return (torch.bfloat16 if choice == "bf16" else None), ("asked for" if choice != "bf16" else asked_bf16(device))
    native, why = native_bf16(device)
    return (torch.bfloat16 if native else None), f"auto: {why}"
