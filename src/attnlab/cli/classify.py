"""``attnlab classify RUN "text" ...`` / ``attnlab classify RUN image.png ...``: label inputs with
a trained classifier run, texts or images as its model takes (the kind it was trained as).

One output line per input: the most likely label and its probability, tab-separated, or with
``--top K`` the K most likely labels each followed by its probability. Reading stdin (no inputs
given: one text, or one image path, per line), line N of the output belongs to line N of the
input; a blank line gives a blank line.
"""
from __future__ import annotations

import argparse
import sys

from . import texts_anywhere

HELP = "label texts or images with a trained classifier (a classify or image run), or zero-shot (a clip run)"
EXAMPLE = ('attnlab classify runs/classify "what a wonderful film" "the plot was dull"\n'
           "  attnlab classify runs/sst2 --top 2 < reviews.txt\n"
           "  attnlab classify runs/image cat.png dog.jpg\n"
           '  attnlab classify runs/clip --labels "cat,dog,bird" photo.png     # zero-shot')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a classify or image run directory (its best/, else latest checkpoint) or "
                   "checkpoint")
    p.add_argument("texts", nargs="*", help="texts to label, or image files for an image run (default: one per "
                   "line from stdin)")
    p.add_argument("--labels", metavar="A,B,...", help="zero-shot, with a model that scores images against "
                   "texts: the candidate labels, separated by commas, each put into the run's caption template "
                   "(default: the class names it was trained on)")
    p.add_argument("--top", type=int, default=1, metavar="K", help="print the K most likely labels (default 1)")
    p.add_argument("--batch-size", type=int, default=64, help="inputs per forward pass (default 64)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    texts_anywhere(p)


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..models.registry import KINDS, MODALITIES
    from ..tasks import get_task
    if args.top < 1 or args.batch_size < 1:
        raise UserError(f"--top and --batch-size must be at least 1, got {args.top} and {args.batch_size}")
    labels = None
    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if not all(labels):
            raise UserError(f"--labels {args.labels!r}: give the candidate labels separated by commas, none empty, "
                            "e.g. --labels \"cat,dog\"")
    classifiers = tuple(k for k, kind in KINDS.items() if kind.command == "attnlab classify")
    info, kind = open_model_path(args.checkpoint, "classify", classifiers)
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: {info.describe()}; 'attnlab classify' takes a classify run, which "
                        f"knows its label names (fine-tune this model with: attnlab train classify --init "
                        f"{args.checkpoint} --data FILE)")
    clf = get_task(info.run.task).load(info.run, args.device)
    if labels is not None:
        if not hasattr(clf, "zero_shot"):
            raise UserError(f"--labels: {args.checkpoint} is {info.describe()}, which predicts its own labels; "
                            "--labels is for a model that scores images against texts (zero-shot)")
        clf = clf.zero_shot(labels)
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    if MODALITIES[KINDS[kind].modality].main_input == "pixel_values":   # image files, read (and checked) in order
        texts = [t.strip() for t in texts]
    real = [i for i, t in enumerate(texts) if t.strip()]
    probs = clf.probabilities([texts[i] for i in real], args.batch_size) if real else None
    rows = dict.fromkeys(range(len(texts)), "")
    k = min(args.top, len(clf.labels))
    for row, i in enumerate(real):
        p, idx = probs[row].topk(k)
        rows[i] = "\t".join(f"{clf.labels[j]}\t{float(q):.4f}" for q, j in zip(p.tolist(), idx.tolist()))
    for i in range(len(texts)):
        print(rows[i])
    return 0
