"""``attnlab quantize MODEL OUT.gguf``: a language model's weights at 4 or 8 bits, written as GGUF.

MODEL is a GGUF file, a Hugging Face causal-LM directory or an attnlab LM run. Every Linear layer
but the head is quantised in groups of ``--group-size`` input weights (:mod:`attnlab.compress`):
``--bits 4`` as Q4_1 (scale and minimum per group) or, with ``--symmetric``, Q4_0; ``--bits 8`` as
Q8_0; the head and the token table as Q8_0. ``--method rtn`` rounds to nearest (llama.cpp's own
quantiser, byte for byte), ``gptq`` corrects each column's rounding error on the calibration text
(``--calibration FILE``), ``hqq`` (calibration-free) searches each group's offset. OUT is a GGUF
file (transformers and llama.cpp read it), so the group size is 32, GGUF's block; other group
sizes are for :func:`attnlab.compress.quantize_model` in memory.

The calibration helpers here serve ``attnlab prune`` too.
"""
from __future__ import annotations

import argparse
import sys

HELP = "quantise a language model's weights to 4 or 8 bits (RTN, GPTQ or HQQ) and write it as a GGUF file"
EXAMPLE = ("attnlab quantize SmolLM2-135M-Instruct.Q4_1.gguf smol-gptq.gguf --bits 4 --method gptq "
           "--calibration notes.txt")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a GGUF file, a Hugging Face causal-LM directory or an attnlab LM run")
    p.add_argument("out", help="the GGUF file to write (new)")
    p.add_argument("--bits", type=int, default=4, help="bits per weight: 4 or 8 (default 4)")
    p.add_argument("--group-size", type=int, default=32, help="input weights sharing one scale (default and only "
                   "value for a GGUF file: 32, its block)")
    p.add_argument("--method", choices=["rtn", "gptq", "hqq"], default="rtn",
                   help="rtn: round to nearest; gptq: error-correcting, needs --calibration; hqq: calibration-free "
                   "offset search, 4-bit Q4_1 only (default rtn)")
    p.add_argument("--symmetric", action="store_true", help="4 bits: Q4_0 (a scale per group, no minimum)")
    add_calibration_arguments(p)


def add_calibration_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calibration", metavar="FILE", help="a UTF-8 text file the model reads once (GPTQ, Wanda)")
    p.add_argument("--calibration-tokens", type=int, default=16384,
                   help="tokens of it to read, in sequences of --calibration-length (default 16384; GPTQ wants "
                        "several times the widest layer's inputs)")
    p.add_argument("--calibration-length", type=int, default=256, help="tokens per sequence (default 256)")


def check_calibration(args: argparse.Namespace, method_reads_it: bool) -> None:
    """Before the model loads: a method that reads a calibration text has one, and only such a
    method is given one."""
    from pathlib import Path
    from . import UserError
    if not args.calibration:
        if method_reads_it:
            raise UserError(f"--method {args.method} needs a calibration text: --calibration FILE")
        return
    if not method_reads_it:
        raise UserError(f"--method {args.method} reads no calibration text; drop --calibration")
    if not Path(args.calibration).is_file():
        raise UserError(f"--calibration {args.calibration}: no such file")
    if args.calibration_tokens < 2 or args.calibration_length < 2:
        raise UserError("--calibration-tokens and --calibration-length must be at least 2")


def check_out(out, gguf_only: bool) -> None:
    from . import UserError
    gguf = out.suffix.lower() == ".gguf"
    if gguf_only and not gguf:
        raise UserError(f"{out}: this command writes a GGUF file; give OUT ending in .gguf")
    if out.exists() and (gguf or not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists; give a new file or an empty directory")


def load_lm(path: str, command: str):
    """(model in eval mode, its tokenizer or None) of a GGUF file, Hugging Face directory or LM run."""
    from . import open_model_path
    from ..hub import from_pretrained, load_tokenizer
    from ..tasks.run import load_model, load_tokenizers
    info, _ = open_model_path(path, command, ("causal-lm",))
    if info.kind == "run":
        return load_model(info.run).eval(), load_tokenizers(info.run).get("text")
    try:
        tok = load_tokenizer(info.path)
    except (ValueError, FileNotFoundError, OSError):
        tok = None
    return from_pretrained(info.path).eval(), tok


def calibration_batches(args: argparse.Namespace, model, tok) -> list:
    """Token-id tensors (1, length) of ``--calibration``: its first ``--calibration-tokens`` tokens
    cut into sequences of ``--calibration-length`` (at most the model's context)."""
    import torch
    from pathlib import Path
    from . import UserError
    from ..tasks.run import model_context
    if tok is None:
        raise UserError(f"{args.model}: has no tokenizer to read --calibration {args.calibration} with")
    n = min(args.calibration_length, model_context(model) or args.calibration_length)
    with open(Path(args.calibration), encoding="utf-8") as f:     # enough characters, not a whole corpus
        text = f.read(64 * args.calibration_tokens)
    ids = tok.encode(text)[:args.calibration_tokens]
    if len(ids) < n:
        raise UserError(f"{args.calibration}: {len(ids)} tokens, fewer than one sequence of {n} "
                        "(--calibration-length)")
    return [torch.tensor([ids[i:i + n]]) for i in range(0, len(ids) - n + 1, n)]


def _note_thin_calibration(model, tokens: int) -> None:
    """GPTQ's H = X^T X of a layer with k inputs has rank at most the number of calibration tokens;
    below a few times k its error compensation fits the calibration text and can end above plain
    rounding (measured on SmolLM2-135M: benchmarks/results/compression.md). Said once, not refused."""
    from ..compress import linear_layers
    widest = max((lin.in_features for _, _, lin in linear_layers(model).values()), default=0)
    if tokens < 8 * widest:
        print(f"note: GPTQ on {tokens} calibration tokens for layers of up to {widest} inputs; with fewer than "
              f"about {8 * widest} it can end above --method rtn (a longer --calibration file helps)",
              file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path
    from . import UserError
    from ..compress import calibration_stats, quantize_model, save_quantized_gguf
    out = Path(args.out)
    if args.bits not in (4, 8):
        raise UserError(f"--bits {args.bits}: must be 4 (Q4_1, or Q4_0 with --symmetric) or 8 (Q8_0)")
    if args.group_size != 32:
        raise UserError(f"--group-size {args.group_size}: a GGUF block holds 32 values; use --group-size 32")
    if args.method == "hqq" and (args.bits != 4 or args.symmetric):
        raise UserError("--method hqq searches an asymmetric offset: use --bits 4 without --symmetric")
    if args.bits == 8 and args.symmetric:
        raise UserError("--symmetric is for 4 bits; 8 bits are always symmetric (Q8_0)")
    check_out(out, gguf_only=True)
    check_calibration(args, args.method == "gptq")
    model, tok = load_lm(args.model, "quantize")
    batches = calibration_batches(args, model, tok) if args.calibration else None
    stats = calibration_stats(model, batches) if batches else None
    if args.method == "gptq":
        _note_thin_calibration(model, sum(b.numel() for b in batches))
    quantize_model(model, args.bits, args.group_size, args.method, symmetric=args.symmetric or None,
                   calibration=stats)
    save_quantized_gguf(model, out, tok if getattr(tok, "hf", None) is not None else None)
    kind = "Q8_0" if args.bits == 8 else "Q4_0" if args.symmetric else "Q4_1"
    print(f"{out}: {type(model).__name__} as GGUF {kind} ({args.method}), {out.stat().st_size / 2**20:.1f} MiB",
          file=sys.stderr)
    return 0
