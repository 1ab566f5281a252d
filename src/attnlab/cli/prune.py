"""``attnlab prune MODEL OUT``: zero a fraction (or all but N of every M) of a language model's Linear weights.

Magnitude pruning removes the smallest |W| of each layer; Wanda (Sun et al. 2024) the smallest
|W_ij| * ||X_j||_2 of each output row, with the input norms read off a calibration text
(``--calibration FILE``). ``--pattern 2:4`` keeps the 2 highest of every 4 consecutive weights
of a row instead (the layout sparse tensor cores run). The head, the embeddings and routers are
kept (:func:`attnlab.compress.prune_model`). OUT is a Hugging Face directory or a ``.gguf`` file
(F32: the zeros are stored as such).
"""
from __future__ import annotations

import argparse
import sys

from .quantize import add_calibration_arguments, calibration_batches, check_calibration, check_out, load_lm

HELP = "prune a language model's Linear weights (magnitude or Wanda; unstructured or N:M) and write it"
EXAMPLE = ("attnlab prune SmolLM2-135M-Instruct.Q4_1.gguf smol-wanda/ --sparsity 0.5 --method wanda "
           "--calibration notes.txt\n"
           "  attnlab prune SmolLM2-135M-Instruct.Q4_1.gguf smol-24.gguf --pattern 2:4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a GGUF file, a Hugging Face causal-LM directory or an attnlab LM run")
    p.add_argument("out", help="a new (or empty) directory, or a FILE.gguf")
    p.add_argument("--sparsity", type=float, help="fraction of weights to remove, in [0, 1) (default 0.5; "
                   "with --pattern N:M it is 1 - N/M)")
    p.add_argument("--method", choices=["magnitude", "wanda"], default="magnitude",
                   help="magnitude: |W| per layer; wanda: |W| x input norm per output row, needs --calibration")
    p.add_argument("--pattern", metavar="N:M", help="keep N of every M consecutive weights of a row (e.g. 2:4)")
    add_calibration_arguments(p)


def _pattern(text: str | None) -> tuple[int, int] | None:
    from . import UserError
    if text is None:
        return None
    try:
        n, m = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--pattern {text!r}: expected N:M, e.g. 2:4") from None
    if not 0 < n < m:
        raise UserError(f"--pattern {text}: needs 0 < N < M (N of every M weights kept)")
    return n, m


def run(args: argparse.Namespace) -> int:
    from pathlib import Path
    from . import UserError
    from .export import _tokenizer_files
    from ..compress import calibration_stats, linear_layers, prune_model, sparsity_of
    from ..hub import save_gguf, save_pretrained
    from ..tasks.run import model_context
    pattern = _pattern(args.pattern)
    sparsity = args.sparsity
    if pattern is not None:
        implied = 1 - pattern[0] / pattern[1]
        if sparsity is not None and abs(sparsity - implied) > 1e-9:
            raise UserError(f"--sparsity {sparsity} contradicts --pattern {args.pattern} (sparsity {implied:g}); "
                            "give one of them")
        sparsity = implied
    elif sparsity is None:
        sparsity = 0.5
    if not 0.0 <= sparsity < 1.0:
        raise UserError(f"--sparsity {sparsity}: must be in [0, 1)")
    out = Path(args.out)
    check_out(out, gguf_only=False)
    check_calibration(args, args.method == "wanda")
    model, tok = load_lm(args.model, "prune")
    if pattern is not None and (bad := [n for n, (_, _, lin) in linear_layers(model).items()
                                        if lin.in_features % pattern[1]]):
        raise UserError(f"--pattern {args.pattern}: {bad[0]}'s input width is not a multiple of {pattern[1]}")
    stats = calibration_stats(model, calibration_batches(args, model, tok), full=False) if args.calibration else None
    prune_model(model, sparsity, args.method, pattern=pattern, calibration=stats)
    hf_tok = tok if getattr(tok, "hf", None) is not None else None
    if out.suffix.lower() == ".gguf":
        save_gguf(model, out, hf_tok)
    else:
        save_pretrained(model, out)
        if hf_tok is not None:
            _tokenizer_files(hf_tok, out, model_context(model), {})
    print(f"{out}: {type(model).__name__}, {sparsity_of(model):.1%} of its Linear weights zero ({args.method}"
          f"{', ' + args.pattern if pattern else ''})", file=sys.stderr)
    return 0
