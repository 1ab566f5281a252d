"""Vision speed: attnlab's image classifiers against transformers' (sdpa attention), same weights, one process.

Each model pair is built by one function of :data:`PAIRS` (ViT-S/16 and Swin-T; the next family adds
its own function and a line there). The transformers model is built with its own
initialisation, written with ``save_pretrained`` and loaded by ``attnlab.from_pretrained``: both
hold the same numbers, which the script checks (logits, and the training loss) before timing.
timm's model of the same name is a third contender when timm imports (installed apart with
``--no-deps``, see the Usage; :func:`_import_torchvision` for the CUDA-built torchvision beside a
CPU torch); otherwise the output says why it is missing. The target lines compare attnlab with
each reference.

  inference  ``model(pixel_values)`` under torch.inference_mode(), eval mode. attnlab: what
             ``attnlab.from_pretrained(dir)`` returns (its InferenceLinear layers); transformers:
             ``ViTForImageClassification.from_pretrained(dir, attn_implementation="sdpa")``.
  training   one step in train mode: forward, cross-entropy over the 1000 classes, backward,
             AdamW step, zero_grad. attnlab: its optimizer builder (``attnlab.train.build_optimizer``:
             torch's fused AdamW); transformers and timm: ``torch.optim.AdamW(fused=True)``
             (transformers' Trainer default for torch >= 2.8).

Precisions: fp32, and bf16 autocast (fp32 weights, ``torch.autocast("cpu", bfloat16)`` around the
forward and the loss, on every side alike). bf16 tables are skipped on a CPU without native bf16
(avx512_bf16 or amx_bf16), where bf16 is emulated. Contenders of one table are timed round-robin
(benchmarks/_util.py), the reference also a second time ("A/A: again") to show the run's noise.
Peak MiB: what torch's allocator handed out during one call, above what existed before it.
Ratio = transformers' median time / this median time (above 1: faster than transformers).
``--clock cpu`` times each call by the process's CPU time instead of the wall clock (a fixed
``--repeats`` calls each, round-robin): the figure to read on a machine shared with other jobs,
with ``--threads 1``.

Usage:
  python benchmarks/vision.py --markdown               # ViT-S/16, 224 px, batch 8 (~10 minutes on 2 cores)
  python benchmarks/vision.py --threads 1 --clock cpu --markdown   # on a machine shared with other jobs
  python benchmarks/vision.py --quick                  # tiny shapes, seconds (the smoke test)
  pip install --no-deps --target /tmp/vspeed-pkgs timm==1.0.31 torchvision==0.28.0   # the timm row, torch untouched
  PYTHONPATH=/tmp/vspeed-pkgs python benchmarks/vision.py --threads 1 --clock cpu --markdown
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _util import Timing, environment, fmt_mib, fmt_ms, measure, peak_memory, render_table  # noqa: E402

import attnlab  # noqa: E402
from attnlab.nn.precision import native_bf16  # noqa: E402
from attnlab.train import TrainConfig, build_optimizer  # noqa: E402

TARGET = 1.2
AA = "transformers (A/A: again)"
LR = 1e-9


@dataclass
class Pair:
    """One model pair: the models by name (attnlab first, transformers second, then any other
    reference), the input size, the number of classes and a line describing the shape."""
    title: str
    models: dict
    image_size: int
    num_classes: int
    shape: str


def _import_torchvision() -> None:
    """Import torchvision where it is installed, before transformers or timm do. timm imports it,
    and the torchvision wheels that match a CPU-only torch on PyPI are CUDA builds: their C
    extension cannot load (it links libtorch_cuda.so), and torchvision's own import then stops at
    registering meta kernels for the two operators the extension would have declared
    (``RuntimeError: operator torchvision::nms does not exist``); transformers, finding
    torchvision installed, fails with it. Neither ViT calls a torchvision operator, so on exactly
    that failure the two schemas are declared, with no kernel behind them, and the import is tried
    once more. Nothing changes where torchvision imports, or is absent."""
    global _TORCHVISION_SCHEMAS
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        return
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            raise
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")      # kept alive: it owns the schemas
    for op in ("nms", "qnms"):
        _TORCHVISION_SCHEMAS.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision  # noqa: F401


def _timm_vit(ours, name: str):
    """timm's ``name`` holding the weights of ``ours`` (attnlab's VisionTransformer, loaded from the
    transformers checkpoint; its names are attnlab's own, and its Q/K/V projection is already
    fused as timm's), or (None, why not)."""
    try:
        import timm
    except Exception as e:                    # not installed, or torchvision fails in another way
        return None, f"timm is not usable here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    c = ours.config
    # the sizes are vit_small_patch16_224's own at the full shape; passed, so --quick's tiny one builds too
    model = timm.create_model(name, pretrained=False, num_classes=c.num_labels, img_size=c.image_size,
                              patch_size=c.patch_size, embed_dim=c.d_model, depth=c.num_layers, num_heads=c.num_heads,
                              mlp_ratio=c.d_ff / c.d_model)
    sd = ours.state_dict()
    names = {"patch_embed.proj": "patch_embed.proj", "norm": "norm", "head": "head"}
    for i in range(c.num_layers):
        names.update({f"blocks.{i}.{t}": f"layers.{i}.{o}" for t, o in (
            ("attn.qkv", "self_attn.qkv_proj"), ("attn.proj", "self_attn.out_proj"), ("norm1", "self_attn_norm"),
            ("mlp.fc1", "ff.linear1"), ("mlp.fc2", "ff.linear2"), ("norm2", "ff_norm"))})
    theirs = {f"{t}.{p}": sd[f"{o}.{p}"] for t, o in names.items() for p in ("weight", "bias")}
    theirs["cls_token"], theirs["pos_embed"] = sd["cls_token"], sd["position.weight"]
    model.load_state_dict(theirs)
    return model, None


def vit_small(quick: bool) -> tuple[Pair, list[str]]:
    """ViT-S/16 at 224 px (width 384, 12 layers, 6 heads, MLP 1536, 1000 classes; 22M parameters),
    LayerNorm eps 1e-6 (timm's, so that all three sides compute the same function)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    shape = dict(image_size=224, patch_size=16, hidden_size=384, num_hidden_layers=12, num_attention_heads=6,
                 intermediate_size=1536, num_labels=1000)
    if quick:
        shape.update(image_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     num_labels=10)
    config = transformers.ViTConfig(**shape, layer_norm_eps=1e-6, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, architectures=["ViTForImageClassification"])
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.ViTForImageClassification(config).save_pretrained(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = transformers.ViTForImageClassification.from_pretrained(d, attn_implementation="sdpa")
        ours = attnlab.from_pretrained(d)
    models = {"attnlab VisionTransformer (from_pretrained)": ours, "transformers ViTForImageClassification (sdpa)": ref}
    notes = []
    timm_model, why = _timm_vit(ours, "vit_small_patch16_224")
    if timm_model is None:
        notes.append(f"timm vit_small_patch16_224 left out: {why}")
    else:
        models["timm vit_small_patch16_224"] = timm_model
    desc = (f"{shape['num_hidden_layers']} layers, width {shape['hidden_size']}, {shape['num_attention_heads']} heads, "
            f"MLP {shape['intermediate_size']}, patch {shape['patch_size']}, {shape['image_size']} px, "
            f"{shape['num_labels']} classes")
    return Pair("ViT-S/16", models, shape["image_size"], shape["num_labels"], desc), notes


def swin_tiny(quick: bool) -> tuple[Pair, list[str]]:
    """Swin-T at 224 px (embed 96, depths 2, 2, 6, 2, heads 3, 6, 12, 24, window 7, 1000 classes;
    28M parameters), built as benchmarks/swin.py builds it (stochastic depth off)."""
    from swin import QUICK, SWIN_T, _models as swin_models
    shape = QUICK if quick else SWIN_T
    desc = (f"embed {shape['embed_dim']}, depths {shape['depths']}, heads {shape['num_heads']}, window "
            f"{shape['window_size']}, {shape['image_size']} px, {shape['num_labels']} classes")
    return Pair("Swin-T", swin_models(shape), shape["image_size"], shape["num_labels"], desc), []


# one function per model pair; each returns (Pair, notes printed under the header)
PAIRS = {"vit-s16": vit_small, "swin-t": swin_tiny}


def _logits(model, x):
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _rel(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def _check(pair: Pair, x, labels, autocast: bool) -> float:
    """The largest relative difference of any contender's logits and loss from transformers'."""
    worst = 0.0
    names = list(pair.models)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        outs = {n: _logits(pair.models[n].eval(), x).float() for n in names}
    for n in names[:1] + names[2:]:
        worst = max(worst, _rel(outs[n], outs[names[1]]),
                    _rel(F.cross_entropy(outs[n], labels), F.cross_entropy(outs[names[1]], labels)))
    tol = 5e-2 if autocast else 1e-4
    if worst > tol:
        raise SystemExit(f"{pair.title} (autocast={autocast}): the contenders differ from transformers by "
                         f"{worst:.2e} relative, over {tol}")
    return worst


def _inference_calls(pair: Pair, x, autocast: bool) -> dict:
    def call(model):
        def run():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _logits(model, x)
        return run
    names = list(pair.models)
    for m in pair.models.values():
        m.eval()
    calls = {n: call(pair.models[n]) for n in names}
    return {**calls, AA: call(pair.models[names[1]])}


def _training_calls(pair: Pair, x, labels, autocast: bool) -> dict:
    def call(model, opt):
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(_logits(model, x).float(), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run
    names = list(pair.models)
    for m in pair.models.values():
        m.train()
    # a vanishing lr: the weights barely move, so every timed step computes (nearly) the same function
    ours = build_optimizer(pair.models[names[0]], TrainConfig(out_dir="unused", steps=1, lr=LR))
    calls = {names[0]: call(pair.models[names[0]], ours)}
    for n in names[1:]:
        calls[n] = call(pair.models[n], torch.optim.AdamW(pair.models[n].parameters(), lr=LR, fused=True))
    ref = pair.models[names[1]]
    return {**calls, AA: call(ref, torch.optim.AdamW(ref.parameters(), lr=LR, fused=True))}


def _cpu_measure(fns: dict, args) -> dict:
    """As _util.measure, timed by the process's CPU time instead of the wall clock: on a machine
    shared with other jobs a call descheduled for a while is slow on the wall clock only. With one
    thread a call's CPU time is its own work (more threads would add their spin-waits)."""
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    peaks = {name: peak_memory(fn) for name, fn in fns.items()}
    timings = {name: Timing() for name in fns}
    for _ in range(max(args.min_repeats, args.repeats)):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            timings[name].times.append(time.process_time() - t0)
    return {name: (timings[name], peaks[name]) for name in fns}


def table(pair: Pair, section: str, autocast: bool, batch: int, args) -> tuple[list, float, float]:
    """One table's rows, attnlab's speed ratio against each reference ({"transformers": ..., "timm":
    ...}: its median time / attnlab's) and the agreement checked before timing."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, pair.image_size, pair.image_size, generator=g)
    labels = torch.randint(0, pair.num_classes, (batch,), generator=g)
    diff = _check(pair, x, labels, autocast)
    fns = _inference_calls(pair, x, autocast) if section == "inference" else _training_calls(pair, x, labels, autocast)
    if args.clock == "cpu":
        results = _cpu_measure(fns, args)
    else:
        results = measure(fns, warmup=args.warmup, repeats=args.repeats, min_repeats=args.min_repeats,
                          budget_s=args.budget)
    names = list(fns)
    ref_t, ref_m = results[names[1]][0], results[names[1]][1]
    rows = [[n, fmt_ms(t.median), fmt_ms(min(t.times)), t.n, f"{batch / t.median:.1f}",
             f"{ref_t.median / t.median:.2f}",
             f"{min(ref_t.times) / min(t.times):.2f}", fmt_mib(peak), f"{peak / max(ref_m, 1):.2f}"]
            for n, (t, peak) in results.items()]
    ours = results[names[0]][0].median
    ratios = {n.split(" ")[0]: results[n][0].median / ours for n in names[1:] if n != AA}
    return rows, ratios, diff


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--models", default=",".join(PAIRS), help=f"comma-separated model pairs ({', '.join(PAIRS)})")
    p.add_argument("--sections", default="inference,training", help="comma-separated: inference, training")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (autocast)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10, help="most timed calls per contender (default 10)")
    p.add_argument("--min-repeats", type=int, default=3)
    p.add_argument("--budget", type=float, default=8.0, help="seconds of timed calls per contender (default 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time calls by the wall clock, or by the process's CPU time (--repeats calls each; for a "
                        "shared machine, with --threads 1)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few calls (a smoke test)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.batch, a.repeats, a.min_repeats, a.budget, a.warmup = 2, 2, 1, 0.0, 1
    pairs = [s.strip() for s in a.models.split(",") if s.strip()]
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    dtypes = [s.strip() for s in a.dtypes.split(",") if s.strip()]
    for what, given, allowed in (("--models", pairs, PAIRS), ("--sections", sections, ("inference", "training")),
                                 ("--dtypes", dtypes, ("fp32", "bf16"))):
        if not set(given) <= set(allowed):
            raise SystemExit(f"{what}: expected some of {', '.join(allowed)}, got {','.join(given)!r}")
    warnings.filterwarnings("ignore")
    _import_torchvision()
    bf16_ok, why = native_bf16("cpu")
    print(f"# vision benchmark: {environment('cpu', torch.float32)}; {os.cpu_count()} CPUs; load average "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; bf16: {why}; batch {a.batch}; {a.clock} clock")
    headers = ["implementation", f"median {a.clock} ms", f"min {a.clock} ms", "calls", "images/s", "speed ratio",
               "min-time ratio",
               "peak MiB", "memory ratio"]
    targets = []
    for key in pairs:
        pair, notes = PAIRS[key](a.quick)
        print(f"# {pair.title}: {pair.shape}")
        for note in notes:
            print(f"# {note}")
        for section in sections:
            for dt in dtypes:
                autocast = dt == "bf16"
                if autocast and not bf16_ok and not a.quick:
                    print(f"\n(skipping {pair.title} {section} bf16: {why})")
                    continue
                rows, ratios, diff = table(pair, section, autocast, a.batch, a)
                what = "forward" if section == "inference" else "forward, backward, AdamW"
                title = f"{pair.title} {section} ({what}), {'bf16 autocast' if autocast else 'fp32'}"
                print(f"\n**{title}; ratio = transformers time / this time (logits agree to {diff:.1e} relative)**\n")
                print(render_table(headers, rows, markdown=a.markdown), flush=True)
                targets += [(title, ref, ratio) for ref, ratio in ratios.items()]
    print(f"\nTargets (attnlab >= {TARGET:.1f}x each reference, median):")
    for title, ref, ratio in targets:
        print(f"- {title}, against {ref}: {ratio:.2f}x {'met' if ratio >= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
