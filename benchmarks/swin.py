"""Swin's speed: attnlab's SwinForImageClassification against transformers' (its default SDPA
attention), with the same weights, in images per second.

A Swin-T-shaped model (embed 96, depths 2, 2, 6, 2, heads 3, 6, 12, 24, window 7, 224 px, 1000
classes; stochastic depth off, so that training computes the same function in both) is built by
transformers with its own initialisation, written with ``save_pretrained`` and loaded by
``attnlab.from_pretrained``; the script checks that both give the same logits before timing.
Modes: ``inference`` (eval, no gradient) and ``training`` (train mode, forward, cross-entropy,
backward; the optimizer step, the same for both, is left out). Precisions: fp32, and bf16 under
``torch.autocast`` (native on CPUs with AVX512-BF16 or AMX). The contenders of one cell are timed
round-robin in one process, each call on two clocks: the wall clock, and the CPU time of the
process (``time.process_time``). On a machine shared with other jobs the wall clock counts the
time other processes held the cores; with one thread the CPU time counts only this call's own
work, so the ratios read from it (``--threads 1``) are the steadier ones.

Usage:
  python benchmarks/swin.py --markdown --threads 2          # batch 8, every mode and precision
  python benchmarks/swin.py --quick                         # a tiny Swin, one call each (smoke test)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, fmt_ms, render_table  # noqa: E402

import attnlab  # noqa: E402

SWIN_T = dict(image_size=224, patch_size=4, embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
              window_size=7, num_labels=1000)
QUICK = dict(image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4], window_size=4,
             num_labels=10)


def _models(sizes: dict):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    hf = transformers.SwinForImageClassification(transformers.SwinConfig(**sizes, drop_path_rate=0.0))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = attnlab.from_pretrained(d)
    return {"attnlab SwinForImageClassification": ours, "transformers SwinForImageClassification (sdpa)": hf}


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _check(models, x) -> str:
    ours, theirs = models.values()
    with torch.no_grad():
        a, b = _logits(ours.eval(), x), _logits(theirs.eval(), x)
    err = float((a - b).abs().max() / b.abs().max())
    if err > 1e-4:
        raise SystemExit(f"attnlab and transformers disagree: max |diff| = {err:.2e} of the logits' scale")
    return f"same weights: logits agree to {err:.1e} of their scale"


def _calls(models, x, labels, mode: str, precision: str):
    def autocast():
        return torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else nullcontext()

    def inference(m):
        def run():
            with torch.no_grad(), autocast():
                _logits(m, x)
        return run

    def training(m):
        def run():
            with autocast():
                loss = F.cross_entropy(_logits(m, x).float(), labels)
            loss.backward()
            for p in m.parameters():
                p.grad = None
        return run
    for m in models.values():
        m.train(mode == "training")
    return {name: (inference if mode == "inference" else training)(m) for name, m in models.items()}


def _time(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall seconds, median CPU seconds) per call of each callable: one warm-up call each,
    then ``repeats`` rounds, one call of each per round."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--modes", default="inference,training")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=3, help="timed calls of each contender per cell (default 3)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="a tiny Swin and one call each (a smoke test)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = QUICK if a.quick else SWIN_T
    if a.quick:
        a.batch, a.repeats = 2, 1
    warnings.filterwarnings("ignore")
    models = _models(sizes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.batch, 3, sizes["image_size"], sizes["image_size"], generator=g)
    labels = torch.randint(0, sizes["num_labels"], (a.batch,), generator=g)
    print(environment("cpu", torch.float32) + f"; {os.cpu_count()} CPUs; batch {a.batch}")
    print(_check(models, x))
    rows, ref = [], list(models)[1]
    for mode in a.modes.split(","):
        for precision in a.precisions.split(","):
            results = _time(_calls(models, x, labels, mode, precision), a.repeats)
            ref_wall, ref_cpu = results[ref]
            for name, (wall, cpu) in results.items():
                rows.append([mode, precision, name, fmt_ms(wall), fmt_ms(cpu), a.repeats, f"{a.batch / cpu:.2f}",
                             f"{ref_cpu / cpu:.2f}", f"{ref_wall / wall:.2f}"])
            print(f"# measured {mode} {precision}", file=sys.stderr, flush=True)
    print()
    print(render_table(["mode", "precision", "implementation", "wall ms", "CPU ms", "calls", "images/s (CPU)",
                        "speed vs transformers (CPU)", "(wall)"], rows, markdown=a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
