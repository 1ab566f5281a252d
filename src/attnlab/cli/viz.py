"""``attnlab viz RUN "text"``: draw the cross-attention alignment of a translation;
``attnlab viz RUN --image img.png``: draw where an image classifier's class token looks."""
from __future__ import annotations

import argparse
from pathlib import Path

HELP = "draw attention as a PNG: a translation's alignment, or an image classifier's attention over an image"
EXAMPLE = ('attnlab viz runs/translate "the dog sees forty-seven cats" --out align.png\n'
           '  attnlab viz runs/image --image cat.png --layer 4          # writes runs/image/attention-cat.png')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a translation run, or an image run (attnlab train image)")
    p.add_argument("text", nargs="?", help="the source sentence (a translation run)")
    p.add_argument("--image", default=None, help="an image file (an image run): draws the attention rollout and the "
                                                 "class token's attention per head over it")
    p.add_argument("--out", default=None, help="PNG to write (default: attention.png for a translation, "
                                               "RUN/attention-IMAGE.png for an image)")
    p.add_argument("--layer", type=int, default=None, help="one layer (1-based; default: all layers for a "
                                                           "translation, the last for the per-head image panels)")
    p.add_argument("--head", type=int, default=None, help="one head (1-based; default: average of heads; translation)")
    p.add_argument("--grid", action="store_true", help="one panel per layer and head (translation)")


def _image(args: argparse.Namespace, info) -> int:
    from . import UserError
    from ..tasks import get_task
    from ..viz.image import draw_image_attention
    if args.text is not None or args.head is not None or args.grid:
        raise UserError("--image draws an image run's attention: it takes no text, --head or --grid")
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: {info.describe()}; 'attnlab viz --image' takes an image run, which "
                        f"records its image processor (train one with: attnlab train image)")
    clf = get_task(info.run.task).load(info.run, "cpu")
    # beside the run's checkpoints (RUN/best, RUN/step-N), not inside one
    out = Path(args.out) if args.out else Path(info.run.path).parent / f"attention-{Path(args.image).stem}.png"
    path = draw_image_attention(clf.model, clf.processor, args.image, out, layer=args.layer)
    print(f"wrote {path}")
    return 0


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks import get_task
    from ..viz.translation import draw_alignment
    info, kind = open_model_path(args.checkpoint, "viz", ("seq2seq", "image-classifier"))
    if args.image is not None:
        if kind != "image-classifier":
            raise UserError(f"--image {args.image}: {args.checkpoint} is {info.describe()}, not an image "
                            f"classifier; --image takes an image run (attnlab train image)")
        return _image(args, info)
    if kind != "seq2seq":
        raise UserError(f"{args.checkpoint}: {info.describe()}; give the image to look at with --image FILE")
    if args.text is None:
        raise UserError("give the source sentence to translate (or --image FILE with an image run)")
    t = get_task(info.run.task).load(info.run, "cpu")
    path, translation = draw_alignment(t.model, t.src_tok, t.tgt_tok, args.text, args.out or "attention.png",
                                       layer=args.layer, head=args.head, grid=args.grid)
    print(translation)
    print(f"wrote {path}")
    return 0
