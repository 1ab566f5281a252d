"""``attnlab translate RUN "text" ...``: translate with a trained translation run.

Reading stdin, line N of the output is the translation of line N of the input, blank lines
included (a blank line gives a blank line), so outputs stay aligned with their sources.
"""
from __future__ import annotations

import argparse
import sys

HELP = "translate sentences with a trained translation run"
EXAMPLE = ('attnlab translate runs/translate "the dog sees forty-seven cats"\n'
           "  attnlab translate runs/multi30k < sentences.txt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a translation run directory (its best/, else latest checkpoint) or checkpoint")
    p.add_argument("texts", nargs="*", help="sentences to translate (default: one per line from stdin)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy; default 4)")
    p.add_argument("--length-penalty", type=float, default=1.0, help="beam search's length penalty (default 1.0)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    from . import texts_anywhere
    texts_anywhere(p)


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks import get_task
    if args.beam < 1:
        raise UserError(f"--beam must be at least 1, got {args.beam}")
    info, _ = open_model_path(args.checkpoint, "translate", ("seq2seq",))
    translator = get_task(info.run.task).load(info.run, args.device)
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    for out in translator(texts, beam_size=args.beam, length_penalty=args.length_penalty):
        print(out)
    return 0
