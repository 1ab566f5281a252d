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
measure the other jobs. Each cell (model, length, mode) runs in a fresh process
(``benchmarks/_memory.py``) under an address-space cap (``--cap-gib``, default 6): a cell that
would need more fails with "can't allocate memory" and is recorded as over the cap. Peak memory:
the high-water mark of that process's resident memory during the timed calls, above its resident
memory before them (``_memory.peak_rss_during``; glibc's mmap threshold fixed so that freed
blocks leave the resident set). Up to ``--allocator-max-length`` the child also runs one call
under the profiler of ``benchmarks/_util.py`` (what torch's allocator handed out, the previous
meter), kept in the JSON as ``allocator_bytes`` beside the resident figure ``peak_bytes``: the
profiler's record of every allocation itself exhausted the machine at 8,192 tokens, which the
resident meter does not. A cell whose first call takes more than ``--cap`` CPU seconds is timed
once; a model whose call passed the cap is not run at longer lengths in that mode (the JSON then
lacks those rows and says so).

The numbers go to ``docs/figures/measured/ssm_scaling.json`` and the figure
``docs/figures/measured/ssm_scaling.png`` is drawn from them (log-log, a time panel and a memory
panel, a line per model, solid forward+backward, dashed forward, grey slopes for L and L²);
``--replot`` redraws the figure from the JSON alone. The PNG's metadata carries the SHA-256 of the
JSON's rows it was drawn from. The JSON is rewritten after every cell, so a run that is killed
keeps what it measured, and ``--resume`` measures only the cells it lacks (delete a model's rows,
or pass ``--redo MODEL``, to measure them again).

Usage:
  python benchmarks/ssm_scaling.py --repeats 1          # the committed figure, 256 to 8,192
  python benchmarks/ssm_scaling.py --repeats 1 --resume --redo Mamba   # Mamba's rows again
  python benchmarks/ssm_scaling.py --replot             # redraw the PNG from the committed JSON
  python benchmarks/ssm_scaling.py --quick --out /tmp/s # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _memory as M  # noqa: E402
from _util import cpu_seconds, fmt_mib, lm_call, peak_memory, render_table  # noqa: E402

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


def measure_cell(model, ids, mode: str, repeats: int, cap: float, allocator: bool) -> dict:
    """One (model, length, mode), in the child: an untimed first call, then the timed calls with
    the resident peak over them, then, with ``allocator``, one call under the profiler. An
    allocation refused under the address-space cap gives ``over_cap`` (or ``allocator_over_cap``)."""
    fn = lm_call(model, ids, mode)
    try:
        first = cpu_seconds(fn)
        times: list[float] = []
        peak = M.peak_rss_during(lambda: times.extend(
            cpu_seconds(fn) for _ in range(repeats if first < cap else 1)))
    except (RuntimeError, MemoryError) as e:
        if not M.is_out_of_memory(e):
            raise
        return {"over_cap": True}
    out = {"seconds": min(times), "calls": len(times), "peak_bytes": int(peak)}
    if allocator:
        try:
            out["allocator_bytes"] = int(peak_memory(fn))
        except (RuntimeError, MemoryError) as e:
            if not M.is_out_of_memory(e):
                raise
            out["allocator_over_cap"] = True
    return out


def _child(a) -> int:
    """Measure the ``--cell`` cells in this process, one result line each (``_memory.report``)."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    models = build_models(a.d_model, a.layers, a.longest, a.quick)
    M.cap_memory(int(a.cap_gib * M.GIB))
    for name, length, mode in a.cell:
        ids = torch.randint(0, VOCAB, (1, int(length)), generator=torch.Generator().manual_seed(int(length)))
        M.report(cell=[name, int(length), mode],
                 **measure_cell(models[name], ids, mode, a.repeats, a.cap, int(length) <= a.allocator_max_length))
    return 0


def _measure(cells: list[tuple], a) -> tuple[dict, str]:
    """Run ``cells`` in one fresh process: {cell: its results}, and how the process failed (or "")."""
    argv = [__file__, "--repeats", str(a.repeats), "--cap", str(a.cap), "--cap-gib", str(a.cap_gib),
            "--allocator-max-length", str(a.allocator_max_length), "--d-model", str(a.d_model),
            "--layers", str(a.layers), "--longest", str(a.longest)] + (["--quick"] if a.quick else [])
    for name, length, mode in cells:       # --longest: the GPT's context, the same in every cell
        argv += ["--cell", name, str(length), mode]
    results, failure = M.run_child(argv, timeout=a.timeout * len(cells))
    return {tuple(r.pop("cell")): r for r in results}, failure


def run(names: list[str], lengths: list[int], a, data: dict, path: Path) -> None:
    """Every cell, shortest length first, each in its own process (all in one with --quick), into
    ``data["rows"]``, the JSON rewritten after each one (so a run killed part-way keeps what it
    measured); a (model, mode) past the CPU cap stops there, and one over the memory cap or whose
    process failed gets a row without figures and stops there too."""
    rows, skipped, stopped = data["rows"], data["skipped"], set()
    done = {(r["model"], r["length"], r["mode"]) for r in rows}
    cells = [(name, n, mode) for n in lengths for name in names for mode in MODES if (name, n, mode) not in done]
    while cells:
        batch, cells = (cells, []) if a.quick else (cells[:1], cells[1:])
        measured, failure = _measure(batch, a)
        for name, length, mode in batch:
            cell = measured.get((name, length, mode), {})
            row = {"model": name, "length": length, "mode": mode, "seconds": cell.get("seconds"),
                   "calls": cell.get("calls", 0), "peak_bytes": cell.get("peak_bytes"),
                   "allocator_bytes": cell.get("allocator_bytes")}
            if row["seconds"] is None:
                skipped.append(f"{name} {mode} at {length}: "
                               + (f"over the memory cap of {a.cap_gib:g} GiB" if cell.get("over_cap") else failure))
            if row["seconds"] is None or row["seconds"] > a.cap:
                stopped.add((name, mode))
            if cell.get("allocator_over_cap"):
                skipped.append(f"{name} {mode} at {length}: the allocator meter (profiler) passed the memory cap")
            rows.append(row)
            path.write_text(json.dumps(data, indent=1) + "\n")
            print(f"# {name} {mode} {length}: {row['seconds'] or 0:.3f} s, {fmt_mib(row['peak_bytes'] or 0)} MiB "
                  f"resident, {fmt_mib(row['allocator_bytes'] or 0)} MiB allocator {failure}", file=sys.stderr, flush=True)
        for name, length, mode in [c for c in cells if c[::2] in stopped]:
            skipped.append(f"{name} {mode} at {length}: an earlier length passed the cap")
        cells = [c for c in cells if c[::2] not in stopped]


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
    for ax, key, label in ((axes[0], "seconds", "CPU seconds (one thread)"), (axes[1], "peak_bytes", "peak MiB (resident)")):
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
    axes[1].set_title("peak resident memory of the process during a call, above its own", fontsize=10)
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
            out.append([model, mode] + [
                "-" if c is None else "over the cap" if c["seconds"] is None else
                f"{c['seconds'] * 1e3:.0f} / {fmt_mib(c['peak_bytes']) if c['peak_bytes'] else '-'}" for c in cells])
    return render_table(["model", "mode"] + [f"L={n}: ms / MiB" for n in lengths], out, markdown=True)


def meters_agree(rows: list[dict]) -> str:
    """One line: how the resident peak compares with the allocator's where both were measured."""
    pairs = [(r["peak_bytes"], r["allocator_bytes"]) for r in rows if r.get("allocator_bytes") and r["peak_bytes"]]
    if not pairs:
        return "no cell has both meters"
    ratios = [rss / alloc for rss, alloc in pairs]
    big = [rss / alloc for rss, alloc in pairs if alloc >= 64 * 2**20]
    return (f"resident / allocator peak over {len(pairs)} cells: {min(ratios):.3f} to {max(ratios):.3f}"
            + (f" ({min(big):.3f} to {max(big):.3f} where the allocator's is 64 MiB or more)" if big else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per cell, the best kept (default 2)")
    p.add_argument("--cap", type=float, default=60.0, help="CPU seconds: a cell over it is timed once, and its "
                   "model does not run longer lengths in that mode (default 60)")
    p.add_argument("--cap-gib", type=float, default=6.0, help="resident memory a cell's process may reach: "
                   "over it the cell is recorded as over the cap (default 6)")
    p.add_argument("--allocator-max-length", type=int, default=4096, help="longest length whose cells also run "
                   "one call under the profiler's allocator meter (default 4096; 0: none)")
    p.add_argument("--timeout", type=float, default=1800.0, help="wall seconds a cell's process may run (default 1800)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=OUT, help=f"folder of the JSON and PNG (default {OUT.relative_to(ROOT)})")
    p.add_argument("--resume", action="store_true", help="keep the rows of the JSON in --out, measure the rest")
    p.add_argument("--redo", default="", help="with --resume: models (comma-separated) whose rows are measured again")
    p.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out, measure nothing")
    p.add_argument("--quick", action="store_true", help="tiny shapes, lengths 16 and 32, one call (a smoke test)")
    p.add_argument("--cell", nargs=3, action="append", help=argparse.SUPPRESS)
    p.add_argument("--longest", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.cell:
        return _child(a)
    path = a.out / f"{NAME}.json"
    if a.replot:
        print(save(json.loads(path.read_text()), a.out))
        return 0
    if a.quick:
        a.lengths, a.d_model, a.layers, a.repeats = "16,32", 32, 2, 1
    lengths = [int(n) for n in a.lengths.split(",")]
    a.longest = max(lengths)
    names = list(COLOURS)
    redo = {m.strip() for m in a.redo.split(",") if m.strip()}
    if redo - set(names):
        raise SystemExit(f"--redo: no model named {sorted(redo - set(names))[0]!r} (models: {', '.join(names)})")
    data = {"what": "CPU seconds of one thread (best of the timed calls); peak_bytes: the resident high-water mark "
                    "of the cell's own process during the timed calls above its resident memory before them; "
                    "allocator_bytes: peak of torch's CPU allocator during one profiled call; batch 1, fp32",
            "command": "python benchmarks/ssm_scaling.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "config": {"d_model": a.d_model, "layers": a.layers, "vocab": VOCAB, "batch": 1, "lengths": lengths,
                       "models": names, "modes": list(MODES), "cap_s": a.cap, "cap_gib": a.cap_gib,
                       "allocator_max_length": a.allocator_max_length},
            "skipped": [], "rows": []}
    if a.resume:
        old = json.loads(path.read_text())
        data.update(command=old["command"] + f" (resumed: {data['command']})",
                    rows=[r for r in old["rows"] if r["model"] not in redo],
                    skipped=[s for s in old["skipped"] if not any(s.startswith(m + " ") for m in redo)])
        data["config"]["lengths"] = sorted(set(lengths) | {r["length"] for r in data["rows"]})
    a.out.mkdir(parents=True, exist_ok=True)
    run(names, lengths, a, data, path)
    path.write_text(json.dumps(data, indent=1) + "\n")
    rows = data["rows"]
    print(table(rows))
    print(meters_agree(rows))
    print(path, save(data, a.out), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
