"""Mamba's and Mamba-2's speed and memory: attnlab's chunked scans against transformers'
pure-PyTorch paths (the ones it takes without the CUDA kernels), with the same weights, and a GPT
of the same width and depth (attnlab, SDPA attention) for scale.

``--models mamba``: transformers' MambaForCausalLM (d_model 256, 4 layers, state 16, expand 2,
vocabulary 96) against attnlab's Mamba (the chunked selective scan of attnlab.nn.ssm) and the GPT.
``--models mamba2``: transformers' Mamba2ForCausalLM (d_model 256, 4 layers, 8 heads of 64
channels, state 128, one group, its chunk 256; its torch_forward) against attnlab's Mamba2 (the
SSD of attnlab.nn.ssd). Each transformers model is built with its own initialisation, written with
``save_pretrained`` and loaded by ``attnlab.from_pretrained``: both hold the same numbers, which
the script checks (same logits at the shortest length) before timing. Modes: ``fwd`` (eval, no
gradient) and ``fwd+bwd`` (train mode, forward, the mean of the squared logits, backward). Batch
4. All contenders of one family and length are timed round-robin in one process; peak memory is
what torch's allocator handed out during one call (benchmarks/_util.py). The GPT is attnlab's
GPT-2 (4 heads, d_ff 1024, context the length). Ratios are against the family's transformers model.
attnlab's Mamba-3 (its own initialisation; transformers has none) runs beside the Mamba family.
With ``--mambapy-path`` (or mambapy importable), mambapy's pure-PyTorch Mamba (its ``Mamba`` layers
under an embedding, a final RMSNorm and a head, as its own LM has them) joins the Mamba family with
the same weights, in its parallel scan (``pscan=True``) and its sequential loop; the script checks
that its logits equal attnlab's before timing. transformers' slow path at long lengths takes many
minutes per forward+backward call: above ``--reference-max-length`` it runs forward only.
Times: by default the CPU time of the process (``time.process_time``; pass ``--threads 1`` so that
it is the time of one thread), which another job on a shared machine inflates far less than the
wall clock; ``--clock wall`` for wall-clock seconds. The column "time vs GPT" divides each
time by the GPT's at the same mode and length.
``--models rwkv``: attnlab's RWKV-4 (the chunked WKV of ``attnlab.nn.wkv``) against transformers'
RwkvForCausalLM on its CPU path (a Python loop over the positions), same weights, d_ff 4 d_model,
with attnlab's RWKV-7 (the chunked delta rule, heads of 64) of the same width and depth, and the GPT.

Usage:
  python benchmarks/ssm.py --markdown                   # both families, lengths 128, 512
  python benchmarks/ssm.py --markdown --models mamba --lengths 128,512,2048 --threads 1 \
      --mambapy-path /tmp/mambapy                       # the Mamba table of benchmarks/README.md
  python benchmarks/ssm.py --markdown --models mamba2 --lengths 128,512,2048
  python benchmarks/ssm.py --markdown --models rwkv     # RWKV-4 and RWKV-7
  python benchmarks/ssm.py --quick                      # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import Timing, environment, fmt_mib, fmt_ms, measure, peak_memory, render_table  # noqa: E402

import attnlab  # noqa: E402
from attnlab.models import GPT, GPTConfig  # noqa: E402
from attnlab.models.mamba3 import Mamba3, Mamba3Config  # noqa: E402


def _from_transformers(hf):
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return attnlab.from_pretrained(d)


def _models(family: str, d_model: int, layers: int, vocab: int, longest: int, quick: bool, mambapy: bool):
    """name -> model, attnlab's first and transformers' (the reference of the ratios) second."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if family == "rwkv":
        return _rwkv_models(d_model, layers, vocab, longest)
    if family == "mamba2":
        heads = 2 if quick else 8
        config = transformers.Mamba2Config(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                                           state_size=16 if quick else 128, expand=2, conv_kernel=4,
                                           head_dim=2 * d_model // heads, num_heads=heads, n_groups=1,
                                           use_cache=False)
        hf = transformers.Mamba2ForCausalLM(config)
        return {"attnlab Mamba2 (chunked SSD)": _from_transformers(hf),
                "transformers Mamba2ForCausalLM (torch_forward)": hf}
    config = transformers.MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers, state_size=16,
                                      expand=2, conv_kernel=4, use_cache=False)
    hf = transformers.MambaForCausalLM(config)
    gpt = GPT(GPTConfig(vocab_size=vocab, n_positions=longest, d_model=d_model, num_heads=4, num_layers=layers,
                        dropout=0.0))
    # Mamba-3 at the authors' defaults (d_state 128, headdim 64, SISO, rope_fraction 0.5, chunk 64)
    mamba3 = Mamba3(Mamba3Config(vocab_size=vocab, d_model=d_model, num_layers=layers))
    return {"attnlab Mamba (chunked scan)": _from_transformers(hf), "transformers MambaForCausalLM (slow path)": hf,
            "attnlab GPT (SDPA), same width and depth": gpt, "attnlab Mamba-3 (chunked, SISO)": mamba3,
            **(_mambapy_models(hf) if mambapy else {})}


class _MambapyLM(torch.nn.Module):
    """mambapy's Mamba layers with the embedding, final RMSNorm and tied head around them."""

    def __init__(self, mp, config, vocab: int):
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, config.d_model)
        self.mamba = mp.Mamba(config)
        self.norm_f = mp.RMSNorm(config.d_model, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(config.d_model, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, ids):
        return self.lm_head(self.norm_f(self.mamba(self.embedding(ids))))


def _mambapy_models(hf) -> dict:
    """mambapy with ``hf``'s weights (transformers' names with mambapy's prefixes), its parallel
    scan and its sequential loop."""
    from mambapy import mamba as mp      # only its Mamba: its LM module imports einops for Mamba-2
    c = hf.config
    prefixes = {"backbone.embeddings.": "embedding.", "backbone.layers.": "mamba.layers.", "backbone.norm_f.": "norm_f."}
    weights = {}
    for key, value in hf.state_dict().items():
        for theirs, ours in prefixes.items():
            key = key.replace(theirs, ours)
        weights[key] = value
    out = {}
    for name, parallel in (("mambapy (pscan)", True), ("mambapy (sequential)", False)):
        config = mp.MambaConfig(d_model=c.hidden_size, n_layers=c.num_hidden_layers, d_state=c.state_size,
                                expand_factor=c.expand, d_conv=c.conv_kernel, dt_rank=c.time_step_rank,
                                rms_norm_eps=c.layer_norm_epsilon, bias=c.use_bias, conv_bias=c.use_conv_bias,
                                pscan=parallel)
        out[name] = _MambapyLM(mp, config, c.vocab_size)
        out[name].load_state_dict(weights)
    return out


def _rwkv_models(d_model: int, layers: int, vocab: int, longest: int):
    import transformers
    from attnlab.models.rwkv7 import RWKV7
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.RwkvConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers,
                                     rescale_every=0, use_cache=False)
    hf = transformers.RwkvForCausalLM(config)
    rwkv7 = RWKV7.for_kind("causal-lm").build(RWKV7.build_config(
        vocab_size=vocab, context=longest, d_model=d_model, num_heads=max(1, d_model // 64), num_layers=layers))
    gpt = GPT(GPTConfig(vocab_size=vocab, n_positions=longest, d_model=d_model, num_heads=4, num_layers=layers,
                        dropout=0.0))
    return {"attnlab RWKV-4 (chunked WKV)": _from_transformers(hf), "transformers RwkvForCausalLM (CPU path)": hf,
            "attnlab RWKV-7 (chunked delta rule)": rwkv7, "attnlab GPT (SDPA), same width and depth": gpt}


def _logits(model, ids):
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _check(models, ids) -> str:
    """transformers' logits (and mambapy's, when it runs) against attnlab's, same weights."""
    names = list(models)
    with torch.no_grad():
        ours = _logits(models[names[0]].eval(), ids)
        errs = {n: float((_logits(models[n].eval(), ids) - ours).abs().max() / ours.abs().max())
                for n in names[1:2] + [n for n in names if n.startswith("mambapy")]}
    for name, err in errs.items():
        if err > (1e-4 if name == names[1] else 1e-5):
            raise SystemExit(f"{names[0]} and {name} disagree: max |diff| = {err:.2e} of the logits' scale")
    return "same weights: logits agree " + ", ".join(f"with {n} to {e:.1e}" for n, e in errs.items()) + \
        f" of their scale at length {ids.size(1)}"


def _measure(fns, clock: str, repeats: int, budget: float):
    """{name: (Timing, peak bytes)}: _util.measure for the wall clock; for the CPU clock the same
    steps (a warm-up call, a call for the peak memory, then calls round-robin, as many as
    ``budget`` seconds allow up to ``repeats``) timed by ``time.process_time``."""
    if clock == "wall":
        return measure(fns, repeats=repeats, min_repeats=1, budget_s=budget)
    for fn in fns.values():
        fn()
    peaks = {name: peak_memory(fn) for name, fn in fns.items()}

    def once(fn) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    times = {name: Timing([once(fn)]) for name, fn in fns.items()}
    wanted = {name: max(1, min(repeats, int(budget / max(t.times[0], 1e-9)))) for name, t in times.items()}
    while any(times[n].n < wanted[n] for n in fns):
        for name, fn in fns.items():
            if times[name].n < wanted[name]:
                times[name].times.append(once(fn))
    return {name: (times[name], peaks[name]) for name in fns}


def _calls(models, ids, mode: str):
    def fwd(m):
        def run():
            with torch.no_grad():
                _logits(m, ids)
        return run

    def fwd_bwd(m):
        def run():
            _logits(m, ids).float().square().mean().backward()
            for p in m.parameters():
                p.grad = None
        return run
    for m in models.values():
        m.train(mode == "fwd+bwd")
    return {name: (fwd if mode == "fwd" else fwd_bwd)(m) for name, m in models.items()}


def _rows(models, ids, mode: str, a) -> list[list]:
    """One table row per contender; transformers' Mamba sits out forward+backward above
    --reference-max-length (its row says so) and the ratios against it are then '-'."""
    names, length = list(models), ids.size(1)
    reference, gpt = names[1], next((n for n in names if n.startswith("attnlab GPT")), None)
    skip = mode == "fwd+bwd" and length > a.reference_max_length and names[1].startswith("transformers Mamba")
    fns = _calls({n: m for n, m in models.items() if not (skip and n == reference)}, ids, mode)
    results = _measure(fns, a.clock, a.repeats, a.budget)
    rows = []
    for name in names:
        if name not in results:
            rows.append([mode, length, name, "not run", 0, "-", "-", "-", "-"])
            continue
        timing, peak = results[name]
        ref = results.get(reference)
        rows.append([mode, length, name, fmt_ms(timing.median), timing.n, fmt_mib(peak),
                     f"{ref[0].median / timing.median:.1f}" if ref else "-",
                     f"{peak / max(ref[1], 1):.2f}" if ref else "-",
                     f"{timing.median / results[gpt][0].median:.2f}" if gpt else "-"])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--models", default="mamba,mamba2", help="comma-separated families: mamba, mamba2, rwkv (default mamba,mamba2)")
    p.add_argument("--lengths", default="128,512", help="comma-separated sequence lengths (default 128,512)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--modes", default="fwd,fwd+bwd")
    p.add_argument("--repeats", type=int, default=5, help="most timed calls per measurement (default 5)")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed calls per contender (default 20)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="time.process_time of the process (default) or the wall clock")
    p.add_argument("--reference-max-length", type=int, default=512,
                   help="longest length at which transformers' Mamba runs forward+backward (default 512: "
                        "its slow path takes many minutes a call beyond)")
    p.add_argument("--mambapy-path", default=None,
                   help="folder holding the mambapy package (pip install --no-deps --target FOLDER mambapy); "
                        "without it mambapy runs only if it imports")
    p.add_argument("--quick", action="store_true", help="tiny shapes and one call each (a smoke test)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.lengths, a.d_model, a.layers, a.batch, a.repeats, a.budget = "16,40", 32, 2, 2, 1, 0.0
    lengths = [int(n) for n in a.lengths.split(",")]
    if a.mambapy_path:
        sys.path.insert(0, a.mambapy_path)
    try:
        import mambapy.mamba  # noqa: F401
        mambapy = True
    except ImportError:
        mambapy = False
    warnings.filterwarnings("ignore")
    g = torch.Generator().manual_seed(0)
    print(environment("cpu", torch.float32) + f"; {os.cpu_count()} CPUs; "
          f"{'CPU time of the process' if a.clock == 'cpu' else 'wall clock'}")
    rows = []
    for family in a.models.split(","):
        models = _models(family, a.d_model, a.layers, 96, max(lengths), a.quick, mambapy)
        print(_check(models, torch.randint(0, 96, (a.batch, lengths[0]), generator=g)))
        for length in lengths:
            ids = torch.randint(0, 96, (a.batch, length), generator=g)
            for mode in a.modes.split(","):
                rows += _rows(models, ids, mode, a)
                print(f"# measured {family} {mode} at {length}", file=sys.stderr, flush=True)
    print()
    print(render_table(["mode", "length", "implementation", "median ms", "calls", "peak MiB",
                        "speed vs transformers", "memory vs transformers", "time vs GPT"], rows, markdown=a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
