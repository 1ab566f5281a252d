"""``attnlab embed DIR "text" ...``: sentence vectors from an encoder (mean over the real tokens).

Vectors are normalised to unit length by default, as sentence-transformers checkpoints
(all-MiniLM-L6-v2) normalise theirs, so that a dot product is the cosine similarity;
``--no-normalize`` prints the plain means. Without ``--out`` each text's vector is printed on
one line (space-separated); with ``--out FILE.npy`` the (N, E) float32 array is written there
and one line says so. Reading stdin (no texts given), row N belongs to line N of the input.
"""
from __future__ import annotations

import argparse
import sys

HELP = "sentence embeddings from an encoder (a Hugging Face directory such as all-MiniLM-L6-v2, or an attnlab run)"
EXAMPLE = ('attnlab embed all-MiniLM-L6-v2/ "a cat sits on the mat" "a dog runs"\n'
           "  attnlab embed runs/classify --out vectors.npy < sentences.txt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a Hugging Face model directory (config.json, weights, tokenizer.json) or an "
                   "attnlab run whose model has token vectors (a base encoder, a classifier)")
    p.add_argument("texts", nargs="*", help="texts to embed (default: one per line from stdin)")
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
    open_model_path(args.checkpoint, "embed", ("base", "classifier", "masked-lm", "causal-lm", "pretraining"))
    texts = args.texts or [line.rstrip("\r\n") for line in sys.stdin]
    if not texts:
        raise UserError("no texts to embed: give them as arguments or one per line on stdin")
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
