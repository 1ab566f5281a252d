"""Causal language modelling: a text corpus + a tokenizer + a decoder-only LM, for the Trainer.

    attnlab train lm                                       # the embedded corpus: Python's own source
    attnlab train lm --config shakespeare-char --data input.txt
    lm = load_lm("runs/lm")                                # best/ or latest checkpoint, or a Hugging Face dir
    text_perplexity(lm, open("held_out.txt").read())      # {"tokens", "loss", "ppl", "bits_per_byte"}

Data: :mod:`attnlab.data.text` (the standard library's source, every 20th file validating, or a
text file whose last 10 % validates). The tokenizer is trained on the training text only.

Batches (nanoGPT's sampling). ``plan(epoch, seed)`` draws ``steps_per_epoch`` micro-batches of
``batch_size`` random window starts i with a generator seeded by (seed, epoch); the window is
x = ids[i : i+T], y = ids[i+1 : i+T+1], T = the model's context. Only the starts are planned,
so an epoch's plan is small whatever the corpus size.

Models: any registered family of kind "causal-lm" (``--model NAME``), sized by the task's options
through the family's sizing builder, with the options the family adds itself (its
``register_family(options=...)``), which are refused with another family.

Defaults (each one overridden by its flag). The embedded corpus trains a small GPT-2 for 2,000
steps as it always has. A file's model, context and batch follow its number of training tokens
(:data:`FILE_SIZES`; Tiny Shakespeare's million characters get nanoGPT's shapes); with
``--time-budget`` and no ``--steps`` the schedule is sized to end with the budget and sized again
whenever the measured speed drifts (:mod:`attnlab.train.budget`). The chosen values are printed
and saved in the run's config.yaml.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.text import encode_documents, stdlib_corpus, text_file_corpus
from ..tokenizer import Tokenizer
from .. import models as _models  # noqa: F401  (registers every family: the --model default reads them)
from ..models.registry import default_family
from .settings import EvalSettings, Settings
from .base import (Option, Setup, TaskDefinition, beyond_specials, describe_training, family_recipe, fraction,
                   non_negative, positive, register_task, training_schedule)
from .distill import DISTILL_OPTIONS, Teacher, check_distillation
from .sft import FINE_TUNING_OPTIONS, fine_tuning, prepare_fine_tuning
from .run import (RunError, RunInfo, build_model, inspect_path, load_model, load_tokenizers, model_context, resume_point,
                  write_run)

__all__ = ["LanguageModelTask", "LanguageModeling", "LoadedLM", "load_lm", "text_perplexity"]

_M, _D = "model", "data and evaluation"

# A file's defaults by its number of training tokens: (at most this many tokens, sizes). The
# second row is nanoGPT's Shakespeare model (with half its batch, for CPUs); larger corpora get
# GPT-2-like widths and longer contexts. No dropout by default: some families have none (the
# shakespeare-char recipe asks for nanoGPT's 0.2 on long runs).
FILE_SIZES: list[tuple[float, dict]] = [
    (300_000, dict(d_model=128, heads=4, layers=4, context=128, batch_size=16, dropout=0.0, lr=1e-3, warmup=100,
                   steps=2000)),
    (3_000_000, dict(d_model=384, heads=6, layers=6, context=256, batch_size=32, dropout=0.0, lr=1e-3, warmup=100,
                     steps=5000)),
    (30_000_000, dict(d_model=512, heads=8, layers=8, context=512, batch_size=32, dropout=0.0, lr=6e-4,
                      warmup=500, steps=20000)),
    (float("inf"), dict(d_model=768, heads=12, layers=12, context=1024, batch_size=32, dropout=0.0, lr=6e-4,
                        warmup=2000, steps=100_000)),
]
# The embedded corpus: the small GPT-2 this task has always trained there.
EMBEDDED_SIZES = dict(d_model=128, heads=4, layers=4, context=128, batch_size=16, dropout=0.0, lr=1e-3, warmup=None,
                      steps=2000)
BUDGET_EVALS = 4             # evaluations (and checkpoints) spread over a schedule sized by --time-budget


def bpe_vocab_size(chars: int) -> int:
    """The default BPE vocabulary for a training text of ``chars`` characters."""
    return 2000 if chars <= 3_000_000 else 8000 if chars <= 30_000_000 else 16000


class LanguageModelTask:
    """The Trainer's view of next-token prediction (see :class:`attnlab.train.Task`).

    ``loss`` = the cross-entropy SUM over the B*T predicted tokens, n = B*T, plus, for a model
    with an auxiliary loss (a mixture of experts' load balancing), ``coef * aux * n``, so that
    after the Trainer divides by the step's tokens it is coef * aux. Extras are the model's own
    statistics (``aux_loss``, each expert's share of the routing), logged per token. With a
    ``teacher`` (:class:`attnlab.tasks.distill.Teacher`) the cross-entropy is its distillation loss.
    """

    def __init__(self, model: nn.Module, tokenizer, train_ids: Tensor, valid_ids: Tensor, *, context: int,
                 batch_size: int, steps_per_epoch: int | None = None, eval_windows: int = 64, teacher=None):
        self.model, self.tokenizer, self.teacher = model, tokenizer, teacher
        self.train_ids, self.valid_ids = train_ids.long().cpu(), valid_ids.long().cpu()
        self.context, self.batch_size, self.eval_windows = context, batch_size, eval_windows
        limit = model_context(model)                   # as the family states it; None: no limit (a recurrent model)
        if limit is not None and context > limit:
            raise ValueError(f"LanguageModelTask: context {context} exceeds the model's {limit}")
        for name, ids in (("training", self.train_ids), ("validation", self.valid_ids)):
            if ids.dim() != 1 or len(ids) < context + 1:
                raise ValueError(f"the {name} text has {len(ids)} tokens, fewer than context + 1 = {context + 1}; "
                                 "use a smaller context or more text")
        per_epoch = len(self.train_ids) // (batch_size * context)
        self.steps_per_epoch = steps_per_epoch or max(64, min(4096, per_epoch))
        self._offsets = torch.arange(context + 1)

    def windows(self, ids: Tensor, starts: Tensor) -> tuple[Tensor, Tensor]:
        """Starts (B,) -> x = ids[i : i+T] and y = ids[i+1 : i+T+1], each (B, T)."""
        w = ids[starts.cpu()[:, None] + self._offsets]
        return w[:, :-1], w[:, 1:]

    def plan(self, epoch: int, seed: int) -> list[dict]:
        state = np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32)
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        high = len(self.train_ids) - self.context               # starts in [0, len - T - 1]
        starts = torch.randint(0, high, (self.steps_per_epoch, self.batch_size), generator=g)
        return [{"start": s} for s in starts]

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        device = batch["start"].device
        x, y = (t.to(device) for t in self.windows(self.train_ids, batch["start"]))
        logits = model(x)                       # through the (DDP) wrapper: gradients synchronise
        n = y.numel()
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") if self.teacher is None \
            else self.teacher.loss(x, logits, y)
        # a model's auxiliary loss (a mixture of experts' load balancing) comes from the model itself
        aux = self.model.aux_loss() if hasattr(self.model, "aux_loss") else None
        if aux is None:
            return loss, n, {}
        loss = loss + self.model.aux_loss_coef * aux * n
        stats = {k: v * n for k, v in self.model.aux_stats().items()}
        return loss, n, {"aux_loss": aux.detach() * n, **stats}

    def eval_starts(self) -> Tensor:
        """The validation windows' starts: ``eval_windows`` evenly spaced, the same every time."""
        last = len(self.valid_ids) - self.context - 1
        n = min(self.eval_windows, last + 1)
        return torch.arange(n) * last // max(n - 1, 1)     # integers: exact for any corpus size

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        nll, tokens = 0.0, 0
        for starts in self.eval_starts().split(self.batch_size):
            x, y = (t.to(device) for t in self.windows(self.valid_ids, starts))
            nll += float(F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="sum"))
            tokens += y.numel()
        loss = nll / tokens
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "lm", self.model, {"text": self.tokenizer},
                  {"context": self.context, **(self.teacher.run_options() if self.teacher else {})})


@dataclass
class LoadedLM:
    """A causal LM ready to generate: the model (eval mode), its tokenizer and special ids."""
    model: nn.Module
    tokenizer: Tokenizer
    eos_ids: list[int]                 # generation stops at any of these
    start_id: int | None               # the token an empty prompt begins with
    path: Path
    kind: str                          # "attnlab" | "huggingface"
    precision: str = "fp32"            # the line prepare_for_inference returned: dtype chosen and why

    @property
    def context(self) -> int | None:
        """The longest sequence the model takes, as its family states it; None for one without a
        limit (a recurrent model)."""
        return model_context(self.model)

    def vocabulary(self) -> dict:
        return self.tokenizer.vocabulary()

    def unknown_tokens(self, ids) -> int:
        """How many of ``ids`` are the tokenizer's ``<unk>``: text outside the vocabulary (a
        character the char tokenizer never saw), which the model can only see as ``<unk>``."""
        unk = getattr(self.tokenizer, "unk_id", None)
        return 0 if unk is None else sum(1 for i in ids if i == unk)

    def warn_unknown(self, ids, what: str) -> None:
        """Say on stderr how many tokens of ``what`` are ``<unk>`` (nothing if none)."""
        n = self.unknown_tokens(ids)
        if n:
            print(f"warning: {n} of {len(ids)} tokens of {what} are outside the vocabulary of {self.path} "
                  "and become <unk>", file=sys.stderr)

    def encode_prompt(self, prompt: str, draft: "LoadedLM | None" = None) -> list[int]:
        """The prompt's ids (an empty prompt: the start token); ValueError if they fill the context
        of the model (or of the draft) or if the draft's vocabulary differs."""
        if draft is not None and draft.vocabulary() != self.vocabulary():
            raise ValueError(f"the draft model {draft.path} has a different tokenizer from {self.path}")
        ids = self.tokenizer.encode(prompt) if prompt else []
        if not ids:
            if self.start_id is None:
                raise ValueError(f"{self.path}: no BOS or EOS token to start from; give a prompt")
            ids = [self.start_id]
        contexts = [m.context for m in (self, draft) if m is not None and m.context is not None]
        context = min(contexts, default=None)
        if context is not None and len(ids) >= context:
            raise ValueError(f"the prompt is {len(ids)} tokens long, but the model's context is {context} tokens "
                             f"(a prompt may have at most {context - 1})")
        return ids

    def complete(self, prompt_ids: list[int], max_new_tokens: int, draft: "LoadedLM | None" = None, **options):
        """:func:`attnlab.generate.text.complete` with this model's tokenizer and EOS ids."""
        from ..generate.text import complete
        return complete(self.model, self.tokenizer, prompt_ids, max_new_tokens, eos_ids=self.eos_ids,
                        draft_model=None if draft is None else draft.model, **options)


def _device(device):
    from .run import resolve_device
    return resolve_device(device)


class LanguageModeling(TaskDefinition):
    name = "lm"
    kind = "causal-lm"
    data_paths = ("file", "directory")     # --data DIR: every .txt file in it (attnlab.data.text)
    data_help = "a UTF-8 text file, or a directory of .txt files (valid.txt validates)"
    help = "a decoder-only language model (any registered causal-LM family) on text"
    example = ('attnlab train lm --steps 2000 --out runs/lm\n'
               '  attnlab train lm --config shakespeare-char --data input.txt --out runs/shakespeare')
    options = [
        Option("model", str, default_family("causal-lm"), "architecture: a registered causal-LM family", group=_M),
        Option("tokenizer", str, None, "default: bpe (embedded corpus), char (files)", choices=("char", "bpe"),
               group=_M),
        Option("vocab_size", int, None, "BPE vocabulary size (default 2000; 8000 over 3M characters, 16000 over "
               "30M)", check=beyond_specials, group=_M),
        Option("context", int, None, "context length and training window in tokens (default 128; files: by "
               "corpus size, 256 for ~1M tokens)", check=positive, group=_M),
        Option("batch_size", int, None, "windows per micro-batch and process (default 16; files: by corpus size)",
               check=positive, group=_M),
        Option("d_model", int, None, "model width (default 128; files: by corpus size, 384 for ~1M tokens)",
               check=positive, group=_M),
        Option("heads", int, None, "attention heads (default 4; files: by corpus size)", check=positive, group=_M),
        Option("layers", int, None, "layers (default 4; files: by corpus size, 6 for ~1M tokens)", check=positive,
               group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's, e.g. 4 d_model)",
               check=positive, group=_M),
        Option("dropout", float, 0.0, "dropout (the shakespeare-char recipe: 0.2)",
               check=fraction, group=_M),
        Option("corpus_mb", float, 2.0, "size of the embedded corpus in MB", check=positive, group=_D),
        Option("eval_windows", int, 64, "validation windows per evaluation", check=positive, group=_D,
               resumable=True),
        Option("sample_tokens", int, 200, "tokens of the sample printed after training (0 = none)",
               check=non_negative, group=_D, resumable=True),
        *FINE_TUNING_OPTIONS,
        *DISTILL_OPTIONS,
    ]

    eval_options = [
        Option("stride", int, None, "tokens between the starts of the sliding windows (default: half the "
               "context; every token is scored once)", check=positive),
        Option("limit", int, None, "score only the first N items", check=positive),
        Option("quantize", str, "none", "int8: also score the model after int8 weight-only quantisation and "
               "print the change", choices=("none", "int8")),
    ]

    # ------------------------------------------------------------------ training
    def check(self, s: Settings) -> None:
        from ..models.registry import families, family
        known = sorted(f.model_type for f in families(kind=self.kind))
        if s.model not in known:
            raise ValueError(f"--model: {s.model!r} is not a registered causal-LM family ({', '.join(known)})")
        check_distillation(s)
        super().check(s)

    def _model(self, s: Settings, tok) -> nn.Module:
        from ..models.registry import family
        fam = family(s.model)
        config = fam.build_config(vocab_size=tok.vocab_size, context=s.context, d_model=s.d_model,
                                  num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                  dropout=s.dropout, **self.family_sizes(s, tok))
        torch.manual_seed(s.seed)              # the initial weights depend on the seed alone
        return fam.for_kind(self.kind).build(config)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        teacher = Teacher.load(s, resume_from, load_lm) if s.teacher is not None else None   # tasks.distill
        if fine_tuning(s):                  # --init, --lora or a chat file: attnlab.tasks.sft
            return prepare_fine_tuning(self, s, resume_from, LanguageModelTask)
        corpus = stdlib_corpus(int(s.corpus_mb * 1e6)) if s.data is None else text_file_corpus(s.data,
                                                                                                      s.valid)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        self.apply_family_defaults(s)
        if saved is not None:               # the run's own tokenizer and model; the Trainer loads the weights
            tok = load_tokenizers(saved)["text"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
            context = saved.task_options["context"]
        elif teacher is not None:           # a distilled student reads with its teacher's tokenizer
            tok = teacher.student_tokenizer(s)
        else:
            kind = s.tokenizer or ("bpe" if s.data is None else "char")
            s.tokenizer = kind
            if s.vocab_size is None and kind == "bpe":
                s.vocab_size = 2000 if s.data is None else bpe_vocab_size(sum(map(len, corpus.train)))
            tok = Tokenizer.registry[kind].train(corpus.train, s.vocab_size)
        train = encode_documents(tok, corpus.train, corpus.eos_between)
        valid = encode_documents(tok, corpus.valid, corpus.eos_between)
        d = self._sizes(s, len(train))
        t = self._schedule(s, d)
        s.update({k: v for k, v in d.items() if k in s and k not in ("steps", "warmup", "lr")}, lr=t["lr"])
        if not t["budget_schedule"]:        # a budget's steps are planned in training, kept in its checkpoints
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        if saved is None:
            model, context = self._model(s, tok), s.context
        task = LanguageModelTask(model, tok, train, valid, context=context, batch_size=s.batch_size,
                                 eval_windows=s.eval_windows, teacher=teacher and teacher.check_student(model))
        n_params = sum(p.numel() for p in model.parameters())
        lines = [f"data: {corpus.source}: {len(train):,} training and {len(valid):,} validation tokens",
                 f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters, context {context}, "
                 f"vocab {tok.vocab_size}{' (from the checkpoint)' if saved else ''}"]
        lines += self._describe(s, d, t, len(train), saved) + ([teacher.describe()] if teacher else [])
        return Setup(task, lines, schedule=t)

    # ------------------------------------------------------------------ defaults
    def _sizes(self, s: Settings, n_tokens: int) -> dict:
        """The model, context, batch and optimisation defaults for ``n_tokens`` training tokens
        (the embedded corpus: its own), each replaced by its option when given."""
        base = EMBEDDED_SIZES if s.data is None else next(v for most, v in FILE_SIZES if n_tokens <= most)
        base = dict(base, **family_recipe(s, s.model))
        return s.given_or(base)

    def _schedule(self, s: Settings, d: dict) -> dict:
        """The Trainer's length, lr, warmup and evaluation defaults (flags win)."""
        def warmup(steps: int, budget: bool) -> int:
            if budget:                    # shortened to a tenth of the planned steps if the budget is short
                return d["warmup"] or 80
            return max(1, steps // 25) if d["warmup"] is None else min(d["warmup"], max(1, steps // 10))

        return training_schedule(s, d, warmup, lambda steps, budget: max(250 if budget else steps // 10, 50),
                                 BUDGET_EVALS)

    def _describe(self, s: Settings, d: dict, t: dict, n_tokens: int, saved) -> list[str]:
        """One line per group of the chosen values (as ``attnlab train`` prints them)."""
        model = "model: from the checkpoint" if saved is not None else (
            f"model (for {n_tokens:,} tokens): {s.model}, d_model {d['d_model']}, {d['heads']} heads, "
            f"{d['layers']} layers, context {d['context']}, dropout {d['dropout']}")
        return [model, f"batches: {d['batch_size']} windows of {d['context']} tokens",
                describe_training(s, t)]

    def train_config(self, s: Settings, setup: Setup) -> dict:
        return dict(setup.schedule, betas=(0.9, 0.95 if s.beta2 is None else s.beta2), eps=1e-8,
                    min_lr_ratio=0.1, best_metric="val_loss", best_mode="min")

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        """The best checkpoint continues the start of the validation text."""
        if s.sample_tokens <= 0:
            return
        lm = load_lm(run_dir)
        prompt = setup.task.valid_ids[: max(1, min(16, (lm.context or setup.task.context) // 4))].tolist()
        result = lm.complete(prompt, s.sample_tokens, temperature=0.8, top_k=40, seed=s.seed)
        print("sample (the start of the validation text, continued at temperature 0.8, top-k 40):")
        print(lm.tokenizer.decode(prompt) + result.text)

    # ------------------------------------------------------------------ inference
    def load(self, run: RunInfo, device: str | None = None, dtype: str = "auto") -> LoadedLM:
        """The run's model for inference: oneDNN Linear layers, and bf16 weight copies for the large
        ones where the device does bf16 natively (``dtype`` "auto"; "fp32" or "bf16" force it)."""
        from ..nn.linear import prepare_for_inference
        tok = load_tokenizers(run)["text"]
        model, chosen = prepare_for_inference(load_model(run).to(_device(device)).eval(), dtype)
        return LoadedLM(model, tok, [tok.eos_id], tok.eos_id, run.path, "attnlab", chosen)


    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "auto", kv: dict | None = None) -> None:
        """Perplexity and bits per byte of a text file; ``kv`` (:func:`attnlab.cli.kv_options.options`,
        from --kv-cache / --prefill-chunk): the text read once through one cache of that kind."""
        from ..data.sniff import describe_file
        from ..data.text import read_text_file
        shape = describe_file(data)
        if data.lower().endswith((".tsv", ".csv", ".jsonl", ".json")) and shape.kind != "text":
            reader = "a translation run" if shape.kind == "pairs" else "a classify run"
            raise ValueError(f"{data}: {shape.description}, which {reader} reads ('attnlab eval' of such a run); a "
                             "language model scores a plain text file")
        text = read_text_file(data)
        lm = load_lm(path, device, dtype)
        lm.warn_unknown(lm.tokenizer.encode(text), data)
        progress = sys.stderr.isatty()

        def score(label: str) -> dict:
            if kv is not None:
                return _streamed(lm, text, kv, settings.limit, label)
            r = text_perplexity(lm, text, stride=settings.stride, max_tokens=settings.limit, progress=progress)
            print(f"{label}: loss {r['loss']:.4f} nats/token, perplexity {r['ppl']:.4f}, "
                  f"{r['bits_per_byte']:.4f} bits per byte")
            return r

        first = score(f"{data}: {lm.path}")
        if kv is None:
            print(f"  ({first['tokens']:,} tokens scored in {first['windows']} windows of up to "
                  f"{first['context']} tokens, stride {first['stride']})")
        if settings.quantize == "int8":
            from ..quantize import quantize_int8
            quantize_int8(lm.model)
            second = score("int8 weight-only (attnlab.quantize)")
            print(f"  perplexity change with int8: {(second['ppl'] / first['ppl'] - 1) * 100:+.2f} %")


LM = register_task(LanguageModeling())


def _streamed(lm: LoadedLM, text: str, kv: dict, limit: int | None, label: str) -> dict:
    """Perplexity of ``text`` read once through one cache of the kind ``kv`` names (each token
    predicted from what the cache kept of everything before it), in chunks of --prefill-chunk
    tokens (default 256), as far as the model's context allows (a sink cache: the whole text)."""
    import math
    from ..generate import stream_nll
    ids = lm.tokenizer.encode(text)
    sink = kv["kv_cache"] is not None and kv["kv_cache"].kind == "sink"
    cap = [c for c in (limit, None if sink else lm.context) if c is not None]
    ids = ids[:min(cap)] if cap else ids
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} token(s); a perplexity needs at least 2")
    device = next(lm.model.parameters()).device
    chunk = kv["prefill_chunk"] or 256
    nll = stream_nll(lm.model, torch.tensor(ids, device=device), chunk, kv["kv_cache"])
    loss = float(nll.mean())
    kind = "full" if kv["kv_cache"] is None else kv["kv_cache"].kind
    print(f"{label}: loss {loss:.4f} nats/token, perplexity {math.exp(loss):.4f}")
    print(f"  ({len(ids) - 1:,} tokens scored, read once through a {kind} KV cache in chunks of {chunk} tokens)")
    return {"loss": loss, "ppl": math.exp(loss), "tokens": len(ids) - 1}


def load_hf_lm(path: Path, device: str | None = None, dtype: str = "auto") -> LoadedLM:
    """A Hugging Face causal-LM directory (config.json + weights + tokenizer.json) or GGUF file;
    ``dtype`` as :meth:`LanguageModeling.load`."""
    from ..hub import from_pretrained, load_tokenizer
    from ..nn.linear import prepare_for_inference
    model = from_pretrained(path)
    tok = load_tokenizer(path)
    V = model.config.vocab_size
    eos = model.config.eos_token_id
    eos = [i for i in ([eos] if isinstance(eos, int) else eos or []) if 0 <= i < V]
    bos = model.config.bos_token_id
    start = bos if bos is not None and 0 <= bos < V else (eos[0] if eos else None)
    model, chosen = prepare_for_inference(model.to(_device(device)).eval(), dtype)
    return LoadedLM(model, tok, eos, start, path, "huggingface", chosen)


def load_lm(path: str | Path, device: str | torch.device | None = None, dtype: str = "auto") -> LoadedLM:
    """An LM run or checkpoint (best/, else latest) or a Hugging Face causal-LM directory, in eval
    mode through :func:`attnlab.nn.prepare_for_inference` (oneDNN Linear layers; ``dtype`` "auto":
    bf16 weight copies for the large layers where the device does bf16 natively, or "fp32", "bf16").
    RunError naming what the path holds when it is not a language model."""
    info = inspect_path(path)
    if info.kind == "run":
        if info.run.task != "lm":
            raise RunError(f"{path}: {info.describe()}, not a language model")
        return LM.load(info.run, device, dtype)
    from .run import architecture_for
    if architecture_for(info.model_type, info.architectures, str(Path(path) / "config.json")).kind != "causal-lm":
        raise RunError(f"{path}: {info.describe()}, not a causal language model")
    return load_hf_lm(Path(path), device, dtype)


@torch.no_grad()
def text_perplexity(lm: LoadedLM, text: str, *, stride: int | None = None, batch_size: int = 8,
                    max_tokens: int | None = None, progress: bool = False) -> dict:
    """Perplexity of ``text`` under ``lm`` (the tokens of one document), with sliding windows.

    The text's ids are cut into windows of the model's context T that start every ``stride``
    tokens (default T // 2); each window scores only the tokens that no earlier window scored,
    so every token but the first is predicted exactly once, with at least T - stride tokens of
    left context (except in the first window). ``max_tokens`` keeps the first that many ids.
    Returns ``tokens`` (scored), ``loss`` (mean negative log-likelihood, nats per token),
    ``ppl`` = exp(loss) and ``bits_per_byte`` (the total negative log-likelihood in bits over
    the scored part's UTF-8 bytes: comparable across tokenizers).
    """
    ids = list(lm.tokenizer.encode(text))
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2, got {max_tokens}")
    cut = max_tokens is not None and len(ids) > max_tokens
    ids = ids[:max_tokens] if cut else ids
    n, T = len(ids), lm.context or max(len(ids), 2)            # no limit: one window over the whole text
    if n < 2:
        raise ValueError(f"the text has {n} token(s); a perplexity needs at least 2")
    stride = T // 2 if stride is None else stride
    if not 1 <= stride <= T - 1:
        raise ValueError(f"stride must be in [1, context - 1] = [1, {T - 1}], got {stride}")
    V = lm.model.config.vocab_size
    if max(ids) >= V:
        raise ValueError(f"the tokenizer produced id {max(ids)}, beyond the model's vocabulary of {V}")
    # window k: ids[b_k : e_k], e_k = min(b_k + T, n); it scores ids[s_k : e_k], s_k = e_{k-1} (s_0 = 1)
    windows, scored_to = [], 1
    for b in range(0, n, stride):
        e = min(b + T, n)
        windows.append((b, e, scored_to))
        scored_to = e
        if e == n:
            break
    ids_t = torch.tensor(ids, dtype=torch.long, device=next(lm.model.parameters()).device)
    per_call = max(1, min(batch_size, (256 << 20) // max(1, T * V * 4)))     # logits of one call <= ~256 MiB
    short = len(windows) > 1 and windows[-1][1] - windows[-1][0] != T          # a short last window goes alone
    full = windows[:-1] if short else windows
    groups = [full[i:i + per_call] for i in range(0, len(full), per_call)] + ([windows[-1:]] if short else [])
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=n - 1, unit="tok", desc="perplexity", file=sys.stderr, leave=False)
    total = ids_t.new_zeros((), dtype=torch.float64)                 # summed on the device: one sync at the end
    for group in groups:
        logits = lm.model(torch.stack([ids_t[b:e] for b, e, _ in group]))
        for row, (b, e, s) in enumerate(group):
            total += F.cross_entropy(logits[row, s - 1 - b:e - 1 - b].float(), ids_t[s:e], reduction="sum")
            if bar is not None:
                bar.update(e - s)
    if bar is not None:
        bar.close()
    nll, tokens = float(total), n - 1
    loss = nll / tokens
    text_bytes = len((lm.tokenizer.decode(ids) if cut else text).encode("utf-8"))
    return {"tokens": tokens, "loss": loss, "ppl": math.exp(min(loss, 50.0)),
            "bits_per_byte": nll / math.log(2) / max(1, text_bytes), "windows": len(windows), "stride": stride,
            "context": T}
