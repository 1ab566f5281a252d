"""``attnlab viz RUN_OR_HF_DIR "text"``: draw what every attention layer of a model does with one input.

Each kind of model is turned into *views* (attnlab.viz.views: one (layers, heads, T, S) array
per layer stack and role, with token labels) by its own loader below; the figures and the page
are drawn from views alone:

- a text model whose forward takes token ids (causal LM, masked LM, encoder, classifier):
  the text through the run's own tokenizer (or the directory's);
- a translation: encoder, decoder and cross-attention of the model's own translation, or of
  ``--target``; also the alignment figure (``alignment.png``: the cross-attention averaged over
  layers and heads, or ``--layer``/``--head``; ``--grid``: every layer and head);
- a Mamba-2 or Mamba-3 (no attention layers): its implicit attention, each layer's (T, T) matrix
  per head that the scan multiplies its input by (attnlab.viz.implicit), drawn as a "matrix" view;
- an image classifier, with ``--image img.png``: where its class token looks, over the image
  (attnlab.viz.image; one PNG, beside the run's checkpoints; a Swin: its pooled rollout and each
  stage's attention received per patch); with ``--html``/``--serve`` the
  page's image view of every layer, head and query patch (attnlab.viz.image_views; ViT, DeiT, Swin);
- a vision-language run, with ``--image img.png`` and the question as the text (default: the run's
  first): its answer, then how the question's and answer's tokens attend to the image's tokens
  (attnlab.viz.image_text: one PNG, the text x patches heatmap and each token's map over the image;
  with ``--html``/``--serve`` the page's text-to-image view drawn over the picture, and the whole
  self-attention).

Output: PNGs (one per view and layer, its heads in a grid; ``--layer``/``--head``: one) in
``--out DIR`` (default: a ``viz/`` folder inside the run or model directory), each path printed;
``--html FILE``: the self-contained explorer page instead; ``--serve``: the page on localhost.
"""
from __future__ import annotations

import argparse
from pathlib import Path

HELP = ("draw a model's attention for one input: PNG heatmaps, an interactive page (--html, --serve), or an "
        "image classifier's attention over an image (--image)")
EXAMPLE = ('attnlab viz runs/lm "the cat sat on the mat"\n'
           '  attnlab viz runs/translate "the dog sees forty-seven cats" --layer 2 --head 1\n'
           '  attnlab viz all-MiniLM-L6-v2/ "a cat sits on the mat" --html cat.html\n'
           '  attnlab viz runs/classify "what a film" --serve\n'
           '  attnlab viz runs/image --image cat.png --layer 4          # writes runs/image/attention-cat.png\n'
           '  attnlab viz runs/vlm "what digit is this?" --image three.png   # text-to-image attention')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a run directory or checkpoint (lm, mlm, classify, translate, image) or a "
                   "Hugging Face model directory (config.json, weights, tokenizer.json)")
    p.add_argument("text", nargs="?", help="the text to look at (a translation's source sentence)")
    p.add_argument("--image", default=None, help="an image file: an image run draws the attention rollout and the "
                   "class token's attention per head over it; a vlm run answers the text (a question) and draws "
                   "how the text attends to the image")
    p.add_argument("--target", metavar="TEXT", help="translation: the target sentence the decoder reads "
                   "(default: the model's own greedy translation)")
    p.add_argument("--out", metavar="DIR", default=None, help="folder for the PNGs (default: viz/ inside the run "
                   "or model directory); for a translation, a name ending in .png is where the alignment "
                   "figure alone goes; with --image, the PNG to write (default RUN/attention-IMAGE.png)")
    p.add_argument("--layer", type=int, default=None, help="only this layer (1-based; default: every layer; with "
                   "--image, the last for the per-head panels)")
    p.add_argument("--head", type=int, default=None, help="only this head (1-based; default: all heads in a grid)")
    p.add_argument("--grid", action="store_true", help="translation: the alignment figure with one panel per "
                   "layer and head")
    p.add_argument("--html", metavar="FILE", help="write the interactive explorer page here (one file; no network "
                   "needed to view it) instead of PNGs")
    p.add_argument("--serve", action="store_true", help="serve the explorer page on localhost and print its "
                   "URL (Ctrl-C stops)")
    p.add_argument("--port", type=int, default=0, help="--serve on this port (default: a free one)")


# ----------------------------------------------------------------------------- loading, one per kind
def _text_model(info, path: str):
    """(model, tokenizer) of a run or Hugging Face directory of a text model."""
    if info.kind == "run":
        from ..tasks.run import load_model, load_tokenizers
        tokenizers = load_tokenizers(info.run)
        tok = tokenizers.get("text") or next(iter(tokenizers.values()))
        return load_model(info.run), tok
    from ..hub import from_pretrained, load_processor          # hub's: a GGUF file too
    return from_pretrained(path), load_processor(path, "text")


def _text_views(args, info, kind: str):
    from . import UserError
    from ..tasks.run import model_context
    from ..viz import TokenLabels
    from ..viz.views import text_views
    model, tok = _text_model(info, args.checkpoint)
    ids = tok.encode(args.text)
    if not ids:
        raise UserError("the text is empty after tokenisation: give some text to look at")
    context = model_context(model)
    if context is not None and len(ids) > context:
        raise UserError(f"the text is {len(ids)} tokens, longer than this model's context of {context} tokens: "
                        f"shorten it")
    return text_views(model, ids, TokenLabels(tok, ids)()), args.text


def _translation_views(args, info, kind: str):
    """A translation run (its source and target tokenizers) or a Hugging Face encoder-decoder
    directory (T5: one tokenizer for both sides)."""
    from ..viz.translation import draw_alignment, translation_views
    if info.kind == "run":
        from ..tasks import get_task
        t = get_task(info.run.task).load(info.run, "cpu")
        model, src_tok, tgt_tok = t.model, t.src_tok, t.tgt_tok
    else:
        model, src_tok = _text_model(info, args.checkpoint)
        tgt_tok = src_tok
    legacy = args.out is not None and args.out.endswith(".png")
    if args.html is None and not args.serve:
        where = Path(args.out) if legacy else _out_dir(args, info) / "alignment.png"
        path, translation = draw_alignment(model, src_tok, tgt_tok, args.text, where, layer=args.layer,
                                           head=args.head, grid=args.grid, target=args.target)
        print(f"wrote {path}")
        if legacy:                               # scripts/main.sh: the alignment figure alone
            print(translation)
            return [], translation
    views, translation = translation_views(model, src_tok, tgt_tok, args.text, args.target)
    print(translation)
    return views, f"{args.text} -> {translation}"


def _image(args: argparse.Namespace, info) -> int:
    from . import UserError
    from ..tasks import get_task
    from ..viz.image import draw_image_attention
    if args.text is not None or args.head is not None or args.grid:
        raise UserError("--image draws an image run's attention: it takes no text, --head or --grid")
    if args.target is not None:
        raise UserError("--target is for a translation model's decoder side; --image reads one image")
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: {info.describe()}; 'attnlab viz --image' takes an image run, which "
                        f"records its image processor (train one with: attnlab train image)")
    clf = get_task(info.run.task).load(info.run, "cpu")
    if args.html is not None or args.serve:
        from ..viz.image_views import image_views
        if args.layer is not None:
            raise UserError("--layer picks the PNG's per-head panels; the page (--html, --serve) has every layer")
        return _page(args, info, image_views(clf.model, clf.processor, args.image), Path(args.image).name)
    # beside the run's checkpoints (RUN/best, RUN/step-N), not inside one
    out = Path(args.out) if args.out else Path(info.run.path).parent / f"attention-{Path(args.image).stem}.png"
    path = draw_image_attention(clf.model, clf.processor, args.image, out, layer=args.layer)
    print(f"wrote {path}")
    return 0


def _image_text(args: argparse.Namespace, info) -> int:
    """A vision-language run: its answer to the question about the image, and the text-to-image attention."""
    from . import UserError
    from ..tasks import get_task
    from ..viz import TokenLabels
    from ..viz.image_text import draw_image_text_attention, image_text_attention, image_text_views
    if args.head is not None or args.grid or args.target is not None:
        raise UserError("--image with a vision-language run draws the text's attention to the image: it takes a "
                        "question as the text and --layer, not --head, --grid or --target")
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: {info.describe()}; 'attnlab viz --image' takes a vlm run, which records "
                        "its vocabulary and image processor")
    vlm = get_task(info.run.task).load(info.run, "cpu")
    question = args.text if args.text is not None else vlm.questions[0]
    shown = vlm.processor.resized(args.image)                  # (C, H, W) uint8: what the model reads
    reply = vlm.ask(args.image, question)
    ids = vlm.prompt_ids(question) + vlm.tokenizer.encode(reply)
    attention = image_text_attention(vlm.model, ids, vlm.processor.finish(shown)[None])
    labels, picture = TokenLabels(vlm.tokenizer, ids)(), shown.permute(1, 2, 0).numpy()
    print(f"{question} -> {reply}")
    if args.html is not None or args.serve:
        if args.layer is not None:
            raise UserError("--layer picks the PNG's layer; the page (--html, --serve) has every layer")
        return _page(args, info, image_text_views(attention, picture, labels), f"{question} -> {reply}")
    out = Path(args.out) if args.out else Path(info.run.path).parent / f"attention-{Path(args.image).stem}.png"
    path = draw_image_text_attention(attention, picture, labels, out,
                                     layer=None if args.layer is None else args.layer - 1)
    print(f"wrote {path}")
    return 0


def _out_dir(args, info) -> Path:
    if args.out is not None and not args.out.endswith(".png"):
        return Path(args.out)
    base = info.path if info.path.is_dir() else info.path.parent
    return base / "viz"


LOADERS = {"seq2seq": _translation_views}
TEXT_KINDS = ("causal-lm", "masked-lm", "base", "classifier", "pretraining", "replaced-token")
IMAGE_KINDS = ("image-classifier", "vision-language")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    info, kind = open_model_path(args.checkpoint, "viz", TEXT_KINDS + tuple(LOADERS) + IMAGE_KINDS)
    if args.image is not None and kind == "vision-language":
        return _image_text(args, info)
    if kind == "vision-language":
        raise UserError(f"{args.checkpoint}: {info.describe()}; give the image to ask about with --image FILE "
                        "(and the question as the text)")
    if args.image is not None:
        if kind != "image-classifier":
            raise UserError(f"--image {args.image}: {args.checkpoint} is {info.describe()}, not an image "
                            f"classifier; --image takes an image run (attnlab train image)")
        return _image(args, info)
    if kind == "image-classifier":
        raise UserError(f"{args.checkpoint}: {info.describe()}; give the image to look at with --image FILE")
    if args.text is None:
        what = "the source sentence to translate" if kind == "seq2seq" else "the text to look at"
        raise UserError(f"give {what} (or --image FILE with an image run)")
    if args.out is not None and args.out.endswith(".png") and kind != "seq2seq":
        raise UserError(f"--out {args.out}: give a folder; a .png name is only for a translation's alignment figure")
    if args.target is not None and kind != "seq2seq":
        raise UserError("--target is for a translation model's decoder side; this model reads one text")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535 (0: a free one), got {args.port}")
    views, title = LOADERS.get(kind, _text_views)(args, info, kind)
    if args.html is not None or args.serve:
        return _page(args, info, views, title)
    from ..viz.figures import write_figures
    for path in write_figures(views, _out_dir(args, info), layer=args.layer, head=args.head):
        print(f"wrote {path}")
    return 0


def _page(args, info, views, title: str) -> int:
    from ..viz.explorer import serve, write_page
    path = write_page(views, args.html or _out_dir(args, info) / "attention.html", title=title)
    print(f"wrote {path}")
    if not args.serve:
        return 0
    server = serve(path, args.port)
    print(f"serving {path.name} at http://127.0.0.1:{server.server_address[1]}/ (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.server_close()
    return 0
