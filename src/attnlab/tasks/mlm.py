"""Masked-language-model pre-training (BERT, ALBERT): documents + a WordPiece tokenizer + an
encoder with a masked-LM head and, optionally, a sentence-pair head, for the Trainer.

    attnlab train mlm                                   # the embedded documents, BERT with NSP
    attnlab train mlm --model albert                    # ALBERT: sentence-order prediction
    attnlab train mlm --data corpus.txt --objective none --time-budget 30

Data. A text file holds documents separated by blank lines, one sentence per line (the format of
BERT's own pre-training data); ``--valid`` another such file, else the last 5 % of the
documents validate. Without ``--data``: :func:`attnlab.data.numbers.english_documents`, short
documents that each follow one protagonist, drawn from the translation task's grammar.

Objectives (:mod:`attnlab.data.masking`). Every consecutive pair of sentences of a document
gives one example ``[CLS] A [SEP] B [SEP]``; its tokens are masked by BERT's 80/10/10 rule, afresh
every epoch from a generator seeded by (seed, epoch), and the model predicts the selected tokens.
``--objective nsp`` (BERT's default) also predicts whether B follows A or came from another
document, ``sop`` (ALBERT's) whether A and B were swapped, and ``none`` trains the masked-LM head
alone on single sentences. The loss is the masked-LM cross-entropy per masked token plus the
sentence loss per pair, as transformers' ``BertForPreTraining`` adds them.

Models: any registered family with a "pretraining" architecture (``--model bert|albert|...``),
or a "masked-lm" one for ``--objective none``, sized through the family's sizing builder; a
family states its own default objective in its registration (ALBERT's: sop).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from ..data.files import DataFormatError
from ..data.masking import IGNORE_INDEX, SentencePair, collate_pairs, mask_tokens, pack_pair, sentence_pairs
from ..tokenizer import BERT_SPECIAL_TOKENS, train_wordpiece
from .. import models as _models  # noqa: F401  (registers every family: the --model default reads them)
from ..models.registry import default_family
from .settings import EvalSettings, Settings
from .base import (Option, Setup, TaskDefinition, describe_training, family_recipe, fraction, positive, register_task,
                   training_schedule)
from .run import RunInfo, build_model, load_model, load_tokenizers, resume_point, write_run

__all__ = ["MaskedLMTask", "MaskedLanguageModeling", "read_documents"]

_M, _D = "model", "data and evaluation"
VALID_FRACTION = 0.05
# The embedded documents' small vocabulary (~250 words) and short sentences: 4,000 steps (a couple of
# minutes on a CPU; benchmarks/results/code.md) reach masked-LM accuracy 44 % and NSP accuracy 71 % on the held-out pairs,
# where 1,500 steps left NSP at 54 % (near chance: the pair head learns after the words); files get sizes by
# their number of training tokens (at most this many, sizes), BERT-small-like and up.
EMBEDDED_SIZES = dict(vocab_size=1000, d_model=128, heads=4, layers=2, d_ff=512, context=64, batch_size=32,
                      dropout=0.1, lr=1e-3, warmup=100, steps=4000)
FILE_SIZES: list[tuple[float, dict]] = [
    (2_000_000, dict(vocab_size=8000, d_model=256, heads=4, layers=4, d_ff=1024, context=128, batch_size=32,
                     dropout=0.1, lr=5e-4, warmup=200, steps=5000)),
    (float("inf"), dict(vocab_size=30522, d_model=512, heads=8, layers=8, d_ff=2048, context=128, batch_size=32,
                        dropout=0.1, lr=2e-4, warmup=1000, steps=50000)),
]


def read_documents(path: str | Path) -> list[list[str]]:
    """Documents from a text file: blank lines separate them, each non-blank line is a sentence."""
    from ..data.text import read_text_file
    text = read_text_file(str(path))
    documents, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            documents.append(current)
            current = []
    if current:
        documents.append(current)
    if not documents:
        raise DataFormatError(str(path), 1, "no sentences: the file is empty or blank")
    return documents


class MaskedLMTask:
    """The Trainer's view of masked-LM (+ sentence-pair) pre-training (see :class:`attnlab.train.Task`).

    ``loss`` = masked-LM cross-entropy SUM over the masked tokens + (sentence loss per pair) x
    (masked tokens), n = masked tokens: after the Trainer divides by n it is the sum of the two
    means. Extras: the number of correctly predicted masked tokens and pairs."""

    def __init__(self, model: nn.Module, tokenizer, train_docs: list[list[list[int]]],
                 valid_docs: list[list[list[int]]], *, objective: str, context: int, batch_size: int,
                 mask_prob: float = 0.15, eval_pairs: int = 512, eval_seed: int = 12345):
        self.model, self.tokenizer, self.objective = model, tokenizer, objective
        self.train_docs, self.valid_docs = train_docs, valid_docs
        self.context, self.batch_size, self.mask_prob, self.eval_pairs = context, batch_size, mask_prob, eval_pairs
        self.cls_id, self.sep_id, self.pad_id = tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id
        self.mask_id = tokenizer.token_id("[MASK]")
        self.specials = [i for i in (tokenizer.token_id(t) for t in BERT_SPECIAL_TOKENS) if i is not None]
        if None in (self.cls_id, self.sep_id, self.pad_id, self.mask_id):
            raise ValueError("the tokenizer needs [CLS], [SEP], [PAD] and [MASK] tokens for masked-LM training")
        max_len = getattr(model.config, "max_position_embeddings", None)
        if max_len is not None and context > max_len:
            raise ValueError(f"--context {context} exceeds the model's {max_len} positions")
        self._valid_batches = self._batches(valid_docs, random.Random(eval_seed), torch.Generator().manual_seed(eval_seed),
                                            limit=eval_pairs)
        if not self._valid_batches:
            raise ValueError("the validation documents give no sentence pair; give longer documents or more of them")

    def _examples(self, docs, rng: random.Random) -> list[SentencePair]:
        if self.objective == "none":
            return [SentencePair(s, [], 0) for d in docs for s in d if s]
        return sentence_pairs(docs, self.objective, rng)

    def _batches(self, docs, rng: random.Random, g: torch.Generator, limit: int | None = None) -> list[dict]:
        examples = self._examples(docs, rng)
        rng.shuffle(examples)
        examples = examples[:limit] if limit is not None else examples
        batches = []
        for i in range(0, len(examples), self.batch_size):
            chunk = examples[i:i + self.batch_size]
            packed = [pack_pair(e.a, e.b if self.objective != "none" else None, cls_id=self.cls_id,
                                sep_id=self.sep_id, max_len=self.context) for e in chunk]
            batch = collate_pairs(packed, self.pad_id)
            batch["input_ids"], batch["labels"] = mask_tokens(
                batch["input_ids"], mask_id=self.mask_id, vocab_size=self.model.config.vocab_size,
                special_ids=self.specials, padding_mask=batch["attention_mask"], probability=self.mask_prob,
                generator=g)
            batch["sentence_label"] = torch.tensor([e.label for e in chunk], dtype=torch.long)
            batches.append(batch)
        return batches

    def plan(self, epoch: int, seed: int) -> list[dict]:
        state = np.random.SeedSequence([seed, epoch]).generate_state(2, np.uint32)
        g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        return self._batches(self.train_docs, random.Random(int(state[0])), g)

    @staticmethod
    def _forward(model, batch) -> tuple[Tensor, Tensor | None]:
        """(token logits (B, T, V), sentence logits or None): what the report shows."""
        out = model(batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"])
        return (out[0], out[1]) if isinstance(out, tuple) else (out, None)

    def _scores(self, model, batch) -> tuple[Tensor, Tensor | None, int, dict]:
        """(masked-LM cross-entropy SUM, sentence-pair cross-entropy MEAN or None, masked tokens,
        {"mlm_correct", "pair_correct"} counts) of one batch, from one forward pass: the model's
        own objective (:func:`attnlab.models.registry.training_loss`)."""
        from ..models.registry import training_loss
        out = training_loss(self.model, batch, forward=model)
        m = out.metrics
        extra = {k: m[k] for k in ("mlm_correct", "pair_correct") if k in m}
        return m["mlm_loss"], m.get("pair_loss"), out.count, extra

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        from ..models.registry import training_loss
        out = training_loss(self.model, batch, forward=model)
        return out.loss, out.count, {"mlm_correct": out.metrics["mlm_correct"]}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        """Masked-LM loss and accuracy over the masked tokens of a fixed validation sample (the
        same masks every time), and the sentence-pair accuracy."""
        device = next(model.parameters()).device
        total = {"loss": 0.0, "n": 0, "mlm_correct": 0.0, "pairs": 0, "pair_correct": 0.0}
        for batch in self._valid_batches:
            mlm, _, n, extra = self._scores(model, {k: v.to(device) for k, v in batch.items()})
            total["loss"] += float(mlm)
            total["n"] += n
            total["pairs"] += len(batch["labels"])
            for k, v in extra.items():
                total[k] += float(v)
        out = {"val_loss": total["loss"] / max(total["n"], 1),
               "val_mlm_acc": total["mlm_correct"] / max(total["n"], 1)}
        if self.objective != "none":
            out[f"val_{self.objective}_acc"] = total["pair_correct"] / max(total["pairs"], 1)
        return out

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "mlm", self.model, {"text": self.tokenizer},
                  {"context": self.context, "objective": self.objective})


@dataclass
class LoadedMLM:
    model: nn.Module
    tokenizer: object
    objective: str
    context: int


class MaskedLanguageModeling(TaskDefinition):
    name = "mlm"
    kind = "pretraining"
    help = "masked-language-model pre-training of an encoder, with next-sentence or sentence-order prediction"
    example = ('attnlab train mlm --out runs/mlm\n'
               '  attnlab train mlm --model albert --data documents.txt --time-budget 30')
    options = [
        Option("model", str, default_family("pretraining"), "architecture: a registered encoder family with a "
               "pre-training head", group=_M),
        Option("objective", str, None, "the sentence-pair task beside masked LM (default: the model family's, else "
               "nsp; none: masked LM alone on single sentences)", choices=("nsp", "sop", "none"), group=_M),
        Option("vocab_size", int, None, "WordPiece vocabulary (default 1000 embedded; files: 8000, 30522 over 2M "
               "tokens)", check=lambda v: None if v > len(BERT_SPECIAL_TOKENS) else "must exceed the 5 special "
               "tokens", group=_M),
        Option("context", int, None, "longest packed pair in tokens (default 64 embedded, 128 files)",
               check=positive, group=_M),
        Option("batch_size", int, None, "pairs per micro-batch (default 32)", check=positive, group=_M),
        Option("d_model", int, None, "model width (default 128 embedded; files: by corpus size)", check=positive,
               group=_M),
        Option("heads", int, None, "attention heads (default 4)", check=positive, group=_M),
        Option("layers", int, None, "layers (default 2 embedded; files: by corpus size)", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default 4 d_model)", check=positive, group=_M),
        Option("dropout", float, None, "dropout (default 0.1)", check=fraction, group=_M),
        Option("mask_prob", float, 0.15, "share of the tokens selected for prediction", check=fraction, group=_M),
        Option("corpus_size", int, 3000, "documents of the embedded corpus", check=positive, group=_D),
        Option("eval_pairs", int, 512, "validation examples per evaluation", check=positive, group=_D,
               resumable=True),
    ]

    eval_options = [
        Option("limit", int, 4096, "score at most this many examples", check=positive),
        Option("seed", int, 0, "seed of the masks drawn over the file", group=_D),
    ]

    def check(self, s: Settings) -> None:
        from ..models.registry import families
        kind = "masked-lm" if s.objective == "none" else "pretraining"
        known = sorted(f.model_type for f in families(kind=kind))
        if s.model not in known:
            raise ValueError(f"--model: {s.model!r} has no {kind} architecture; families that do: "
                             f"{', '.join(known) or 'none'}")
        super().check(s)

    def _sizes(self, s: Settings, n_tokens: int) -> dict:
        base = EMBEDDED_SIZES if s.data is None else next(v for most, v in FILE_SIZES if n_tokens <= most)
        base = dict(base, **family_recipe(s, s.model))
        d = s.given_or(base)
        if s.d_model is not None and s.d_ff is None:
            d["d_ff"] = 4 * d["d_model"]
        return d

    def _model(self, s: Settings, d: dict, tok) -> nn.Module:
        from ..models.registry import family
        fam = family(s.model)
        kind = "masked-lm" if s.objective == "none" else "pretraining"
        config = fam.build_config(vocab_size=tok.vocab_size, context=d["context"], d_model=d["d_model"],
                                  num_heads=d["heads"], num_layers=d["layers"], d_ff=d["d_ff"],
                                  dropout=d["dropout"], **self.family_sizes(s, tok))
        torch.manual_seed(s.seed)
        return fam.for_kind(kind).build(config)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        from ..data.numbers import english_documents
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:
            s.objective = saved.task_options["objective"]
        self.apply_family_defaults(s)
        s.objective = s.objective or "nsp"
        self.check_once(s)
        if s.data is None:
            docs = english_documents(s.corpus_size, seed=s.seed)
            source = f"the embedded documents ({len(docs):,})"
            cut = max(1, int(len(docs) * VALID_FRACTION))
            train_text, valid_text = docs[cut:], docs[:cut]
        else:
            docs = read_documents(s.data)
            source = s.data
            if s.valid is not None:
                train_text, valid_text = docs, read_documents(s.valid)
            else:
                cut = max(1, int(len(docs) * VALID_FRACTION))
                if len(docs) - cut < 1 or (s.objective == "nsp" and len(docs) - cut < 2):
                    raise DataFormatError(s.data, 1, f"{len(docs)} document(s) (blank lines separate them): "
                                          "too few to hold out validation documents and train; give --valid")
                train_text, valid_text = docs[:-cut], docs[-cut:]
        if saved is not None:
            tok = load_tokenizers(saved)["text"]
        else:
            n_words = sum(len(line.split()) for d in train_text for line in d)
            vocab = s.vocab_size or self._sizes(s, n_words)["vocab_size"]
            tok = train_wordpiece((line for d in train_text for line in d), vocab)

        def encode(documents):
            return [[tok.encode(line, add_special_tokens=False) for line in d] for d in documents]

        train_docs, valid_docs = encode(train_text), encode(valid_text)
        n_tokens = sum(len(x) for d in train_docs for x in d)
        d = self._sizes(s, n_tokens)
        if saved is not None:
            model = build_model(saved.model_type, saved.config, saved.architecture)
            d["context"] = saved.task_options["context"]
        else:
            model = self._model(s, d, tok)
        t = self._schedule(s, d)
        s.update({k: v for k, v in d.items() if k in s and k not in ("steps", "warmup", "lr")}, lr=t["lr"])
        if not t["budget_schedule"]:
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        task = MaskedLMTask(model, tok, train_docs, valid_docs, objective=s.objective, context=d["context"],
                            batch_size=d["batch_size"], mask_prob=s.mask_prob, eval_pairs=s.eval_pairs)
        n_params = sum(p.numel() for p in model.parameters())
        pairs = sum(max(len(doc) - 1, 0) for doc in train_docs)
        lines = [f"data: {source}: {len(train_docs):,} training documents ({pairs:,} sentence pairs, "
                 f"{n_tokens:,} tokens), {len(valid_docs):,} validating",
                 f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters, WordPiece vocab "
                 f"{tok.vocab_size}{' (from the checkpoint)' if saved else ''}; objective: masked LM"
                 + ("" if s.objective == "none" else f" + {s.objective.upper()}"),
                 f"model sizes: d_model {d['d_model']}, {d['heads']} heads, {d['layers']} layers, d_ff {d['d_ff']}, "
                 f"dropout {d['dropout']}; batches of {d['batch_size']} pairs of at most {d['context']} tokens",
                 describe_training(s, t)]
        return Setup(task, lines, schedule=t)

    def _schedule(self, s: Settings, d: dict) -> dict:
        """The Trainer's length, lr, warmup and evaluation defaults (flags win)."""
        return training_schedule(s, d, lambda steps, budget: min(d["warmup"], max(1, steps // 10)),
                                 lambda steps, budget: max(250 if budget else steps // 5, 50), 4)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        return dict(setup.schedule, betas=(0.9, 0.999 if s.beta2 is None else s.beta2), eps=1e-6,
                    min_lr_ratio=0.0, best_metric="val_loss", best_mode="min")

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        """The last validation scores, and a few masked sentences filled in by the model."""
        task = setup.task
        model = task.model.eval()
        scores = task.evaluate(model)
        print("validation: " + ", ".join(f"{k.removeprefix('val_')} {v:.4f}" for k, v in scores.items()))
        batch = task._valid_batches[0]
        with torch.no_grad():
            device = next(model.parameters()).device
            logits, _ = task._forward(model, {k: v.to(device) for k, v in batch.items()})
        tok = task.tokenizer
        for row in range(min(3, len(batch["input_ids"]))):
            ids = batch["input_ids"][row][batch["attention_mask"][row]].tolist()
            picked = (batch["labels"][row] != IGNORE_INDEX)[: len(ids)]
            guess = logits[row, : len(ids)].argmax(-1).tolist()
            shown = [f"[{tok.tokens([g])[0]}|{tok.tokens([t])[0]}]" if p else tok.tokens([i])[0]
                     for i, g, t, p in zip(ids, guess, batch["labels"][row].tolist(), picked.tolist())]
            print("  " + " ".join(shown))
        print("  ([model's guess|original] at the masked positions)")

    def load(self, run: RunInfo, device: str | None = None, dtype: str = "auto") -> LoadedMLM:
        from .run import resolve_device
        tok = load_tokenizers(run)["text"]
        model = load_model(run).to(resolve_device(device)).eval()
        return LoadedMLM(model, tok, run.task_options.get("objective", "none"), run.task_options["context"])


    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "fp32") -> None:
        """Masked-LM loss and accuracy (and the sentence-pair accuracy) over a documents file,
        with masks drawn from ``--seed``: the same figures for the same file and seed."""
        from .run import open_run
        loaded = self.load(open_run(path), device)
        docs = [[loaded.tokenizer.encode(line, add_special_tokens=False) for line in d] for d in read_documents(data)]
        task = MaskedLMTask(loaded.model, loaded.tokenizer, [], docs, objective=loaded.objective,
                            context=loaded.context, batch_size=32, eval_pairs=settings.limit,
                            eval_seed=settings.seed)
        scores = task.evaluate(loaded.model)
        n = sum(len(b["input_ids"]) for b in task._valid_batches)
        print(f"{data}: {path}")
        print(f"  masked-LM loss {scores['val_loss']:.4f}, perplexity {math.exp(min(scores['val_loss'], 50)):.2f}, "
              f"accuracy {scores['val_mlm_acc'] * 100:.2f} % over the masked tokens of {n:,} examples")
        if loaded.objective != "none":
            print(f"  {loaded.objective.upper()} accuracy {scores[f'val_{loaded.objective}_acc'] * 100:.2f} %")


MLM = register_task(MaskedLanguageModeling())
