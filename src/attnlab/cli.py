"""The ``attnlab`` command: a table of subcommands, each a function with an example in its help.

Each subcommand below registers itself in ``COMMANDS`` with (help, example, add_arguments,
run); the work itself lives in the library (train/, generate.py, viz/), imported lazily so
that ``attnlab --help`` stays fast. Errors that come from the user's input (a malformed file, a bad option) are raised as
``UserError`` (or ValueError) and printed as one line, without a traceback.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

from . import __version__


class UserError(Exception):
    """An error in the user's input, shown as one clear line."""


@dataclass
class Command:
    help: str
    example: str
    run: Callable[[argparse.Namespace], int | None]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        getattr(self.run, "add_arguments", lambda p: None)(parser)


COMMANDS: dict[str, Command] = {}


def command(name: str, help: str, example: str):
    """Register ``run(args)``; the decorated function's ``add_arguments`` attribute adds options."""
    def wrap(run):
        COMMANDS[name] = Command(help, example, run)
        return run
    return wrap


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Attention and the Transformer family: train, translate, generate, look inside.",
        epilog="Run 'attnlab COMMAND --help' for a command's options and an example.")
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help,
                           epilog=f"example:\n  {cmd.example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as e:
        print(f"attnlab {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnlab {args.command}: interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------- subcommands

def _train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=["translate"], help="what to train")
    p.add_argument("--data", help="training pairs, a TSV of source<TAB>target (default: the embedded corpus)")
    p.add_argument("--valid", help="validation TSV (default: 2%% of --data held out, or the embedded split)")
    p.add_argument("--out", default=None, help="run directory for checkpoints and metrics (default runs/TASK)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 2500 embedded, 100000 files)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="stop (with a checkpoint) after this many minutes")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--skip-malformed", action="store_true", help="skip and count malformed data lines")
    m = p.add_argument_group("model")
    m.add_argument("--tokenizer", choices=["word", "char", "bpe"], help="default: word (embedded), bpe (files)")
    m.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default 8000)")
    m.add_argument("--separate-vocab", action="store_true", help="separate source/target vocabularies")
    m.add_argument("--d-model", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--layers", type=int, help="encoder and decoder layers each")
    m.add_argument("--d-ff", type=int)
    m.add_argument("--dropout", type=float)
    m.add_argument("--pre-norm", action="store_true", help="Pre-Norm layers (default: Post-Norm, as the paper)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    o.add_argument("--schedule", choices=["noam", "cosine", "constant"], default="cosine")
    o.add_argument("--warmup", type=int, default=None, help="warmup steps (default 4%% of --steps)")
    o.add_argument("--max-tokens", type=int, default=4096, help="padded tokens per micro-batch")
    o.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--label-smoothing", type=float, default=0.1)
    o.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    o.add_argument("--grad-checkpointing", action="store_true")
    o.add_argument("--eval-every", type=int, default=None, help="steps between validations")
    o.add_argument("--eval-size", type=int, default=500, help="validation pairs decoded for BLEU")
    o.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


@command("train", "train a model on an embedded default data set or your own files",
         "attnlab train translate --steps 2500 --out runs/numbers")
def _train(args: argparse.Namespace) -> int:
    from .data.translation import TranslationOptions, prepare_translation
    from .train import TrainConfig, Trainer

    embedded = args.data is None
    steps = args.steps or (2500 if embedded else 100_000)
    out = args.out or f"runs/{args.task}"
    opts = TranslationOptions(
        data=args.data, valid=args.valid, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        shared_vocab=not args.separate_vocab, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
        d_ff=args.d_ff, dropout=args.dropout, norm_first=args.pre_norm, max_tokens=args.max_tokens,
        label_smoothing=args.label_smoothing, eval_size=args.eval_size, seed=args.seed)
    print(f"preparing data ({'embedded English->German corpus' if embedded else args.data}) ...", file=sys.stderr)
    setup = prepare_translation(opts, skip_malformed=args.skip_malformed)
    if setup.skipped:
        print(f"skipped {setup.skipped} training pairs (malformed or longer than {opts.max_len} tokens)", file=sys.stderr)
    model = setup.task.model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {len(setup.task.train)} training pairs, "
          f"vocab {setup.task.src_tok.vocab_size}/{setup.task.tgt_tok.vocab_size}", file=sys.stderr)
    eval_every = args.eval_every if args.eval_every is not None else max(steps // 10, 100)
    config = TrainConfig(
        out_dir=out, steps=steps, lr=args.lr or 1e-3, weight_decay=args.weight_decay, schedule=args.schedule,
        warmup_steps=args.warmup if args.warmup is not None else max(1, steps // 25), clip_norm=args.clip or None,
        accum_steps=args.accum, precision=args.precision, grad_checkpointing=args.grad_checkpointing,
        eval_every=eval_every, save_every=args.save_every if args.save_every is not None else eval_every,
        best_metric="bleu", best_mode="max", seed=args.seed, progress=not args.no_progress,
        time_budget_s=args.time_budget * 60 if args.time_budget else None)
    trainer = Trainer(setup.task, config, resume=args.resume)
    summary = trainer.fit()
    trainer.close()
    if trainer.env.is_main:
        _report_translation(out, setup)
        print(f"metrics: {out}/metrics.jsonl, loss curve: {out}/loss.png, checkpoint: {summary['checkpoint']}")
    return 0


_train.add_arguments = _train_args


def _report_translation(out: str, setup) -> None:
    """After training: a few held-out translations and the test scores (embedded corpus)."""
    from .data.translation import load_translator, score_translations
    from .generate import translate

    model, src_tok, tgt_tok = load_translator(out)
    pairs = setup.test or setup.task.valid[:500]
    hyps = translate(model, src_tok, tgt_tok, [s for s, _ in pairs], src_eos=False)
    for (s, t), h in list(zip(pairs, hyps))[:5]:
        print(f"  {s}\n    -> {h}\n    ref {t}")
    scores = score_translations(hyps, [t for _, t in pairs])
    name = "test" if setup.test else "validation"
    print(f"{name} ({len(pairs)} pairs): BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  "
          f"exact match {scores['exact']:.1f}%")


def _translate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run directory or checkpoint directory")
    p.add_argument("texts", nargs="*", help="sentences to translate (default: one per line from stdin)")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--length-penalty", type=float, default=1.0)


@command("translate", "translate sentences with a trained translation checkpoint",
         'attnlab translate runs/translate "the dog sees forty-seven cats"')
def _translate(args: argparse.Namespace) -> int:
    from .data.translation import load_translator
    from .generate import translate

    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    model, src_tok, tgt_tok = load_translator(args.checkpoint)
    for out in translate(model, src_tok, tgt_tok, texts, beam_size=args.beam, length_penalty=args.length_penalty,
                         src_eos=False):
        print(out)
    return 0


_translate.add_arguments = _translate_args


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run directory or checkpoint directory")
    p.add_argument("--data", required=True, help="TSV of source<TAB>reference")
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N pairs")
    p.add_argument("--skip-malformed", action="store_true")


@command("eval", "score a translation checkpoint on a TSV: BLEU, chrF, exact match",
         "attnlab eval runs/multi30k --data valid.de-en.tsv")
def _eval(args: argparse.Namespace) -> int:
    from .data.files import read_tsv
    from .data.translation import load_translator, score_translations
    from .generate import translate

    pairs = list(read_tsv(args.data, skip_malformed=args.skip_malformed))[: args.limit]
    model, src_tok, tgt_tok = load_translator(args.checkpoint)
    hyps = translate(model, src_tok, tgt_tok, [s for s, _ in pairs], beam_size=args.beam, src_eos=False)
    s = score_translations(hyps, [t for _, t in pairs])
    print(f"{args.data}: {len(pairs)} pairs, beam {args.beam}: BLEU {s['bleu']:.2f}  chrF {s['chrf']:.2f}  "
          f"exact match {s['exact']:.1f}%")
    return 0


_eval.add_arguments = _eval_args


def _viz_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="run directory or checkpoint directory")
    p.add_argument("text", help="the source sentence")
    p.add_argument("--out", default="attention.png", help="PNG to write")
    p.add_argument("--layer", type=int, default=None, help="one decoder layer (1-based; default: all)")
    p.add_argument("--head", type=int, default=None, help="one head (1-based; default: average of heads)")
    p.add_argument("--grid", action="store_true", help="one panel per layer and head")


@command("viz", "draw the cross-attention alignment of a translation as a PNG",
         'attnlab viz runs/translate "the dog sees forty-seven cats" --out align.png')
def _viz(args: argparse.Namespace) -> int:
    from .data.translation import load_translator
    from .viz.translation import draw_alignment

    model, src_tok, tgt_tok = load_translator(args.checkpoint)
    path, translation = draw_alignment(model, src_tok, tgt_tok, args.text, args.out, layer=args.layer,
                                       head=args.head, grid=args.grid)
    print(translation)
    print(f"wrote {path}")
    return 0


_viz.add_arguments = _viz_args



if __name__ == "__main__":
    sys.exit(main())
