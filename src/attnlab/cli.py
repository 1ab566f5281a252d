"""The ``attnlab`` command: a table of subcommands, each a function with an example in its help.

Each subcommand below registers itself in ``COMMANDS`` with (help, example, add_arguments,
run); the work itself lives in the library (train/, generate.py, viz/), imported lazily so
that ``attnlab --help`` stays fast. Errors that come from the user's input (a malformed file, a bad option) are raised as
``UserError`` (or ValueError) and printed as one line, without a traceback.
"""
from __future__ import annotations

import argparse
import os
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
    p.add_argument("task", choices=["translate", "lm"], help="what to train: translate (encoder-decoder) or lm "
                   "(a causal language model; options in the 'language model' group)")
    p.add_argument("--data", help="translate: a TSV of source<TAB>target; lm: a UTF-8 text file "
                   "(default: the embedded corpus)")
    p.add_argument("--valid", help="validation TSV / text file (default: 2%% of --data held out for translate, "
                   "its last 10%% for lm, or the embedded split)")
    p.add_argument("--out", default=None, help="run directory for checkpoints and metrics (default runs/TASK)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: translate 400 embedded, "
                   "100000 files; lm 2000)")
    p.add_argument("--time-budget", type=float, default=None, metavar="MIN",
                   help="stop (with a checkpoint) after this many minutes")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    p.add_argument("--skip-malformed", action="store_true", help="skip and count malformed data lines")
    m = p.add_argument_group("model")
    m.add_argument("--tokenizer", choices=["word", "char", "bpe"], help="default: word (embedded), bpe (files); "
                   "lm: bpe (embedded), char (files)")
    m.add_argument("--vocab-size", type=int, help="BPE vocabulary size (default 8000; lm 2000)")
    m.add_argument("--separate-vocab", action="store_true", help="separate source/target vocabularies")
    m.add_argument("--d-model", type=int)
    m.add_argument("--heads", type=int)
    m.add_argument("--layers", type=int, help="encoder and decoder layers each")
    m.add_argument("--d-ff", type=int)
    m.add_argument("--dropout", type=float)
    m.add_argument("--pre-norm", action="store_true", help="Pre-Norm layers (default: Post-Norm, as the paper)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=None, help="peak learning rate (default: translate 2e-3 embedded, "
                   "1e-3 files; lm 1e-3)")
    o.add_argument("--schedule", choices=["noam", "cosine", "constant"], default="cosine")
    o.add_argument("--warmup", type=int, default=None, help="warmup steps (default: translate 10%% of --steps, "
                   "at most 4000; lm 4%%)")
    o.add_argument("--max-tokens", type=int, default=None, help="translate: padded tokens per micro-batch "
                   "(default 2048 embedded, 4096 files)")
    o.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--label-smoothing", type=float, default=0.1)
    o.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping (0 = off)")
    o.add_argument("--weight-decay", type=float, default=0.01)
    o.add_argument("--beta2", type=float, default=None, help="AdamW's second-moment decay (default: translate "
                   "0.98, lm 0.95)")
    o.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    o.add_argument("--grad-checkpointing", action="store_true")
    o.add_argument("--eval-every", type=int, default=None, help="steps between validations")
    o.add_argument("--eval-size", type=int, default=500, help="validation pairs decoded for BLEU")
    o.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    _lm_train_args(p)


@command("train", "train a model on an embedded default data set or your own files",
         "attnlab train translate --steps 400 --out runs/numbers\n"
         "  attnlab train lm --data input.txt --model llama --context 256 --out runs/shakespeare")
def _train(args: argparse.Namespace) -> int:
    if args.task == "lm":
        return _train_lm(args)
    _only_for("translate", args, _LM_ONLY)
    from .data.translation import TranslationOptions, prepare_translation
    from .train import TrainConfig, Trainer

    embedded = args.data is None
    steps = args.steps or (400 if embedded else 100_000)
    out = args.out or f"runs/{args.task}"
    opts = TranslationOptions(
        data=args.data, valid=args.valid, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        shared_vocab=not args.separate_vocab, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
        d_ff=args.d_ff, dropout=args.dropout, norm_first=args.pre_norm,
        max_tokens=args.max_tokens or (2048 if embedded else 4096),
        label_smoothing=args.label_smoothing, eval_size=args.eval_size, seed=args.seed)
    print(f"preparing data ({'embedded English->German corpus' if embedded else args.data}) ...", file=sys.stderr)
    setup = prepare_translation(opts, skip_malformed=args.skip_malformed)
    if setup.skipped:
        print(f"skipped {setup.skipped} training pairs (malformed or longer than {opts.max_len} tokens)", file=sys.stderr)
    model = setup.task.model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {len(setup.task.train)} training pairs, "
          f"vocab {setup.task.src_tok.vocab_size}/{setup.task.tgt_tok.vocab_size}", file=sys.stderr)
    eval_every = args.eval_every if args.eval_every is not None else max(steps // 5, 100)
    config = TrainConfig(
        out_dir=out, steps=steps, lr=args.lr or (2e-3 if embedded else 1e-3), weight_decay=args.weight_decay,
        betas=(0.9, 0.98 if args.beta2 is None else args.beta2),
        schedule=args.schedule, clip_norm=args.clip or None,
        warmup_steps=args.warmup if args.warmup is not None else min(4000, max(1, steps // 10)),
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


# ---------------------------------------------------------------- language models (train lm, generate)

_LM_ONLY = ("model", "context", "batch_size", "experts", "top_k", "aux_coef", "corpus_mb", "eval_windows",
            "sample_tokens")
_TRANSLATE_ONLY = ("separate_vocab", "pre_norm", "skip_malformed", "max_tokens", "label_smoothing", "eval_size")


def _lm_train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "language model (train lm only)",
        "defaults for lm: --model gpt --layers 4 --heads 4 --d-model 128 --d-ff 4*d-model (gpt) or\n"
        "8/3*d-model (llama, mixtral) --dropout 0 --context 128 --batch-size 16 --steps 2000 --lr 1e-3\n"
        "(cosine to 10%, AdamW betas 0.9, 0.95). Data: the Python standard library's own source\n"
        "(2 MB, BPE 2000, every 20th file validates) or --data FILE.txt (char, the last 10% validates).")
    g.add_argument("--model", metavar="{gpt,llama,mixtral}", help="architecture (default gpt)")
    g.add_argument("--context", type=int, help="context length and training window in tokens (default 128)")
    g.add_argument("--batch-size", type=int, help="windows per micro-batch and process (default 16)")
    g.add_argument("--experts", type=int, help="mixtral: experts per layer (default 4)")
    g.add_argument("--top-k", type=int, help="mixtral: experts per token (default 2)")
    g.add_argument("--aux-coef", type=float, help="mixtral: weight of the load-balancing loss (default 0.02)")
    g.add_argument("--corpus-mb", type=float, help="size of the embedded corpus in MB (default 2)")
    g.add_argument("--eval-windows", type=int, help="validation windows per evaluation (default 64)")
    g.add_argument("--sample-tokens", type=int, help="tokens of the sample printed after training (default 200, "
                   "0 = none)")
    p.set_defaults(_flag_defaults={d: p.get_default(d) for d in _LM_ONLY + _TRANSLATE_ONLY})


def _only_for(task: str, args: argparse.Namespace, others: tuple[str, ...]) -> None:
    """Refuse options of the other task instead of silently ignoring them."""
    given = ["--" + d.replace("_", "-") for d in others if getattr(args, d) != args._flag_defaults[d]]
    if given:
        other = "lm" if task == "translate" else "translate"
        raise UserError(f"{', '.join(given)}: only for 'attnlab train {other}', not 'train {task}'")


def _train_lm(args: argparse.Namespace) -> int:
    from .data.lm import LMOptions, prepare_lm
    from .train import TrainConfig, Trainer

    _only_for("lm", args, _TRANSLATE_ONLY)
    given = dict(model=args.model, tokenizer=args.tokenizer, vocab_size=args.vocab_size, context=args.context,
                 batch_size=args.batch_size, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
                 d_ff=args.d_ff, dropout=args.dropout, num_experts=args.experts, top_k=args.top_k,
                 router_aux_loss_coef=args.aux_coef, eval_windows=args.eval_windows,
                 corpus_bytes=None if args.corpus_mb is None else int(args.corpus_mb * 1e6))
    opts = LMOptions(data=args.data, valid=args.valid, seed=args.seed,
                     **{k: v for k, v in given.items() if v is not None})
    for path in (args.data, args.valid):
        if path is not None and not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
    steps, out = args.steps or 2000, args.out or "runs/lm"
    print(f"preparing data ({'the embedded corpus' if args.data is None else args.data}) ...", file=sys.stderr)
    setup = prepare_lm(opts, resume_from=out if args.resume else None)
    task = setup.task
    n_params = sum(p.numel() for p in task.model.parameters())
    print(f"data: {setup.corpus.source}: {len(task.train_ids):,} training and {len(task.valid_ids):,} validation "
          f"tokens", file=sys.stderr)
    print(f"model: {type(task.model).__name__}, {n_params / 1e6:.2f}M parameters, context {task.context}, "
          f"vocab {task.tokenizer.vocab_size}{' (from the checkpoint)' if setup.resumed else ''}", file=sys.stderr)
    eval_every = args.eval_every if args.eval_every is not None else max(steps // 10, 50)
    config = TrainConfig(
        out_dir=out, steps=steps, lr=args.lr or 1e-3, weight_decay=args.weight_decay,
        betas=(0.9, 0.95 if args.beta2 is None else args.beta2), eps=1e-8,
        schedule=args.schedule, warmup_steps=args.warmup if args.warmup is not None else max(1, steps // 25),
        min_lr_ratio=0.1, clip_norm=args.clip or None, accum_steps=args.accum, precision=args.precision,
        grad_checkpointing=args.grad_checkpointing, eval_every=eval_every,
        save_every=args.save_every if args.save_every is not None else eval_every, best_metric="val_loss",
        best_mode="min", seed=args.seed, progress=not args.no_progress,
        time_budget_s=args.time_budget * 60 if args.time_budget else None)
    trainer = Trainer(task, config, resume=args.resume)
    summary = trainer.fit()
    trainer.close()
    if trainer.env.is_main:
        _lm_sample(out, task, args)
        print(f"metrics: {out}/metrics.jsonl, loss curve: {out}/loss.png, checkpoint: {summary['checkpoint']}")
    return 0


def _lm_sample(out: str, task, args: argparse.Namespace) -> None:
    """After training: the best checkpoint continues the start of the validation text."""
    from .data.lm import complete, load_lm

    n = 200 if args.sample_tokens is None else args.sample_tokens
    if n <= 0:
        return
    lm = load_lm(out)
    prompt = task.valid_ids[: max(1, min(16, lm.context // 4))].tolist()
    result = complete(lm, prompt, n, temperature=0.8, top_k=40, seed=args.seed)
    print("sample (the start of the validation text, continued at temperature 0.8, top-k 40):")
    print(lm.tokenizer.decode(prompt) + result.text)


def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="an LM run directory (its best/, else latest checkpoint), an LM checkpoint "
                   "directory, or a Hugging Face model directory (config.json, weights, tokenizer.json)")
    p.add_argument("--prompt", default="", help="the text to continue (default: empty, i.e. a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="at most this many tokens, fewer if the "
                   "context fills up (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens of mass p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty, > 1 discourages repeats")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--draft", metavar="DRAFT_DIR", help="a smaller model with the same tokenizer for speculative "
                   "decoding (same output distribution, fewer passes of the model); prints the passes per token")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none",
                   help="int8: int8 weight-only quantisation of every Linear layer, the output head included "
                   "(and the draft's), after loading: Linear weights 4x smaller (GPT-2 small: 498 -> 282 MB in "
                   "all), faster decoding on CPU (attnlab.quantize; default none)")


@command("generate", "continue a prompt with a language model (LM checkpoint or Hugging Face directory), "
         "streaming the text", 'attnlab generate runs/lm --prompt "def fibonacci(n):" --max-new-tokens 200')
def _generate(args: argparse.Namespace) -> int:
    from .data.lm import complete, encode_prompt, load_lm

    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    lm = load_lm(args.checkpoint, args.device)
    draft = load_lm(args.draft, next(lm.model.parameters()).device) if args.draft else None
    if args.quantize == "int8":
        from .quantize import model_bytes, quantize_int8
        for m in (lm, draft):
            if m is not None:
                before = model_bytes(m.model)
                quantize_int8(m.model)
                print(f"quantized {m.path} to int8: {before / 2**20:.1f} -> {model_bytes(m.model) / 2**20:.1f} MiB "
                      "of weights", file=sys.stderr)
    ids = encode_prompt(lm, args.prompt, draft)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    emit(args.prompt)
    result = complete(lm, ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed, draft=draft,
                      num_draft_tokens=args.num_draft_tokens, on_text=emit)
    emit("\n")
    if result.max_new_tokens < args.max_new_tokens and result.new_tokens == result.max_new_tokens:
        print(f"note: stopped after {result.new_tokens} new tokens: the context is full", file=sys.stderr)
    if draft is not None:
        s = result.stats
        print(f"speculative decoding: {s.target_passes_per_token:.2f} target forward passes per generated token "
              f"({s.target_passes} passes for {s.new_tokens} tokens; {s.accepted} of {s.drafted} draft tokens "
              f"accepted)", file=sys.stderr)
    return 0


_generate.add_arguments = _generate_args


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
    p.add_argument("checkpoint", help="a translation run or checkpoint directory, or a language model: an LM run "
                   "or checkpoint directory or a Hugging Face model directory")
    p.add_argument("--data", required=True, help="translation: a TSV of source<TAB>reference; language model: "
                   "a UTF-8 text file (scored as one document)")
    p.add_argument("--beam", type=int, default=4, help="translation: beam size (1 = greedy)")
    p.add_argument("--limit", type=int, default=None, help="translation: score only the first N pairs; "
                   "language model: only the first N tokens")
    p.add_argument("--skip-malformed", action="store_true", help="translation: skip malformed TSV lines")
    p.add_argument("--stride", type=int, default=None, help="language model: tokens between the starts of the "
                   "sliding windows (default: half the context; every token is scored once)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none", help="language model: int8 also "
                   "scores the model after int8 weight-only quantisation and prints the change")
    p.add_argument("--device", default=None, help="language model: cpu, cuda, ... (default: cuda if available)")


@command("eval", "score a model on your data: BLEU, chrF and exact match of a translation checkpoint on a "
         "TSV, or the perplexity of a language model on a text file",
         "attnlab eval runs/multi30k --data valid.de-en.tsv\n"
         "  attnlab eval runs/lm --data held_out.txt --quantize int8")
def _eval(args: argparse.Namespace) -> int:
    from .data.lm import is_language_model
    if is_language_model(args.checkpoint):
        return _eval_lm(args)
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


def _eval_lm(args: argparse.Namespace) -> int:
    from .data.lm import load_lm, read_text_file, text_perplexity

    text = read_text_file(args.data)
    lm = load_lm(args.checkpoint, args.device)
    progress = sys.stderr.isatty()

    def score(label: str) -> dict:
        r = text_perplexity(lm, text, stride=args.stride, max_tokens=args.limit, progress=progress)
        print(f"{label}: loss {r['loss']:.4f} nats/token, perplexity {r['ppl']:.4f}, "
              f"{r['bits_per_byte']:.4f} bits per byte")
        return r

    first = score(f"{args.data}: {lm.path}")
    print(f"  ({first['tokens']:,} tokens scored in {first['windows']} windows of up to {first['context']} "
          f"tokens, stride {first['stride']})")
    if args.quantize == "int8":
        from .quantize import quantize_int8
        quantize_int8(lm.model)
        second = score("int8 weight-only (attnlab.quantize)")
        print(f"  perplexity change with int8: {(second['ppl'] / first['ppl'] - 1) * 100:+.2f} %")
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
