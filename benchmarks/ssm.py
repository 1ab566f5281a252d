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
4. All contenders of one family and length are timed round-robin in one process. Peak memory:
each contender's call runs again in a fresh process (benchmarks/_memory.py) that builds the same
models, warms the call up at 16 tokens, and reads the high-water mark of its resident memory during
one call at the length, above its resident memory before it; that process runs under an
address-space cap (``--cap-gib``, default 6), and a call that would need more reads "over the
cap" instead of taking the machine down (torch.profiler's record of every allocation, the
previous meter, itself took 17 GB at 2048 tokens). The GPT is attnlab's
GPT-2 (4 heads, d_ff 1024, context the length). Ratios are against the family's transformers model.
attnlab's Mamba-3 (its own initialisation; transformers has none) runs beside the Mamba family.
With ``--mambapy-path`` (or mambapy importable), mambapy's pure-PyTorch Mamba (its ``Mamba`` layers
under an embedding, a final RMSNorm and a head, as its own LM has them) joins the Mamba family with
the same weights, in its parallel scan (``pscan=True``) and its sequential loop; the script checks
that its logits equal attnlab's before timing. transformers' slow path at long lengths takes many
minutes per forward+backward call: above ``--reference-max-length`` it (and mambapy's sequential
loop) runs forward only. With ``--json FILE`` the rows are kept in FILE, rewritten after every
(length, mode), and the table is printed from it; ``--resume`` measures only the rows it lacks,
and ``--only`` re-measures the contenders named (their ratios against rows of another process are
then marked).
Times: by default the CPU time of the process (``time.process_time``; pass ``--threads 1`` so that
it is the time of one thread), which another job on a shared machine inflates far less than the
wall clock; ``--clock wall`` for wall-clock seconds. The column "time vs GPT" divides each
time by the GPT's at the same mode and length.
``--models rwkv``: attnlab's RWKV-4 (the chunked WKV of ``attnlab.nn.wkv``) against transformers'
RwkvForCausalLM on its CPU path (a Python loop over the positions), same weights, d_ff 4 d_model,
with attnlab's RWKV-7 (the chunked delta rule, heads of 64) of the same width and depth, and the GPT.

Usage:
  python benchmarks/ssm.py --markdown                   # both families, lengths 128, 512
  python benchmarks/ssm.py --markdown --models mamba --lengths 128,512,2048 --threads 1 --budget 3 \
      --repeats 3 --mambapy-path /tmp/mambapy --json /tmp/ssm_mamba.json   # the README's Mamba table
  python benchmarks/ssm.py ...the same... --resume --only 'attnlab Mamba ('  # attnlab's Mamba rows again
  python benchmarks/ssm.py --markdown --models mamba2 --lengths 128,512,2048
  python benchmarks/ssm.py --markdown --models rwkv     # RWKV-4 and RWKV-7
  python benchmarks/ssm.py --quick                      # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memory as M  # noqa: E402
from _util import Timing, cpu_seconds, environment, fmt_mib, fmt_ms, lm_call, render_table, time_calls  # noqa: E402

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


def _time(fns, clock: str, repeats: int, budget: float) -> tuple[dict, set]:
    """{name: Timing} and the names whose call was refused memory under the cap: a warm-up call
    each, then calls round-robin, as many as ``budget`` seconds allow up to ``repeats``, timed by
    ``time.process_time`` (``--clock cpu``) or the wall clock."""
    over = set()
    for name, fn in fns.items():
        try:
            fn()
        except (RuntimeError, MemoryError) as e:
            if not M.is_out_of_memory(e):
                raise
            over.add(name)
    fns = {n: fn for n, fn in fns.items() if n not in over}
    if clock == "wall":
        return time_calls(fns, warmup=0, repeats=repeats, min_repeats=1, budget_s=budget), over

    times = {name: Timing([cpu_seconds(fn)]) for name, fn in fns.items()}
    wanted = {name: max(1, min(repeats, int(budget / max(t.times[0], 1e-9)))) for name, t in times.items()}
    while any(times[n].n < wanted[n] for n in fns):
        for name, fn in fns.items():
            if times[name].n < wanted[name]:
                times[name].times.append(cpu_seconds(fn))
    return times, over


def _calls(models, ids, mode: str):
    return {name: lm_call(m, ids, mode) for name, m in models.items()}


def _slow_loop(name: str) -> bool:
    """The contenders that loop over the positions in Python: out of forward+backward above
    --reference-max-length."""
    return name.startswith("transformers MambaForCausalLM") or name == "mambapy (sequential)"


def _memory_child(a) -> int:
    """In a fresh process: build the family's models as the parent does, then for each --memory-cell
    a warm-up call at 16 tokens and the resident peak of one call at the cell's length."""
    torch.set_num_threads(1)
    models = _models(a.models, a.d_model, a.layers, 96, a.longest, a.quick, a.mambapy)
    M.cap_memory(int(a.cap_gib * M.GIB))
    for name, length, mode in a.memory_cell:
        try:
            _calls({name: models[name]}, torch.zeros(a.batch, min(16, int(length)), dtype=torch.long), mode)[name]()
            fn = _calls({name: models[name]}, torch.randint(0, 96, (a.batch, int(length))), mode)[name]
            M.report(cell=[name, int(length), mode], peak_bytes=M.peak_rss_during(fn))
        except (RuntimeError, MemoryError) as e:
            if not M.is_out_of_memory(e):
                raise
            M.report(cell=[name, int(length), mode], over_cap=True)
    return 0


def _peaks(family: str, cells: list[tuple], a) -> dict:
    """{(name, length, mode): resident peak bytes, or the reason there is none}, each cell's call
    in a fresh process (all of them in one with --quick) under the --cap-gib address-space cap."""
    argv = [__file__, "--models", family, "--batch", str(a.batch), "--d-model", str(a.d_model), "--layers",
            str(a.layers), "--longest", str(a.longest), "--cap-gib", str(a.cap_gib)] + \
        (["--quick"] if a.quick else []) + (["--mambapy-path", a.mambapy_path] if a.mambapy_path else [])
    out = {}
    for batch in ([cells] if a.quick else [[c] for c in cells]):
        args = [x for name, length, mode in batch for x in ("--memory-cell", name, str(length), mode)]
        results, failure = M.run_child(argv + args, timeout=a.memory_timeout * len(batch))
        got = {tuple(r["cell"]): r for r in results}
        for cell in batch:
            r = got.get(cell, {})
            out[cell] = r.get("peak_bytes", f"over the {a.cap_gib:g} GiB cap" if r.get("over_cap") else failure)
    return out


def _measure_rows(family: str, models: dict, wanted: list[str], ids, mode: str, a, run_id: str) -> list[dict]:
    """One row per contender of ``wanted``, times from this process, resident peaks from fresh
    ones; a slow loop above --reference-max-length gets a row that says it was not run."""
    length = ids.size(1)
    skip = {n for n in wanted if mode == "fwd+bwd" and length > a.reference_max_length and _slow_loop(n)}
    run = [n for n in wanted if n not in skip]
    times, over = _time(_calls({n: models[n] for n in run}, ids, mode), a.clock, a.repeats, a.budget)
    if a.memory and not a.quick:
        a.peaks.update(_peaks(family, [(n, length, mode) for n in run if n not in over], a))
    rows = []
    for name in wanted:
        row = {"family": family, "mode": mode, "length": length, "name": name, "run": run_id}
        if name in skip:
            row["not_run"] = f"forward+backward above --reference-max-length {a.reference_max_length}"
        elif name in over:
            row["not_run"] = f"over the {a.cap_gib:g} GiB memory cap"
        else:
            peak = a.peaks.get((name, length, mode), "not measured")
            row.update(median_s=times[name].median, times=times[name].times,
                       **({"peak_bytes": peak} if isinstance(peak, int) else {"peak_missing": peak}))
        rows.append(row)
    return rows


def _table(rows: list[dict], names: list[str]) -> tuple[list[list], list[str]]:
    """Table rows for the stored rows, in ``names``' order within each (family, length, mode), and
    the footnotes. Ratios are against the family's reference (its second contender) and the GPT
    at the same mode and length; a ratio of two rows measured in different processes is marked ¹."""
    by = {(r["family"], r["length"], r["mode"], r["name"]): r for r in rows}
    groups = list(dict.fromkeys((r["family"], r["length"], r["mode"]) for r in rows))
    order = {n: i for i, n in enumerate(names)}
    out, across = [], False

    def ratio(num, den, r, other, fmt):
        nonlocal across
        if num is None or den is None or other is None:
            return "-"
        mark = "" if other["run"] == r["run"] else "¹"
        across |= bool(mark)
        return format(num / den, fmt) + mark
    for family, length, mode in sorted(groups, key=lambda g: (g[0], g[1], g[2] != "fwd")):
        members = sorted((r for k, r in by.items() if k[:3] == (family, length, mode)),
                         key=lambda r: order.get(r["name"], len(order)))
        ref = by.get((family, length, mode, _REFERENCE[family]))
        gpt = by.get((family, length, mode, _GPT))
        ref = ref if ref and "median_s" in ref else None
        gpt = gpt if gpt and "median_s" in gpt else None
        for r in members:
            if "not_run" in r:
                out.append([mode, length, r["name"], "over the cap" if "cap" in r["not_run"] else "not run", 0,
                            "-", "-", "-", "-"])
                continue
            t, peak = r["median_s"], r.get("peak_bytes")
            out.append([mode, length, r["name"], fmt_ms(t), len(r["times"]),
                        fmt_mib(peak) if peak is not None else r.get("peak_missing", "-"),
                        ratio(ref and ref["median_s"], t, r, ref, ".1f"),
                        ratio(peak, ref and ref.get("peak_bytes"), r, ref if ref and ref.get("peak_bytes") else None, ".2f"),
                        ratio(t, gpt and gpt["median_s"], r, gpt, ".2f")])
    notes = ["¹ the two rows of this ratio were measured in different processes (a --resume with --only)"] if across else []
    return out, notes


_REFERENCE = {"mamba": "transformers MambaForCausalLM (slow path)",
              "mamba2": "transformers Mamba2ForCausalLM (torch_forward)",
              "rwkv": "transformers RwkvForCausalLM (CPU path)"}
_GPT = "attnlab GPT (SDPA), same width and depth"


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
                   help="longest length at which the Python loops over positions (transformers' Mamba slow path, "
                        "mambapy's sequential loop) run forward+backward (default 512: many minutes a call beyond)")
    p.add_argument("--mambapy-path", default=None,
                   help="folder holding the mambapy package (pip install --no-deps --target FOLDER mambapy); "
                        "without it mambapy runs only if it imports")
    p.add_argument("--cap-gib", type=float, default=6.0,
                   help="resident memory a peak-memory process may reach; over it the cell reads 'over the cap' (default 6)")
    p.add_argument("--memory-timeout", type=float, default=1800.0, help="wall seconds of one peak-memory process")
    p.add_argument("--no-memory", dest="memory", action="store_false", help="time only, no peak-memory processes")
    p.add_argument("--json", type=Path, default=None, help="keep the rows in this file, rewritten after every "
                   "(length, mode); the table is printed from it")
    p.add_argument("--resume", action="store_true", help="with --json: keep its rows, measure those it lacks")
    p.add_argument("--only", default="", help="comma-separated name prefixes: measure only these contenders "
                   "(with --resume their stored rows are replaced), e.g. 'attnlab Mamba (' for attnlab's Mamba")
    p.add_argument("--quick", action="store_true", help="tiny shapes and one call each (a smoke test)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--longest", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-cell", nargs=3, action="append", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        a.lengths, a.d_model, a.layers, a.batch, a.repeats, a.budget = "16,40", 32, 2, 2, 1, 0.0
    lengths = [int(n) for n in a.lengths.split(",")]
    a.longest = a.longest or max(lengths)
    a.only = [o for o in a.only.split(",") if o]
    if a.mambapy_path:
        sys.path.insert(0, a.mambapy_path)
    try:
        import mambapy.mamba  # noqa: F401
        a.mambapy = True
    except ImportError:
        a.mambapy = False
    warnings.filterwarnings("ignore")
    if a.memory_cell:
        return _memory_child(a)
    M.cap_memory(int(a.cap_gib * M.GIB))      # the timing process too: an oversized call fails, not the machine
    if a.resume and not (a.json and a.json.exists()):
        raise SystemExit("--resume needs --json FILE of an earlier run")
    stored = json.loads(a.json.read_text()) if a.resume else {"commands": [], "rows": []}
    stored["commands"].append("python benchmarks/ssm.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    header = environment("cpu", torch.float32) + f"; {os.cpu_count()} CPUs; " + \
        f"{'CPU time of the process' if a.clock == 'cpu' else 'wall clock'}"
    print(header)
    run_id = f"{datetime.datetime.now().isoformat(timespec='seconds')} pid {os.getpid()}"
    g = torch.Generator().manual_seed(0)
    names: list[str] = []
    for family in a.models.split(","):
        models = _models(family, a.d_model, a.layers, 96, a.longest, a.quick, a.mambapy)
        names += list(models)
        print(_check(models, torch.randint(0, 96, (a.batch, lengths[0]), generator=g)))
        a.peaks = {}
        if a.quick and a.memory:        # one process for every cell: a smoke test, seconds
            a.peaks = _peaks(family, [(n, length, mode) for length in lengths for mode in a.modes.split(",")
                                      for n in models if not (mode == "fwd+bwd" and length > a.reference_max_length
                                                              and _slow_loop(n))], a)
        for length in lengths:
            ids = torch.randint(0, 96, (a.batch, length), generator=g)
            for mode in a.modes.split(","):
                have = {r["name"] for r in stored["rows"] if (r["family"], r["length"], r["mode"]) == (family, length, mode)}
                wanted = [n for n in models if any(n.startswith(o) for o in a.only)] if a.only else \
                    [n for n in models if n not in have]
                if not wanted:
                    continue
                new = _measure_rows(family, models, wanted, ids, mode, a, run_id)
                stored["rows"] = [r for r in stored["rows"] if (r["family"], r["length"], r["mode"], r["name"]) not in
                                  {(n["family"], n["length"], n["mode"], n["name"]) for n in new}] + new
                if a.json:
                    a.json.write_text(json.dumps({**stored, "machine": header}, indent=1) + "\n")
                print(f"# measured {family} {mode} at {length}", file=sys.stderr, flush=True)
    print()
    shown = [r for r in stored["rows"] if r["family"] in a.models.split(",")]
    table, notes = _table(shown, names)
    print(render_table(["mode", "length", "implementation", "median ms", "calls", "peak MiB",
                        "speed vs transformers", "memory vs transformers", "time vs GPT"], table, markdown=a.markdown))
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
