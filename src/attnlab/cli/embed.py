"""``attnlab embed DIR "text" ...``: sentence vectors from an encoder (mean over the real tokens);
``attnlab embed RUN "text" ... --images a.png ...``: texts and images in one space, from a run of a
model of images and texts (``attnlab train clip``), the texts' rows first, then the images';
``attnlab embed CLIP_DIR "text" --images a.png ...``: the same from a Hugging Face directory of such a
model (``CLIPModel.save_pretrained`` with its processor), as transformers' ``get_text_features`` and
``get_image_features`` compute them.

Vectors are normalised to unit length by default, as sentence-transformers checkpoints
(all-MiniLM-L6-v2) normalise theirs, so that a dot product is the cosine similarity;
``--no-normalize`` prints the plain means. Without ``--out`` each text's vector is printed on
one line (space-separated); with ``--out FILE.npy`` the (N, E) float32 array is written there
and one line says so. Reading stdin (no texts given), row N belongs to line N of the input.
"""
from __future__ import annotations

import argparse
import sys

HELP = ("sentence embeddings from an encoder (a Hugging Face directory such as all-MiniLM-L6-v2, or an attnlab run); "
        "texts and images from an image-text run")
EXAMPLE = ('attnlab embed all-MiniLM-L6-v2/ "a cat sits on the mat" "a dog runs"\n'
           "  attnlab embed runs/classify --out vectors.npy < sentences.txt\n"
           '  attnlab embed runs/clip "a photo of a 3" --images three.png seven.png\n'
           "  attnlab embed clip-vit-base-patch32/ \"a photo of a cat\" --images cat.png dog.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a Hugging Face model directory (config.json, weights, tokenizer.json) or an "
                   "attnlab run whose model has token vectors (a base encoder, a classifier)")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line from stdin)")
    p.add_argument("--images", nargs="+", default=[], metavar="IMAGE", help="image files to embed after the texts "
                   "(a run of a model of images and texts, or a Hugging Face directory of one with its processor)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="unit-length vectors, so that a dot product is the cosine (default: on)")
    p.add_argument("--out", metavar="FILE.npy", help="write the (N, E) float32 array here instead of printing it")
    p.add_argument("--batch-size", type=int, default=64, help="texts per forward pass (default 64)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    from . import texts_anywhere
    texts_anywhere(p)


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks.embed import load_embedder
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.out is not None and not args.out.endswith(".npy"):
        raise UserError(f"--out {args.out}: give a file name ending in .npy")
    from ..models.registry import KINDS
    info, kind = open_model_path(args.checkpoint, "embed", ("base", "classifier", "masked-lm", "causal-lm",
                                                            "pretraining", "contrastive"))
    both = KINDS[kind].modality == "image-text"
    if args.images and not both:
        raise UserError(f"--images: {args.checkpoint} embeds texts only; images take a model of images and texts "
                        "(an attnlab train clip run)")
    texts = args.texts or ([] if args.images else [line.rstrip("\r\n") for line in sys.stdin])
    if not texts and not args.images:
        raise UserError("no texts to embed: give them as arguments or one per line on stdin")
    if both:
        vectors = _texts_and_images(args, info, texts)
    else:
        vectors = load_embedder(args.checkpoint, args.device).embed(texts, args.normalize, args.batch_size)
    if args.out is not None:
        import numpy as np
        np.save(args.out, vectors.numpy().astype("float32"))
        print(f"{args.out}: {vectors.size(0)} vectors of {vectors.size(1)} dimensions"
              f"{' (unit length)' if args.normalize else ''}", file=sys.stderr)
        return 0
    for v in vectors.tolist():
        print(" ".join(f"{x:.6f}" for x in v))
    return 0


def _texts_and_images(args: argparse.Namespace, info, texts: list[str]):
    """(texts + images, P) vectors from an image-text run, in one space."""
    import torch
    from . import UserError
    from ..tasks import get_task
    if info.kind == "run":
        model = get_task(info.run.task).load(info.run, args.device)
    else:
        from ..tasks.contrastive import load_pretrained_contrastive
        model = load_pretrained_contrastive(args.checkpoint, args.device)
        if texts and model.tokenizer is None:
            raise UserError(f"{args.checkpoint}: no tokenizer.json, so no texts to embed (save the processor with "
                            "its tokenizer, CLIPProcessor.save_pretrained), or embed images only (--images)")
    parts = ([model.text_vectors(texts, args.normalize, args.batch_size)] if texts else []) + (
        [model.image_vectors(args.images, args.normalize, args.batch_size)] if args.images else [])
    return torch.cat(parts)
