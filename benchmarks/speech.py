"""Speech recognition from scratch: word error rate of `attnlab train speech` on held-out sentences
spoken in a voice the training never heard.

The corpus is the embedded spoken one (attnlab.data.speech): 2,000 training sentences of the
numbers corpus spoken by six espeak-ng voices at three speeds, 100 validation sentences in those
voices, 100 test sentences in the held-out voice (received pronunciation, a variant no training
voice has). The run goes through the command line (``attnlab train speech``, run in this process
through ``attnlab.cli.main``; the script prints the command), then its best checkpoint (chosen by
the validation WER) transcribes both sets greedily and the script prints each set's word error rate
(:func:`attnlab.tasks.speech.word_error_rate`) with a few transcripts. There is no reference
implementation to compare with here: the figure is the model's.

Usage:
  python benchmarks/speech.py --markdown --time-budget 40     # the reported run (40 min of training)
  python benchmarks/speech.py --run runs/speech               # score an existing run again
  python benchmarks/speech.py --quick                         # tiny sizes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import cpu_name  # noqa: E402

from attnlab.cli import main as attnlab_main  # noqa: E402
from attnlab.data.speech import spoken_numbers  # noqa: E402
from attnlab.tasks import get_task, open_run  # noqa: E402
from attnlab.tasks.speech import word_error_rate  # noqa: E402



def train_args(a: argparse.Namespace, run: Path) -> list[str]:
    if a.quick:
        sizes = ["--sentences", "8", "--eval-size", "3", "--test-size", "3", "--max-words", "5", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--d-ff", "32", "--batch-size", "4", "--steps", "3"]
    else:
        sizes = ["--sentences", str(a.sentences), "--eval-size", str(a.eval_size), "--test-size", str(a.test_size),
                 "--d-model", "128", "--heads", "4", "--layers", "2", "--d-ff", "256",
                 "--time-budget", f"{a.time_budget:g}"]
    return ["--audio-cache", str(a.audio_cache), "--out", str(run), "--no-progress", "--seed", str(a.seed), *sizes]


def score(run: Path, a: argparse.Namespace) -> dict:
    info = open_run(run)
    s = info.path.parent / "config.yaml" if (info.path.parent / "config.yaml").is_file() else run / "config.yaml"
    import yaml
    settings = yaml.safe_load(s.read_text())["settings"]
    corpus = spoken_numbers(a.audio_cache, n_train=settings["sentences"], n_valid=settings["eval_size"],
                            n_test=settings["test_size"], seed=settings["seed"], max_words=settings["max_words"])
    speech = get_task("speech").load(info, "cpu")
    out = {"checkpoint": str(info.path), "step": None}
    state = info.path / "trainer_state.json"
    if state.is_file():
        import json
        out["step"] = json.loads(state.read_text()).get("step")
    for name, utterances in (("validation, training voices", corpus.valid), ("test, held-out voice", corpus.test)):
        hyps = speech([u.path for u in utterances])
        refs = [u.text for u in utterances]
        out[name] = (word_error_rate(hyps, refs), len(refs), sorted({u.voice for u in utterances}),
                     list(zip(refs, hyps))[:4])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time-budget", type=float, default=40.0, help="minutes of training (default 40)")
    p.add_argument("--sentences", type=int, default=2000)
    p.add_argument("--eval-size", type=int, default=100)
    p.add_argument("--test-size", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audio-cache", type=Path, default=None, help="the spoken corpus's folder (default: the task's)")
    p.add_argument("--work", type=Path, default=None, help="where the run goes (default: a temporary folder)")
    p.add_argument("--run", type=Path, default=None, help="score this existing speech run instead of training one")
    p.add_argument("--quick", action="store_true", help="tiny sizes and 3 steps: a smoke test")
    p.add_argument("--markdown", action="store_true", help="print the result as a markdown table")
    a = p.parse_args()
    if a.audio_cache is None:
        from attnlab.data.speech import default_cache
        a.audio_cache = default_cache()
    seconds = None
    if a.run is None:
        run = (a.work or Path(tempfile.mkdtemp(prefix="attnlab-speech-"))) / "run"
        args = train_args(a, run)
        print("$ attnlab train speech " + " ".join(shlex.quote(x) for x in args), flush=True)
        start = time.perf_counter()
        code = attnlab_main(["train", "speech", *args])
        if code != 0:
            sys.exit(f"attnlab train speech failed with exit status {code}")
        seconds = time.perf_counter() - start
    else:
        run = a.run
    result = score(run, a)
    print(f"\n{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} (measured on a loaded machine)")
    print(f"run {run}, best checkpoint {result['checkpoint']} (step {result['step']})"
          + (f", training command {seconds / 60:.1f} min" if seconds else ""))
    rows = [(name, *result[name]) for name in ("validation, training voices", "test, held-out voice")]
    if a.markdown:
        print("\n| sentences | voices | count | word error rate |\n|---|---|---:|---:|")
        for name, wer, n, voices, _ in rows:
            print(f"| {name} | {', '.join(voices)} | {n} | {wer:.1f} % |")
    else:
        for name, wer, n, voices, _ in rows:
            print(f"{name:30s} {n:4d} sentences  WER {wer:6.1f} %  ({', '.join(voices)})")
    for name, _, _, _, examples in rows:
        print(f"\n{name}:")
        for ref, hyp in examples:
            print(f"  ref {ref!r}\n  got {hyp!r}")


if __name__ == "__main__":
    main()
