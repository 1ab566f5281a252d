"""Time and peak memory against the sequence length: attnlab's Mamba, Mamba-2, Mamba-3 and RWKV-7
beside attnlab's GPT (SDPA attention) of the same width and depth, forward and forward+backward,
from 256 to 8,192 tokens. The scans' cost grows linearly with the length, attention's time
quadratically.

Sizes: d_model 256, 4 layers, vocabulary 96, batch 1, fp32 (Mamba: state 16, expand 2; Mamba-2:
8 heads of 64 channels, state 128, chunk 64; Mamba-3 at the authors' defaults, state 128, heads of
64; RWKV-7: heads of 64, d_ff 1024; GPT: 4 heads, d_ff 1024, context the longest length). Modes:
``fwd`` (eval, no gradient) and ``fwd+bwd`` (train mode, the mean of the squared logits,
backward). Time: CPU seconds of one thread (``torch.set_num_threads(1)``, ``time.process_time``),
the best of ``--repeats`` calls after one untimed call; on a shared machine wall time would
measure the other jobs. Peak memory: what torch's CPU allocator handed out during that untimed
call, above what was allocated before it (``benchmarks/_util.py``'s ``peak_memory``). A cell whose
first call takes more than ``--cap`` CPU seconds is measured once; a model whose call passed the
cap is not run at longer lengths in that mode (the JSON then lacks those rows and says so).

The numbers go to ``docs/figures/measured/ssm_scaling.json`` and the figure
``docs/figures/measured/ssm_scaling.png`` is drawn from them (log-log, a time panel and a memory
panel, a line per model, solid forward+backward, dashed forward, grey slopes for L and L²);
``--replot`` redraws the figure from the JSON alone. The PNG's metadata carries the SHA-256 of the
JSON's rows it was drawn from. The JSON is rewritten after every cell, so a run that is killed
keeps what it measured. Peak memory on CPU comes from the profiler's record of every allocation,
which itself costs memory: at 8,192 tokens Mamba-3's forward+backward under it reached 17.7 GB of
resident memory here and was killed, so the committed figure stops at 4,096.

Usage:
  python benchmarks/ssm_scaling.py --lengths 256,512,1024,2048,4096 --repeats 1   # the committed figure
  python benchmarks/ssm_scaling.py --replot             # redraw the PNG from the committed JSON
  python benchmarks/ssm_scaling.py --quick --out /tmp/s # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import fmt_mib, peak_memory, render_table  # noqa: E402

from attnlab.models import GPT, GPTConfig  # noqa: E402
from attnlab.models.mamba import Mamba, MambaConfig  # noqa: E402
from attnlab.models.mamba2 import Mamba2, Mamba2Config  # noqa: E402
from attnlab.models.mamba3 import Mamba3, Mamba3Config  # noqa: E402
from attnlab.models.rwkv7 import RWKV7  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "figures" / "measured"
NAME = "ssm_scaling"
VOCAB = 96
MODES = ("fwd", "fwd+bwd")
COLOURS = {"Mamba": "tab:blue", "Mamba-2": "tab:orange", "Mamba-3": "tab:green", "RWKV-7": "tab:red",
           "GPT (SDPA)": "black"}


def build_models(d_model: int, layers: int, longest: int, quick: bool) -> dict:
    """name -> attnlab model, all of width ``d_model`` and depth ``layers``."""
    torch.manual_seed(0)
    heads = 2 if quick else max(1, 2 * d_model // 64)
    state = 8 if quick else 128
    return {
        "Mamba": Mamba(MambaConfig(vocab_size=VOCAB, d_model=d_model, num_layers=layers, d_state=16, expand=2)),
        "Mamba-2": Mamba2(Mamba2Config(vocab_size=VOCAB, d_model=d_model, num_layers=layers, d_state=state,
                                       expand=2, head_dim=2 * d_model // heads, n_groups=1)),
        "Mamba-3": Mamba3(Mamba3Config(vocab_size=VOCAB, d_model=d_model, num_layers=layers, d_state=state,
                                       headdim=2 * d_model // heads)),
        "RWKV-7": RWKV7.for_kind("causal-lm").build(RWKV7.build_config(
            vocab_size=VOCAB, context=longest, d_model=d_model, num_heads=max(1, d_model // 64), num_layers=layers)),
        "GPT (SDPA)": GPT(GPTConfig(vocab_size=VOCAB, n_positions=longest, d_model=d_model, num_heads=4,
                                    num_layers=layers, dropout=0.0)),
    }


def _call(model, ids, mode: str):
    model.train(mode == "fwd+bwd")

    def fwd():
        with torch.no_grad():
            model(ids)

    def fwd_bwd():
        model(ids).float().square().mean().backward()
        for p in model.parameters():
            p.grad = None
    return fwd if mode == "fwd" else fwd_bwd


def _cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure_cell(model, ids, mode: str, repeats: int, cap: float, memory: bool = True) -> dict:
    """One (model, length, mode): peak bytes of an untimed first call (None without ``memory``: the
    call runs unprofiled), then the best CPU time."""
    fn = _call(model, ids, mode)
    t0 = time.process_time()
    peak = peak_memory(fn) if memory else fn()
    first = time.process_time() - t0          # under the profiler: only decides how many timed calls
    times = [_cpu_seconds(fn)]
    while len(times) < repeats and first < cap:
        times.append(_cpu_seconds(fn))
    return {"seconds": min(times), "calls": len(times), "peak_bytes": int(peak) if memory else None}


def run(models: dict, lengths: list[int], repeats: int, cap: float, data: dict, path: Path,
        time_only: set = frozenset()) -> None:
    """Every cell, shortest length first, into ``data["rows"]``, the JSON rewritten after each one
    (so a run killed part-way keeps what it measured); a (model, mode) past the cap stops there."""
    g = torch.Generator().manual_seed(0)
    rows, skipped, stopped = data["rows"], data["skipped"], set()
    done = {(r["model"], r["length"], r["mode"]) for r in rows}
    for length in lengths:
        ids = torch.randint(0, VOCAB, (1, length), generator=g)
        for name, model in models.items():
            for mode in MODES:
                if (name, length, mode) in done:
                    continue
                if (name, mode) in stopped:
                    skipped.append(f"{name} {mode} at {length}: an earlier length passed the cap of {cap:g} s")
                    continue
                memory = f"{name} {mode} {length}" not in time_only
                if not memory:
                    skipped.append(f"{name} {mode} at {length}: peak memory not measured (--time-only)")
                cell = measure_cell(model, ids, mode, repeats, cap, memory)
                rows.append({"model": name, "length": length, "mode": mode, **cell})
                path.write_text(json.dumps(data, indent=1) + "\n")
                if cell["seconds"] > cap:
                    stopped.add((name, mode))
                print(f"# {name} {mode} {length}: {cell['seconds']:.3f} s, {fmt_mib(cell['peak_bytes'] or 0)} MiB",
                      file=sys.stderr, flush=True)


def rows_digest(rows: list[dict]) -> str:
    """SHA-256 of the rows as the JSON holds them (sorted keys, no spaces): what the figure shows."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def series(rows: list[dict], key: str) -> dict:
    """(model, mode) -> ([lengths], [values]) of ``key`` ("seconds" or MiB for "peak_bytes"), by length."""
    out: dict = {}
    for r in sorted(rows, key=lambda r: r["length"]):
        if r[key] is None:
            continue
        value = r[key] / 2**20 if key == "peak_bytes" else r[key]
        xs, ys = out.setdefault((r["model"], r["mode"]), ([], []))
        xs.append(r["length"])
        ys.append(value)
    return out


def draw(rows: list[dict]):
    """The figure (matplotlib, Agg): time and memory against length, log-log."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    for ax, key, label in ((axes[0], "seconds", "CPU seconds (one thread)"), (axes[1], "peak_bytes", "peak MiB")):
        for (model, mode), (xs, ys) in series(rows, key).items():
            ax.plot(xs, ys, "o-" if mode == "fwd+bwd" else "s--", color=COLOURS.get(model, "grey"),
                    label=f"{model} {mode}", markersize=3.5, gid=f"{key}|{model}|{mode}")
        _slopes(ax, rows, key)
        lengths = sorted({r["length"] for r in rows})
        ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel=label)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.minorticks_off()
        ax.grid(True, which="major", alpha=0.25)
    axes[0].set_title("time: forward+backward (solid), forward (dashed)", fontsize=10)
    axes[1].set_title("peak memory of torch's allocator during one call", fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def _slopes(ax, rows: list[dict], key: str) -> None:
    """Grey guides through the smallest value at the shortest length: proportional to L and to L²."""
    lengths = sorted({r["length"] for r in rows})
    lo = min(r[key] for r in rows if r["length"] == lengths[0] and r[key] is not None) / (2**20 if key == "peak_bytes" else 1)
    for power, style in ((1, ":"), (2, "-.")):
        ax.plot(lengths, [lo * (n / lengths[0]) ** power for n in lengths], style, color="grey", linewidth=1,
                label=f"∝ L{'²' if power == 2 else ''}", gid=f"guide|{power}")


def save(data: dict, out: Path) -> Path:
    """Write the figure of ``data``'s rows to ``out``/ssm_scaling.png, the rows' digest in its metadata."""
    fig = draw(data["rows"])
    png = out / f"{NAME}.png"
    fig.savefig(png, dpi=110, metadata={"Description": f"rows sha256 {rows_digest(data['rows'])}"})
    return png


def table(rows: list[dict]) -> str:
    lengths = sorted({r["length"] for r in rows})
    by = {(r["model"], r["mode"], r["length"]): r for r in rows}
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for mode in MODES:
            cells = [by.get((model, mode, n)) for n in lengths]
            out.append([model, mode] + [f"{c['seconds'] * 1e3:.0f} / {fmt_mib(c['peak_bytes']) if c['peak_bytes'] else '-'}" if c else "-"
                                        for c in cells])
    return render_table(["model", "mode"] + [f"L={n}: ms / MiB" for n in lengths], out, markdown=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per cell, the best kept (default 2)")
    p.add_argument("--cap", type=float, default=60.0, help="CPU seconds: a cell over it is timed once, and its "
                   "model does not run longer lengths in that mode (default 60)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=OUT, help=f"folder of the JSON and PNG (default {OUT.relative_to(ROOT)})")
    p.add_argument("--resume", action="store_true", help="keep the rows of the JSON in --out, measure the rest")
    p.add_argument("--time-only", default="", help='cells timed without the memory profiler, e.g. "RWKV-7 fwd+bwd '
                   '4096" (comma-separated): its record of every allocation can exhaust the memory')
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out, measure nothing")
    p.add_argument("--quick", action="store_true", help="tiny shapes, lengths 16 and 32, one call (a smoke test)")
    a = p.parse_args(argv)
    path = a.out / f"{NAME}.json"
    if a.replot:
        print(save(json.loads(path.read_text()), a.out))
        return 0
    if a.quick:
        a.lengths, a.d_model, a.layers, a.repeats = "16,32", 32, 2, 1
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    lengths = [int(n) for n in a.lengths.split(",")]
    models = build_models(a.d_model, a.layers, max(lengths), a.quick)
    data = {"what": "CPU seconds of one thread (best of the timed calls) and peak bytes of torch's CPU allocator "
                    "during one call, batch 1, fp32",
            "command": "python benchmarks/ssm_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "config": {"d_model": a.d_model, "layers": a.layers, "vocab": VOCAB, "batch": 1, "lengths": lengths,
                       "models": list(models), "modes": list(MODES), "cap_s": a.cap},
            "skipped": [], "rows": []}
    if a.resume:
        old = json.loads(path.read_text())
        data.update(command=old["command"] + f" (resumed: {data['command']})", rows=old["rows"], skipped=old["skipped"])
    a.out.mkdir(parents=True, exist_ok=True)
    run(models, lengths, a.repeats, a.cap, data, path, {c.strip() for c in a.time_only.split(",") if c.strip()})
    rows = data["rows"]
    print(table(rows))
    print(path, save(data, a.out), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
