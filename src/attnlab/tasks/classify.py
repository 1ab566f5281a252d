"""Text classification: labelled texts + a tokenizer + a classifier, for the Trainer.

    attnlab train classify                                    # the embedded sentiment set
    attnlab train classify --data train.tsv --valid dev.tsv --time-budget 14
    attnlab train classify --init all-MiniLM-L6-v2/ --data train.tsv --valid dev.tsv --time-budget 28

Data: the embedded generated reviews (:func:`attnlab.data.labelled.sentiment_corpus`, with a test
split) or a TSV / CSV with a header, or JSON lines (``--data``; :mod:`attnlab.data.labelled`),
with ``--text-column`` and ``--label-column`` (default: "text" or "sentence", and "label"). The
label set is the training data's, sorted (numerically for integer labels), and saved with the
run; a validation label outside it is an error naming the file and line. Without ``--valid``,
5 % of the training data (at most 2,000 examples) is held out.

Two kinds of model:
- from scratch (no ``--init``): the chapter's :class:`attnlab.models.classifier.TextClassifier`,
  with a word or BPE tokenizer trained on the training texts, sized by the data (:data:`FILE_SIZES`);
- fine-tuning (``--init DIR``): a pretrained encoder of any registered family, from a Hugging
  Face directory (e.g. all-MiniLM-L6-v2's BertModel) or an attnlab run, read as its family's
  "base" architecture (a checkpoint with a head, e.g. BertForMaskedLM, gives up its head), with
  pooling and a new linear head (:class:`attnlab.models.classifier.EncoderClassifier`), and the
  model's own tokenizer.json. Fine-tuning defaults are the usual ones for BERT-like encoders:
  lr 5e-5 with warmup, batch 32, a few epochs.

Batches hold ``--batch-size`` texts of similar length. The loss is the cross-entropy summed over
a batch's texts, so the Trainer's normalisation gives the mean per text; the best checkpoint is
the one with the highest validation accuracy. Chosen defaults are printed and saved in config.yaml.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.batching import plan_batches
from ..data.sniff import data_directory, describe_file, scored_file
from ..data.labelled import Examples, read_labelled, sentiment_corpus, sort_labels
from ..tokenizer import PAD_ID, Tokenizer
from ..train.metrics import classification_scores, format_scores
from .settings import EvalSettings, Settings
from .base import (Option, Setup, TaskDefinition, beyond_specials, describe_training, fraction, positive,
                   register_task, training_schedule)
from .pretrained import load_base, native_classifier
from .run import (RunError, RunInfo, build_model, inspect_path, load_model, load_tokenizers, model_context,
                  resume_point, write_run)

__all__ = ["ClassificationTask", "Classify", "LoadedClassifier", "load_classifier", "encode_texts", "pad_batch",
           "text_batches", "model_length"]

_M, _D = "model", "data and evaluation"

# A file's defaults (from scratch) by its number of training texts: (at most this many, sizes).
# The second row is for SST-2's 60k phrases: on a contended 2-core CPU, one thread, it reached
# 83 % on the 6,735 held-out phrases after 450 steps and 87 % after 750 (90 s).
FILE_SIZES: list[tuple[float, dict]] = [
    (10_000, dict(tokenizer="word", vocab_size=8000, d_model=64, heads=4, layers=1, dropout=0.1, batch_size=32,
                  lr=1e-3, warmup=50, steps=1000)),
    (200_000, dict(tokenizer="word", vocab_size=16000, d_model=128, heads=4, layers=2, dropout=0.2, batch_size=64,
                   lr=1e-3, warmup=200, steps=4000)),
    (float("inf"), dict(tokenizer="bpe", vocab_size=16000, d_model=256, heads=4, layers=4, dropout=0.1,
                        batch_size=64, lr=5e-4, warmup=1000, steps=30000)),
]
EMBEDDED_SIZES = dict(tokenizer="word", vocab_size=None, d_model=64, heads=4, layers=1, dropout=0.1, batch_size=32,
                      lr=2e-3, warmup=30, steps=300)
# fine-tuning a pretrained encoder (BERT's recipe: 2e-5..5e-5, warmup, 2-4 epochs)
INIT_SIZES = dict(dropout=0.1, batch_size=32, lr=5e-5, warmup=200, steps=None)
BUDGET_EVALS = 4
BUDGET_MEASURE_STEPS = 100   # steps whose speed sizes a --time-budget schedule
DATA_EXTENSIONS = (".tsv", ".csv", ".jsonl", ".json")
_SCRATCH_ONLY = ("tokenizer", "vocab_size", "d_model", "heads", "layers", "d_ff")


def encode_texts(tok: Tokenizer, texts: Sequence[str], max_len: int) -> list[list[int]]:
    """Token ids per text, at most ``max_len``; a truncated text keeps its final special token (a
    BERT [SEP]) when the tokenizer adds one."""
    out = []
    for text in texts:
        ids = tok.encode(text)
        if len(ids) > max_len:
            ids = ids[:max_len - 1] + ids[-1:] if ids[-1] == tok.eos_id and tok.eos_id is not None else ids[:max_len]
        out.append(ids or [tok.unk_id if tok.unk_id is not None else 0])
    return out


def pad_batch(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids (B, L), attention_mask (B, L) bool, True = real token), right-padded."""
    L = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(ids), L, dtype=torch.bool)
    for b, x in enumerate(ids):
        input_ids[b, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask[b, :len(x)] = True
    return input_ids, mask


def text_batches(ids: list[list[int]], batch_size: int, max_len: int, **plan) -> list[list[int]]:
    """Index lists of at most ``batch_size`` texts of similar length (:func:`attnlab.data.batching.plan_batches`)."""
    return plan_batches([len(x) for x in ids], batch_size * max_len, max_examples=batch_size, **plan)


class ClassificationTask:
    """The Trainer's view of classification (see :class:`attnlab.train.Task`): (text, label)
    pairs become ids of at most ``max_len`` tokens and indices into ``labels``."""

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, labels: list[str], train: list[tuple[str, str]],
                 valid: list[tuple[str, str]], *, batch_size: int, max_len: int):
        self.model, self.tokenizer, self.labels = model, tokenizer, labels
        self.batch_size, self.max_len = batch_size, max_len
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else PAD_ID
        self.train_ids, self.train_y = self._encode(train, "training")
        self.valid_ids, self.valid_y = self._encode(valid, "validation")

    def _encode(self, pairs: list[tuple[str, str]], name: str) -> tuple[list[list[int]], list[int]]:
        index = {label: i for i, label in enumerate(self.labels)}
        unknown = sorted({y for _, y in pairs} - index.keys())
        if unknown:
            raise ValueError(f"the {name} data has label(s) {', '.join(unknown)} that the model does not know "
                             f"({', '.join(self.labels)})")
        return encode_texts(self.tokenizer, [x for x, _ in pairs], self.max_len), [index[y] for _, y in pairs]

    def _collate(self, ids: list, y: list, batch: list[int]) -> dict:
        input_ids, mask = pad_batch([ids[i] for i in batch], self.pad_id)
        return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor([y[i] for i in batch])}

    def plan(self, epoch: int, seed: int) -> list[dict]:
        return [self._collate(self.train_ids, self.train_y, b)
                for b in text_batches(self.train_ids, self.batch_size, self.max_len, seed=seed, epoch=epoch)]

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
        loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        with torch.no_grad():
            correct = (logits.argmax(-1) == batch["labels"]).sum()
        return loss, int(batch["labels"].numel()), {"accuracy": correct}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        nll, correct = 0.0, 0
        for b in text_batches(self.valid_ids, self.batch_size * 4, self.max_len, shuffle=False):
            batch = self._collate(self.valid_ids, self.valid_y, b)
            logits = model(batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).float()
            y = batch["labels"].to(device)
            nll += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(-1) == y).sum())
        n = max(len(self.valid_y), 1)
        return {"val_loss": nll / n, "accuracy": 100.0 * correct / n}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "classify", self.model, {"text": self.tokenizer},
                  {"labels": self.labels, "max_len": self.max_len})


@dataclass
class LoadedClassifier:
    """A classifier ready for inference: the model (eval mode), its tokenizer and label names."""
    model: nn.Module
    tokenizer: Tokenizer
    labels: list[str]
    max_len: int
    path: Path

    def _runs(self, texts: Sequence[str], batch_size: int):
        """(indices, input_ids, mask) batches of similar length, on the model's device."""
        ids = encode_texts(self.tokenizer, texts, self.max_len)
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else PAD_ID
        device = next(self.model.parameters()).device
        for b in text_batches(ids, batch_size, self.max_len, shuffle=False):
            input_ids, mask = pad_batch([ids[i] for i in b], pad)
            yield b, input_ids.to(device), mask.to(device)

    @torch.no_grad()
    def probabilities(self, texts: Sequence[str], batch_size: int = 64) -> Tensor:
        """(N, C) class probabilities, row i for texts[i]."""
        out = torch.empty(len(texts), len(self.labels))
        for b, input_ids, mask in self._runs(texts, batch_size):
            out[b] = torch.softmax(self.model(input_ids, attention_mask=mask).float(), -1).cpu()
        return out


def _device(device):
    from .run import resolve_device
    return resolve_device(device)


def read_examples(path: str, text_column: str | None, label_column: str | None, skip_malformed: bool = False,
                  labels: list[str] | None = None) -> Examples:
    """A data file's examples; with ``labels``, a label outside them is an error naming the line."""
    ex = read_labelled(path, text_column, label_column, skip_malformed)
    if labels is not None:
        known = set(labels)
        for label, line in zip(ex.labels, ex.lines):
            if label not in known:
                raise ValueError(f"{path}, line {line}: label {label!r} does not occur in the training data "
                                 f"(labels: {', '.join(labels)})")
    return ex


class Classify(TaskDefinition):
    name = "classify"
    kind = "classifier"
    data_paths = ("file", "directory")     # --data DIR: its train.tsv and dev.tsv (see data_directory)
    data_help = "a TSV, CSV or JSON-lines file of texts and labels, or a directory with train.tsv and dev.tsv"
    help = "a text classifier: the chapter's self-attention classifier from scratch, or a fine-tuned encoder"
    example = ("attnlab train classify --steps 300 --out runs/sentiment\n"
               "  attnlab train classify --data train.tsv --valid dev.tsv --time-budget 14\n"
               "  attnlab train classify --init all-MiniLM-L6-v2/ --data train.tsv --valid dev.tsv --time-budget 28")
    options = [
        Option("init", str, None, "fine-tune this pretrained encoder (a Hugging Face directory or an attnlab run) "
               "instead of training the chapter's classifier from scratch", metavar="DIR", group=_M),
        Option("tokenizer", str, None, "from scratch: default word (bpe over 200k texts)", choices=("word", "bpe"),
               group=_M),
        Option("vocab_size", int, None, "from scratch: vocabulary size (default: by data size, 16000 for ~60k "
               "texts)", check=beyond_specials, group=_M),
        Option("d_model", int, None, "from scratch: width (default: by data size, 128 for ~60k texts)",
               check=positive, group=_M),
        Option("heads", int, None, "from scratch: attention heads (default 4)", check=positive, group=_M),
        Option("layers", int, None, "from scratch: encoder layers (default: by data size, 2 for ~60k texts)",
               check=positive, group=_M),
        Option("d_ff", int, None, "from scratch: feed-forward width (default 4 d_model)", check=positive, group=_M),
        Option("dropout", float, None, "dropout (default: 0.2 from scratch for ~60k texts, 0.1 fine-tuning)",
               check=fraction, group=_M),
        Option("pooling", str, None, "how token vectors become one per text (padding excluded; default mean)",
               choices=("mean", "cls", "attention"), group=_M),
        Option("head", str, "pooling", "with --init: 'pooling' (the --pooling above and a linear layer) or "
               "'native', the encoder family's own sequence classifier as transformers has it (its own summary of "
               "the text, e.g. [CLS] and a pooler, then a linear layer), which 'attnlab export' writes as a Hugging "
               "Face directory",
               choices=("pooling", "native"), group=_M),
        Option("text_column", str, None, "the text column or field (default: 'text', else 'sentence')",
               metavar="NAME", group=_D),
        Option("label_column", str, None, "the label column or field (default: 'label')", metavar="NAME", group=_D),
        Option("max_len", int, 128, "tokens per text; longer texts are cut", check=positive, group=_D),
        Option("batch_size", int, None, "texts per micro-batch (default 64 from scratch, 32 fine-tuning)",
               check=positive, group=_D),
    ]
    eval_options = [
        Option("limit", int, None, "score only the first N items", check=positive),
        Option("plot", str, None, "write the confusion matrix to this PNG file", metavar="FILE.png"),
        Option("text_column", str, None, "the text column or field (default: 'text', else 'sentence')"),
        Option("label_column", str, None, "the label column or field (default: 'label')"),
    ]

    # ------------------------------------------------------------------ defaults
    def model_family(self, s: Settings) -> str | None:
        """The chapter's classifier from scratch; with --init the checkpoint brings its own sizes."""
        return "text-classifier" if s.init is None else None

    def model_in_use(self, s: Settings) -> str:
        return "a pretrained encoder (--init)" if s.init is not None else "the text-classifier trained from scratch"

    def check(self, s: Settings) -> None:
        if s.head == "native":
            if s.init is None:
                raise ValueError("--head native: the family's own classifier is for fine-tuning a pretrained encoder "
                                 "(--init DIR); from scratch the chapter's classifier pools with --pooling")
            if s.pooling is not None:
                raise ValueError("--pooling: the native head reads its family's own summary ([CLS] and the pooler); "
                                 "give --pooling with --head pooling")
        if s.head == "pooling":
            s.pooling = s.pooling or "mean"
        if s.init is not None:
            scratch = [f"--{n.replace('_', '-')}" for n in _SCRATCH_ONLY if s[n] is not None]
            if scratch:
                raise ValueError(f"{', '.join(scratch)}: only for a classifier trained from scratch; with --init the "
                                 "pretrained model brings its own tokenizer and sizes")
        if s.valid is not None and s.data is None:
            raise ValueError("--valid: give the training data too (--data FILE); the embedded data set has its own "
                             "validation split")
        super().check(s)
        s.data, s.valid = data_directory(s.data, s.valid, DATA_EXTENSIONS)

    def _sizes(self, s: Settings, n_texts: int) -> dict:
        if s.init is not None:
            base = dict(INIT_SIZES, steps=max(200, min(20000, 3 * n_texts // INIT_SIZES["batch_size"])))
        elif s.data is None:
            base = EMBEDDED_SIZES
        else:
            base = next(v for most, v in FILE_SIZES if n_texts <= most)
        return s.given_or(base)

    def _schedule(self, s: Settings, d: dict) -> dict:
        """The Trainer's length, lr, warmup and evaluation defaults (flags win)."""
        def warmup(steps: int, budget: bool) -> int:
            return d["warmup"] if budget else min(d["warmup"], max(1, steps // 10))     # a tenth at most

        t = training_schedule(s, d, warmup, lambda steps, budget: max(500 if budget else steps // 5, 50), BUDGET_EVALS)
        # a classifier's steps are short (benchmarks/results/code.md): 20 of them are over in a
        # moment, and a hiccup of the machine then shrinks the whole schedule
        return dict(t, budget_measure=BUDGET_MEASURE_STEPS)

    # ------------------------------------------------------------------ data and model
    def _data(self, s: Settings) -> tuple[list, list, list, list[str]]:
        """(train, valid, test) (text, label) lists and what to say about them: how each file was
        read and what was skipped."""
        if s.data is None:
            train, valid, test = sentiment_corpus(seed=s.seed)
            return train, valid, test, []
        ex = read_examples(s.data, s.text_column, s.label_column, s.skip_malformed)
        labels = sort_labels(ex.labels)
        if len(labels) < 2:
            raise ValueError(f"{s.data}: every one of its {len(ex):,} examples has the label {labels[0]!r}; a "
                             f"classifier needs two labels or more ({ex.layout}; name the label column with "
                             "--label-column)")
        train, notes = list(zip(ex.texts, ex.labels)), [f"{s.data}: {ex.layout}"]
        skipped = ex.skipped
        if s.valid:
            v = read_examples(s.valid, s.text_column, s.label_column, s.skip_malformed, labels)
            notes.append(f"{s.valid}: {v.layout}")
            return train, list(zip(v.texts, v.labels)), [], notes + _skipped(skipped + v.skipped)
        if len(train) < 2:
            raise ValueError(f"{s.data}: {len(train)} example: too few to hold out validation examples and train; "
                             "give --valid FILE")
        order = list(range(len(train)))
        random.Random(s.seed).shuffle(order)
        held = set(order[:min(2000, max(1, len(train) // 20))])
        return ([p for i, p in enumerate(train) if i not in held], [p for i, p in enumerate(train) if i in held],
                [], notes + _skipped(skipped))

    def _pretrained(self, s: Settings, labels: list[str]) -> tuple[nn.Module, Tokenizer]:
        """The ``--init`` encoder with a new head, and its tokenizer."""
        from ..models.classifier import EncoderClassifier
        base, tok = load_base(s.init)
        torch.manual_seed(s.seed)
        if s.head == "native":
            return native_classifier(base, labels, s.dropout, s.seed), tok
        model = EncoderClassifier.from_base(base, len(labels), s.pooling, s.dropout)
        return model, tok

    def _scratch(self, s: Settings, d: dict, texts: list[str], labels: list[str]) -> tuple[nn.Module, Tokenizer]:
        from ..models.registry import family
        tok = Tokenizer.registry[d["tokenizer"]].train(texts, d["vocab_size"])
        fam = family("text-classifier")
        config = fam.build_config(vocab_size=tok.vocab_size, context=s.max_len, d_model=d["d_model"],
                                  num_heads=d["heads"], num_layers=d["layers"], d_ff=s.d_ff,
                                  dropout=d["dropout"], num_classes=len(labels), pooling=s.pooling,
                                  pad_id=tok.pad_id, **self.family_sizes(s, tok))
        torch.manual_seed(s.seed)
        return fam.for_kind(self.kind).build(config), tok

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        self.apply_family_defaults(s)
        train, valid, test, notes = self._data(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        d = self._sizes(s, len(train))
        if s.init is None:
            for k in ("tokenizer", "vocab_size", "d_model", "heads", "layers"):
                s[k] = d[k]
        s.update(dropout=d["dropout"], batch_size=d["batch_size"])
        t = self._schedule(s, d)
        s.lr = t["lr"]                  # the resolved lr (the optimizer's) is saved with the run
        if not t["budget_schedule"]:
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        if saved is not None:              # the run's own labels, tokenizer and model (the Trainer loads the weights)
            labels = list(saved.task_options["labels"])
            tok = load_tokenizers(saved)["text"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        else:
            labels = sort_labels(y for _, y in train)
            model, tok = (self._pretrained(s, labels) if s.init is not None
                          else self._scratch(s, d, [x for x, _ in train], labels))
        max_len = min(s.max_len, model_length(model))
        task = ClassificationTask(model, tok, labels, train, valid, batch_size=d["batch_size"], max_len=max_len)
        lines = [f"data: {'the embedded sentiment reviews' if s.data is None else s.data}: {len(train):,} "
                 f"training texts, {len(valid):,} validation" + (f", {len(test):,} test" if test else "")
                 + f"; labels: {', '.join(labels)}", *notes]
        lines.append(self._describe_model(s, d, model, tok, saved))
        lines += [f"batches: {d['batch_size']} texts of similar length, at most {max_len} tokens each",
                  describe_training(s, t)]
        return Setup(task, lines, {"test": test}, schedule=t)

    def _describe_model(self, s: Settings, d: dict, model, tok, saved) -> str:
        n = sum(p.numel() for p in model.parameters()) / 1e6
        if saved is not None:
            return f"model: {type(model).__name__}, {n:.2f}M parameters, from the checkpoint"
        if s.init is not None and s.head == "native":
            return (f"model: {type(model).__name__} from {s.init}, a new {len(model.config.id2label)}-label head "
                    f"({n:.2f}M parameters), its tokenizer (vocabulary {tok.vocab_size}), dropout {d['dropout']}")
        if s.init is not None:
            enc = type(model.encoder).__name__
            return (f"model: {enc} from {s.init} + {s.pooling} pooling + linear head ({n:.2f}M parameters), "
                    f"its tokenizer (vocabulary {tok.vocab_size}), dropout {d['dropout']}")
        layers = f"{d['layers']} Pre-Norm layer" + ("s" if d["layers"] != 1 else "")
        return (f"model: TextClassifier from scratch ({n:.2f}M parameters): {d['tokenizer']} vocabulary "
                f"{tok.vocab_size}, d_model {d['d_model']}, {d['heads']} heads, {layers}, {s.pooling} pooling, "
                f"dropout {d['dropout']}")

    def train_config(self, s: Settings, setup: Setup) -> dict:
        beta2 = s.beta2 if s.beta2 is not None else (0.999 if s.init is not None else 0.98)
        return dict(setup.schedule, betas=(0.9, beta2), eps=1e-8 if s.init is not None else 1e-9,
                    best_metric="accuracy", best_mode="max")

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        """The best checkpoint's accuracy on the test split (embedded data) or the validation data."""
        clf = load_classifier(run_dir)
        pairs = setup.extra["test"]
        if pairs:
            probs = clf.probabilities([x for x, _ in pairs])
            scores = classification_scores([clf.labels.index(y) for _, y in pairs], probs.argmax(-1).tolist(),
                                           len(clf.labels))
            print(f"test ({len(pairs)} texts): accuracy {scores['accuracy']:.2f}%  macro-F1 {scores['macro_f1']:.2f}")
            for (x, _), p in list(zip(pairs, probs))[:3]:
                print(f"  {x}\n    -> {clf.labels[int(p.argmax())]} ({float(p.max()):.3f})")
        elif setup.task.valid_y:
            best = setup.task.evaluate(clf.model)
            print(f"validation ({len(setup.task.valid_y)} texts): accuracy {best['accuracy']:.2f}%")

    # ------------------------------------------------------------------ inference
    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedClassifier:
        from ..nn.linear import prepare_for_inference
        tok = load_tokenizers(run)["text"]
        model, _ = prepare_for_inference(load_model(run).to(_device(device)).eval(), dtype)
        return LoadedClassifier(model, tok, list(run.task_options["labels"]), int(run.task_options["max_len"]),
                                run.path)

    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "fp32") -> None:
        if info.kind != "run":
            raise RunError(f"{path}: {info.describe()}; 'attnlab eval' scores a classify run, which knows its label "
                           f"names (fine-tune this model with: attnlab train classify --init {path} --data FILE)")
        clf = self.load(info.run, device, dtype)
        data = scored_file(data, DATA_EXTENSIONS)
        try:
            ex = read_examples(data, settings.text_column, settings.label_column, labels=clf.labels)
        except ValueError as e:
            shape = describe_file(data)
            if shape.kind != "pairs" or "does not occur in the training data" not in str(e):
                raise
            raise ValueError(f"{data}: {shape.description}, which a translation run reads ('attnlab eval' of a "
                             f"translate run); this classify run scores texts labelled "
                             f"{', '.join(clf.labels)}") from None
        texts, labels = ex.texts[: settings.limit], ex.labels[: settings.limit]
        pred = clf.probabilities(texts).argmax(-1).tolist()
        scores = classification_scores([clf.labels.index(y) for y in labels], pred, len(clf.labels))
        print(f"{data}: {len(texts)} texts ({ex.layout})")
        print(format_scores(scores, clf.labels))
        if settings.plot:
            from ..viz.confusion import plot_confusion
            print(f"confusion matrix: {plot_confusion(scores['confusion'], clf.labels, settings.plot)}")


CLASSIFY = register_task(Classify())


def _skipped(n: int) -> list[str]:
    return [f"skipped {n} malformed lines"] if n else []


def model_length(model: nn.Module) -> int:
    """The longest input the model takes (its position table; no limit: a very large number)."""
    return model_context(model) or 1 << 30


def load_classifier(path: str | Path, device: str | torch.device | None = None) -> LoadedClassifier:
    """A classify run or checkpoint (best/, else latest), in eval mode; RunError for anything else."""
    info = inspect_path(path)
    if info.kind != "run" or info.run.task != "classify":
        raise RunError(f"{path}: {info.describe()}, not a classify run")
    return CLASSIFY.load(info.run, device)
