"""``attnlab transcribe RUN file.wav ...``: the words a trained speech run hears in WAV files,
one line per file, in order."""
from __future__ import annotations

import argparse

HELP = "transcribe 16 kHz WAV files with a trained speech run"
EXAMPLE = ("attnlab transcribe runs/speech utterance.wav\n"
           "  attnlab transcribe runs/speech a.wav b.wav --beam 4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a speech run directory (its best/, else latest checkpoint) or checkpoint")
    p.add_argument("files", nargs="+", help="16-bit PCM WAV files at the run's sampling rate (16 kHz)")
    p.add_argument("--beam", type=int, default=1, help="beam size (1 = greedy; default 1)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..models.registry import default_family
    from ..tasks import get_task
    if args.beam < 1:
        raise UserError(f"--beam must be at least 1, got {args.beam}")
    kind = get_task("speech").kind
    info, _ = open_model_path(args.checkpoint, "transcribe", (kind,))
    if info.kind != "run":
        raise UserError(f"{args.checkpoint}: a Hugging Face {default_family(kind) or kind} directory; 'attnlab "
                        "transcribe' takes a run of 'attnlab train speech', which records its vocabulary")
    transcriber = get_task(info.run.task).load(info.run, args.device)
    for text in transcriber(args.files, beam_size=args.beam):
        print(text)
    return 0
