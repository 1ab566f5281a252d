"""``attnlab eval RUN --data FILE``: score a model on your data, as its task scores it.

The run's recorded task (or a Hugging Face directory's architecture) decides what is measured:
BLEU, chrF and exact match for translation, perplexity and bits per byte for a language model,
accuracy, macro-F1, per-class precision, recall and F1 (and a confusion-matrix PNG) for a classifier;
an image run is scored on an image folder, and its confusion matrix is written into the run
directory (``confusion.png``) unless ``--plot`` names another file.
Each task declares its own evaluation options; an option of another task is refused.
"""
from __future__ import annotations

import argparse

from . import kv_options

HELP = ("score a model on your data: BLEU, chrF and exact match of a translation run on a TSV, the "
        "perplexity of a language model on a text file, a classifier's accuracy, macro-F1 and confusion matrix, "
        "an image classifier's on an image folder (confusion.png in its run directory), or a masked-LM run's "
        "masked-token accuracy on a documents file")
EXAMPLE = ("attnlab eval runs/multi30k --data valid.de-en.tsv\n"
           "  attnlab eval runs/lm --data held_out.txt --quantize int8\n"
           "  attnlab eval model.gguf --data book.txt --kv-cache int8 --prefill-chunk 256 --limit 4000\n"
           "  attnlab eval runs/classify --data test.tsv --plot confusion.png\n"
           "  attnlab eval runs/image --data photos/val              # writes runs/image/confusion.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..tasks import registered_tasks
    p.add_argument("checkpoint", help="a run directory or checkpoint, a Hugging Face model directory or a GGUF file")
    p.add_argument("--data", required=True, help="the data to score, in the task's format (translation: a TSV of "
                   "source<TAB>reference; language model: a UTF-8 text file; classifier: a TSV, CSV or JSON-lines file "
                   "with the run's text and label columns; image classifier: an image folder, one sub-folder per "
                   "class; masked LM: documents separated by blank lines); for a "
                   "translation or classify run also a directory, whose test.tsv (else its dev or valid file) is "
                   "scored. A file of another task's layout is refused, naming the task that reads it")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default=None,
                   help="precision of the large Linear layers' products (bf16 weight copies, fp32 activations); "
                   "auto = bf16 where the device does bf16 natively, fp32 elsewhere (default: auto for a "
                   "language model, fp32 for translation)")
    kv_options.add_arguments(p)
    seen: set[str] = set()
    for name, task in registered_tasks().items():
        group = p.add_argument_group(f"{name} runs")
        for o in task.eval_options or ():
            if o.name in seen:
                continue
            seen.add(o.name)
            users = ", ".join(n for n, t in registered_tasks().items() if o.name in {x.name for x in t.eval_options or ()})
            default = "" if o.default is None else f" (default: {o.default})"
            if o.type is bool:
                group.add_argument(o.flag, dest=o.name, action="store_true", default=None,
                                   help=f"{users}: {o.help}")
            else:
                group.add_argument(o.flag, dest=o.name, type=o.type, default=None, choices=o.choices,
                                   help=f"{users}: {o.help}{default}")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks import registered_tasks
    tasks = registered_tasks()
    kinds = tuple(t.kind for t in tasks.values() if t.eval_options is not None)
    info, kind = open_model_path(args.checkpoint, "eval", kinds)
    task = tasks[info.run.task] if info.kind == "run" else next(t for t in tasks.values() if t.kind == kind)
    mine = {o.name for o in task.eval_options}
    others = sorted({o.flag for t in tasks.values() for o in t.eval_options or ()
                     if o.name not in mine and getattr(args, o.name) is not None})
    if others:
        raise UserError(f"{', '.join(others)}: not an option for {info.describe()}")
    given = {o.name: getattr(args, o.name) for o in task.eval_options if getattr(args, o.name) is not None}
    settings = task.eval_settings(**given)          # typed, each value validated once (ValueError naming it)
    extra = {} if args.dtype is None else {"dtype": args.dtype}          # None: the task's own default
    kv = kv_options.options(args)
    if kv["kv_cache"] is not None or kv["prefill_chunk"] is not None:
        if task.kind != "causal-lm":
            raise UserError(f"--kv-cache, --prefill-chunk: for a language model, not for {info.describe()}")
        extra["kv"] = kv
    task.evaluate_file(args.checkpoint, info, args.data, settings, args.device, **extra)
    return 0
