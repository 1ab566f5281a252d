"""``attnlab viz RUN "text"``: draw the cross-attention alignment of a translation."""
from __future__ import annotations

import argparse

HELP = "draw the cross-attention alignment of a translation as a PNG"
EXAMPLE = 'attnlab viz runs/translate "the dog sees forty-seven cats" --out align.png'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a translation run directory or checkpoint")
    p.add_argument("text", help="the source sentence")
    p.add_argument("--out", default="attention.png", help="PNG to write (default attention.png)")
    p.add_argument("--layer", type=int, default=None, help="one decoder layer (1-based; default: all)")
    p.add_argument("--head", type=int, default=None, help="one head (1-based; default: average of heads)")
    p.add_argument("--grid", action="store_true", help="one panel per layer and head")


def run(args: argparse.Namespace) -> int:
    from . import open_model_path
    from ..tasks import get_task
    from ..viz.translation import draw_alignment
    info, _ = open_model_path(args.checkpoint, "viz", ("seq2seq",))
    t = get_task(info.run.task).load(info.run, "cpu")
    path, translation = draw_alignment(t.model, t.src_tok, t.tgt_tok, args.text, args.out, layer=args.layer,
                                       head=args.head, grid=args.grid)
    print(translation)
    print(f"wrote {path}")
    return 0
