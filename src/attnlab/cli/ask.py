"""``attnlab ask RUN image.png "what digit is this?"``: ask a trained vision-language run
(``attnlab train vlm``) a question about an image, streaming the answer.

Its own command rather than a ``generate --image`` option: ``generate`` continues a text with any
causal LM (Hugging Face directories, GGUF files, drafts, KV-cache kinds, sampling by default);
this reads an image through the run's image processor, asks with the run's own vocabulary and
answers greedily by default, as the task's validation and report do, so the answer printed is the
one they count.

The answer is written as its tokens are decoded and ends with a newline; a question word the run's
vocabulary lacks is named on stderr (it is read as ``<unk>``).
"""
from __future__ import annotations

import argparse
import math
import sys

HELP = "ask a trained vision-language run (attnlab train vlm) a question about an image, streaming the answer"
EXAMPLE = ('attnlab ask runs/vlm three.png "what digit is this?"\n'
           "  attnlab ask runs/vlm three.png               # the run's first training question")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a vlm run directory (its best/, else latest checkpoint) or checkpoint")
    p.add_argument("image", help="an image file (PNG, JPEG, ...)")
    p.add_argument("question", nargs="?", default=None, help="the question (default: the first question the run "
                   "was trained with)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="at most this many tokens, the end token "
                   "included (default: the task's longest answer and its end)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, as the task's evaluation (default 0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks import get_task
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens: must be at least 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UserError(f"--temperature: must be a number >= 0, got {args.temperature}")
    if args.question is not None and not args.question.strip():
        raise UserError("the question is empty; give one, or leave it out for the run's own")
    info, _ = open_model_path(args.checkpoint, "ask", ("vision-language",))
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: {info.describe()}; 'attnlab ask' reads an attnlab vlm run, which holds "
                        "its vocabulary and image processor")
    vlm = get_task(info.run.task).load(info.run, args.device)
    if args.question is not None:
        unknown = vlm.unknown_words(args.question)
        if unknown:
            print(f"attnlab ask: note: {', '.join(map(repr, unknown))} not in the run's vocabulary (read as <unk>)",
                  file=sys.stderr)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    options = {} if args.max_new_tokens is None else {"max_new_tokens": args.max_new_tokens}
    vlm.ask(args.image, args.question, temperature=args.temperature, seed=args.seed, on_text=emit, **options)
    emit("\n")
    return 0
