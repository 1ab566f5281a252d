"""Every causal-LM family of attnlab on the same character-level task, at the same wall time.

Each family is sized to about the parameter count of a 4-layer, d_model 128 GPT-2 (the FAMILIES
table below: the `attnlab train lm` flags of each) and trained with the same batches (32 windows
of 128 characters), the same schedule and validation windows. "The same wall time" on a shared
machine: ``--step-times`` builds every model exactly as `attnlab train lm` does (its own settings
and sizing path) and times one training step of each (forward, cross-entropy, backward, clipping,
AdamW step, zero_grad), with one thread, the families alternating round-robin in one process, in
CPU seconds of that thread (``time.process_time``), which other processes on the machine do not
inflate. The steps that fit in ``--budget`` minutes of one idle thread follow from the median step;
each family is then trained with ``--steps`` that many (``--commands`` prints the commands), so
the result does not depend on the load while it trains.

Usage:
  python benchmarks/lm_families.py --params                   # parameters per family
  python benchmarks/lm_families.py --step-times --budget 5    # step times, steps in 5 minutes (JSON: --json)
  python benchmarks/lm_families.py --commands --times times.json --out runs/families
  python benchmarks/lm_families.py --table --times times.json --out runs/families --markdown
  python benchmarks/lm_families.py --commands --times times.json --lrs 1e-3,2e-3,4e-3   # a learning-rate grid
  python benchmarks/lm_families.py --quick                    # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, render_table  # noqa: E402

DATA = "../shared/data/tinyshakespeare.txt"
# the flags every run shares: the task, the batches, the validation windows, fp32 arithmetic
COMMON = "--context 128 --batch-size 32 --precision fp32 --eval-windows 400 --sample-tokens 0 --no-progress"
# family -> its flags; the Mamba families take nearly twice the GPT's layers, as one of their
# blocks holds about half a Transformer block's weights (a Mamba block: ~6 d^2, attention + MLP: 12 d^2).
# Mamba's state is 4 numbers per channel rather than its default 16: the selective scan's work
# grows with it (1.6x the step at 16), and d_model 132 brings the parameters back to the GPT's
FAMILIES = {
    "gpt2": "--model gpt2 --layers 4 --heads 4 --d-model 128",
    "llama": "--model llama --layers 4 --heads 4 --d-model 128",
    "mixtral": "--model mixtral --layers 4 --heads 4 --d-model 128 --d-ff 96 --experts 4 --top-k 2",
    "mamba": "--model mamba --layers 7 --d-model 132 --d-state 4",
    "mamba2": "--model mamba2 --layers 7 --heads 4 --d-model 128",
    "mamba3": "--model mamba3 --layers 7 --d-model 128",
    "rwkv": "--model rwkv --layers 4 --d-model 128",
    "rwkv7": "--model rwkv7 --layers 4 --heads 4 --d-model 128 --d-ff 384",
    "deepseek_v3": "--model deepseek_v3 --layers 4 --heads 4 --d-model 128 --d-ff 176",
    "llama4_text": "--model llama4_text --layers 4 --heads 4 --d-model 128 --d-ff 208",
    # today's LLaMA-skeleton families at LLaMA's size (their differences: biases, q/k norms, windows, norms)
    **{name: f"--model {name} --layers 4 --heads 4 --d-model 128" for name in
       ("qwen2", "qwen3", "mistral", "smollm3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text")},
}
QUICK_COMMON = "--context 16 --batch-size 2 --precision fp32 --eval-windows 4 --sample-tokens 0 --no-progress"


def family_flags(name: str, quick: bool = False) -> list[str]:
    """The `attnlab train lm` flags of one family (quick: the same family, 1 layer of width 32)."""
    flags = shlex.split(FAMILIES[name])
    if quick:
        flags = _replace(_replace(flags, "--layers", "1"), "--d-model", "32")
    return flags + shlex.split(QUICK_COMMON if quick else COMMON)


def _replace(flags: list[str], flag: str, value: str) -> list[str]:
    return [value if i and flags[i - 1] == flag else f for i, f in enumerate(flags)]


def build(name: str, data: str, quick: bool = False):
    """The task (with its model) and the settings `attnlab train lm` builds for a family's flags."""
    from attnlab.cli import build_parser
    from attnlab.cli.train import resolve_settings
    from attnlab.tasks import get_task
    with tempfile.TemporaryDirectory() as out:
        args = build_parser().parse_args(["train", "lm", "--data", data, "--out", out, *family_flags(name, quick)])
        task = get_task("lm")
        settings, _ = resolve_settings(task, args)
        setup = task.prepare(settings, None)
    return setup.task, settings


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def step_fn(task, settings: dict):
    """One training step as the Trainer takes it in fp32 (AdamW of attnlab.train, clipping at the
    settings' --clip), on the task's own batches."""
    from attnlab.train.optim import build_optimizer
    # the step's time does not depend on the values of lr, betas or decay, only on the update's form
    config = SimpleNamespace(optimizer="adamw", lr=settings["lr"], betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.01 if settings["weight_decay"] is None else settings["weight_decay"])
    model = task.model.train()
    opt = build_optimizer(model, config)
    batches = task.plan(0, 0)
    state = {"i": 0}

    def step():
        batch = batches[state["i"] % len(batches)]
        state["i"] += 1
        loss, n, _ = task.loss(model, batch)
        (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def step_times(names: list[str], data: str, rounds: int, warmup: int, quick: bool) -> dict:
    """name -> {"params", "step_ms" (median), "min_ms", "times_ms"}: one thread, round-robin."""
    torch.set_num_threads(1)
    built = {n: build(n, data, quick) for n in names}
    steps = {n: step_fn(*built[n]) for n in names}
    for fn in steps.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n, fn in steps.items():
            t0 = time.process_time()
            fn()
            times[n].append(time.process_time() - t0)
    return {n: {"params": parameters(built[n][0].model), "step_ms": statistics.median(t) * 1e3,
                "min_ms": min(t) * 1e3, "times_ms": [x * 1e3 for x in t]} for n, t in times.items()}


def budget_steps(step_ms: float, budget_min: float) -> int:
    """The steps of ``step_ms`` CPU milliseconds that fit in ``budget_min`` minutes."""
    return int(budget_min * 60e3 // step_ms)


def run_dir(name: str, lr: float | None) -> str:
    """A family's run directory under --out: NAME, or NAME-lrLR for a run of the --lrs grid."""
    return name if lr is None else f"{name}-lr{lr:g}"


def command(name: str, steps: int, data: str, out: str, eval_every: int, lr: float | None = None) -> str:
    flags = ["--data", data, *shlex.split(FAMILIES[name]), *shlex.split(COMMON), "--steps", str(steps),
             "--eval-every", str(eval_every), "--out", f"{out}/{run_dir(name, lr)}"]
    if lr is not None:
        flags += ["--lr", f"{lr:g}"]
    return "OMP_NUM_THREADS=1 attnlab train lm " + " ".join(flags)


def final_val_loss(run: Path) -> tuple[int, float] | None:
    """(step, validation loss) of the last evaluation in a run's metrics.jsonl."""
    file = run / "metrics.jsonl"
    if not file.is_file():
        return None
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "val_loss" in r]
    return (evals[-1]["step"], evals[-1]["val_loss"]) if evals else None


def _table_row(name: str, timed: dict, steps: int, cmds: dict, out: str, markdown: bool) -> list:
    """A family's row: its best finished run of those in ``cmds`` (lr -> command) found under
    ``out``, and the final loss of each run found."""
    results = {lr: final_val_loss(Path(out) / run_dir(name, lr)) for lr in cmds}
    done = {lr: r[1] for lr, r in results.items() if r is not None and r[0] == steps}
    tried = ", ".join(f"{'default' if lr is None else f'{lr:g}'}: " + (
        "-" if r is None else f"{r[1]:.4f}" + ("" if r[0] == steps else f" (step {r[0]}, unfinished)"))
        for lr, r in results.items() if r is not None) or "-"
    best = min(done, key=done.get) if done else next(iter(cmds))
    cmd = cmds[best]
    return [name, f"{timed['params']:,}", f"{timed['step_ms']:.0f}", steps, "default" if best is None else f"{best:g}",
            f"{done[best]:.4f}" if done else "-", tried, f"`{cmd}`" if markdown else cmd]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: all)")
    p.add_argument("--data", default=DATA)
    p.add_argument("--params", action="store_true", help="print each family's parameter count")
    p.add_argument("--step-times", action="store_true", help="time one training step of each family")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per family (round-robin)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget", type=float, default=5.0, help="minutes of one idle thread per family")
    p.add_argument("--json", help="write the step times here (--step-times)")
    p.add_argument("--times", help="step times JSON to read (--commands, --table)")
    p.add_argument("--commands", action="store_true", help="print the training command of each family")
    p.add_argument("--table", action="store_true", help="the results table from the runs in --out")
    p.add_argument("--out", default="runs/families")
    p.add_argument("--evals", type=int, default=5, help="evaluations per run (--commands)")
    p.add_argument("--lrs", help="comma-separated learning rates: --commands prints each family's run at each "
                   "(in --out/NAME-lrLR), --table gives each family's best of the runs it finds (default: the "
                   "task's lr, in --out/NAME)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny shapes: every family, one step each")
    a = p.parse_args(argv)
    names = a.families.split(",")
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    if a.quick:
        a.step_times, a.rounds, a.warmup = True, 1, 0
    if a.params:
        rows = [[n, f"{parameters(build(n, a.data, a.quick)[0].model):,}", FAMILIES[n]] for n in names]
        print(render_table(["family", "parameters", "flags"], rows, a.markdown))
    if a.step_times:
        times = step_times(names, a.data, a.rounds, a.warmup, a.quick)
        print(environment("cpu", torch.float32) + "; CPU time of the one thread, median of "
              f"{a.rounds} round-robin steps after {a.warmup} warm-up")
        rows = [[n, f"{t['params']:,}", f"{t['step_ms']:.0f}", f"{t['min_ms']:.0f}",
                 budget_steps(t["step_ms"], a.budget)] for n, t in times.items()]
        print(render_table(["family", "parameters", "step ms (median)", "min", f"steps in {a.budget:g} min"],
                           rows, a.markdown))
        if a.json:
            Path(a.json).write_text(json.dumps({"budget_min": a.budget, "families": times}, indent=1))
    if a.commands or a.table:
        if not a.times:
            p.error("--commands and --table read the step times: give --times FILE (from --step-times --json)")
        saved = json.loads(Path(a.times).read_text())
        budget, times = saved["budget_min"], saved["families"]
        lrs = [None] if not a.lrs else [float(v) for v in a.lrs.split(",")]
        rows = []
        for n in names:
            steps = budget_steps(times[n]["step_ms"], budget)
            cmds = {lr: command(n, steps, a.data, a.out, max(1, steps // a.evals), lr) for lr in lrs}
            if a.commands:
                print("\n".join(cmds.values()))
            rows.append(_table_row(n, times[n], steps, cmds, a.out, a.markdown))
        if a.table:
            print(render_table(["family", "parameters", "step ms", "steps", "lr", "validation loss",
                                "at each lr run", "command"], rows, a.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
