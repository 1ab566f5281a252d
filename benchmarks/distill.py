"""Distillation of a language model: a small student trained on a bigger teacher's soft targets
against the same student trained on the hard labels alone, for the same steps.

Data: Tiny Shakespeare (characters); the first ``--train-chars`` characters train, the file's last
10 % is held out, and the perplexity of each model is measured on its first ``--eval-chars``
characters with :func:`attnlab.tasks.lm.text_perplexity` (sliding windows of the model's context,
stride half of it: every character scored once). All three runs go through the command line
(``attnlab train lm``, run here in one process through ``attnlab.cli.main``; the script prints
each command):

  teacher  --d-model 128 --heads 4 --layers 4, --teacher-steps steps
  hard     the student (--d-model 48 --heads 4 --layers 2), --steps steps on the labels
  kd       the same student and steps, --teacher TEACHER --kd-temperature T --kd-alpha A

Both students of a seed start from the same weights and see the same batches: the only
difference is the loss. Each of ``--seeds`` (default 0 and 1) trains such a pair; the teacher is
one (seed 0). The result is the held-out perplexity of each model and, per seed, the ratio
kd / hard (below 1: distillation helped), with each run's wall time.

Usage:
  python benchmarks/distill.py --markdown            # a few minutes on 2 cores
  python benchmarks/distill.py --quick               # tiny sizes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import cpu_name, render_table  # noqa: E402

from attnlab.cli import main as attnlab_main  # noqa: E402
from attnlab.tasks.lm import load_lm, text_perplexity  # noqa: E402

DATA = "../shared/data/tinyshakespeare.txt"



def train(args: list[str]) -> tuple[float, str]:
    """Run ``attnlab train lm ARGS``; (seconds, the command as a shell line)."""
    command = "attnlab train lm " + " ".join(shlex.quote(a) for a in args)
    print(f"$ {command}", flush=True)
    start = time.perf_counter()
    code = attnlab_main(["train", "lm", *args])
    if code != 0:
        sys.exit(f"the command failed with exit status {code}: {command}")
    return time.perf_counter() - start, command


def perplexity(run: Path, text: str) -> float:
    return text_perplexity(load_lm(run, "cpu", "fp32"), text)["ppl"]


def run(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    text = Path(a.data).read_text(encoding="utf-8")
    held_out = text[int(len(text) * 0.9):][:a.eval_chars]
    work = Path(a.work or tempfile.mkdtemp(prefix="attnlab-distill-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.txt").write_text(text[:min(a.train_chars, int(len(text) * 0.9))], encoding="utf-8")
    (work / "valid.txt").write_text(held_out, encoding="utf-8")
    data = ["--data", str(work / "train.txt"), "--valid", str(work / "valid.txt"), "--context", str(a.context),
            "--batch-size", str(a.batch_size), "--sample-tokens", "0", "--no-progress", "--eval-every", "0",
            "--precision", "fp32"]
    teacher = ["--d-model", str(a.teacher_d_model), "--heads", "4", "--layers", str(a.teacher_layers), "--steps",
               str(a.teacher_steps), "--seed", "0"]
    student = ["--d-model", str(a.student_d_model), "--heads", "4", "--layers", str(a.student_layers), "--steps",
               str(a.steps)]
    distil = ["--teacher", str(work / "teacher"), "--kd-temperature", str(a.temperature), "--kd-alpha", str(a.alpha)]
    runs = [("teacher", "teacher", "0", teacher)]
    for seed in a.seeds.split(","):
        runs += [("student, hard labels", f"hard-{seed}", seed, [*student, "--seed", seed]),
                 ("student, distilled", f"kd-{seed}", seed, [*student, "--seed", seed, *distil])]
    rows, commands, ppl = [], [], {}
    for name, folder, seed, extra in runs:
        seconds, command = train([*data, *extra, "--out", str(work / folder)])
        commands.append(command)
        params = sum(p.numel() for p in load_lm(work / folder, "cpu", "fp32").model.parameters())
        ppl[folder] = perplexity(work / folder, held_out)
        rows.append([name, seed, f"{params / 1e6:.3f}M", extra[extra.index("--steps") + 1], f"{ppl[folder]:.3f}",
                     f"{seconds:.0f}"])
    ratios = [ppl[f"kd-{seed}"] / ppl[f"hard-{seed}"] for seed in a.seeds.split(",")]
    table = render_table(["model", "seed", "parameters", "steps", "held-out perplexity", "train s"], rows,
                         markdown=a.markdown)
    print()
    print(f"{datetime.date.today()}; {cpu_name()}, {a.threads} threads (a loaded, shared machine); torch "
          f"{torch.__version__}; Tiny Shakespeare, characters: {min(a.train_chars, int(len(text) * 0.9)):,} "
          f"training, {len(held_out):,} held out; T = {a.temperature:g}, alpha = {a.alpha:g}")
    print(table)
    each = ", ".join(f"seed {s} {r:.3f}" for s, r in zip(a.seeds.split(","), ratios))
    mean = sum(ratios) / len(ratios)
    print(f"\ndistilled / hard-label perplexity: {each}; mean {mean:.3f} ({(mean - 1) * 100:+.1f} %)")
    print("\ncommands:")
    for c in commands:
        print(f"  {c}")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--data", default=DATA, help="a text file (default: Tiny Shakespeare in ../shared/data)")
    p.add_argument("--work", help="where the runs go (default: a new temporary directory)")
    p.add_argument("--train-chars", type=int, default=300_000)
    p.add_argument("--eval-chars", type=int, default=20_000)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--teacher-d-model", type=int, default=128)
    p.add_argument("--teacher-layers", type=int, default=4)
    p.add_argument("--teacher-steps", type=int, default=400)
    p.add_argument("--student-d-model", type=int, default=48)
    p.add_argument("--student-layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=250, help="the students' steps")
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seeds", default="0,1", help="the students' seeds (initial weights and batches), one pair each")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a loaded 2-core machine two threads stall each other)")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny sizes and steps: a smoke test")
    a = p.parse_args(argv)
    if a.quick:
        a.train_chars, a.eval_chars, a.context, a.batch_size = 20_000, 2_000, 32, 4
        a.teacher_d_model, a.teacher_layers, a.teacher_steps = 32, 1, 4
        a.student_d_model, a.student_layers, a.steps, a.seeds = 16, 1, 3, "0"
    return a


if __name__ == "__main__":
    run(parse())
