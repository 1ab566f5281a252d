"""The translation task: data + tokenizers + the 2017 Transformer, for the Trainer.

    setup = prepare_translation(TranslationOptions(data=None))   # None: the embedded corpus
    Trainer(setup.task, TrainConfig(...)).fit()
    model, src_tok, tgt_tok = load_translator("runs/translate")  # best/ or latest checkpoint

A checkpoint directory holds model.safetensors (the Trainer's), translation.json (the model
config and tokenizer layout) and the tokenizers, so it is self-contained.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import sacrebleu
import torch
from torch import Tensor, nn

from ..generate import translate
from ..models.transformer import Transformer, TransformerConfig
from ..nn.linear import optimize_for_inference
from ..tokenizer import load_tokenizer, train_tokenizers
from ..train.checkpoint import load_checkpoint, resolve_checkpoint
from ..train.losses import label_smoothed_cross_entropy
from .batching import collate, pair_lengths, plan_batches
from .files import read_tsv
from .numbers import number_corpus

__all__ = ["TranslationOptions", "TranslationTask", "TranslationSetup", "prepare_translation", "load_translator",
           "score_translations"]

META = "translation.json"


@dataclass
class TranslationOptions:
    """What to train on and how big a model; ``None`` fields get defaults for the data size."""
    data: str | None = None              # TSV of source<TAB>target; None = embedded corpus
    valid: str | None = None             # TSV for validation; None = held out from ``data``
    tokenizer: str | None = None         # "word" | "char" | "bpe"; default word (embedded) / bpe (files)
    vocab_size: int | None = None        # BPE vocabulary size; default 8000
    shared_vocab: bool = True
    d_model: int | None = None
    num_heads: int | None = None
    num_layers: int | None = None        # encoder and decoder layers each
    d_ff: int | None = None
    dropout: float | None = None
    norm_first: bool = False
    tie_embeddings: bool = True          # tie target embedding and output (and src/tgt when shared)
    max_tokens: int = 2048               # padded tokens per micro-batch
    max_len: int = 256                   # longer examples are skipped and counted
    label_smoothing: float = 0.1
    eval_size: int = 500                 # validation pairs decoded for BLEU at each evaluation
    eval_beam: int = 1
    corpus_size: int = 20000             # embedded corpus: training pairs
    seed: int = 0


@dataclass
class TranslationSetup:
    task: "TranslationTask"
    test: list[tuple[str, str]] = field(default_factory=list)   # held-out pairs (embedded corpus)
    skipped: int = 0                                             # over-long or malformed training pairs


def _defaults(o: TranslationOptions, embedded: bool) -> dict:
    small = dict(d_model=128, num_heads=4, num_layers=2, d_ff=256, dropout=0.1, tokenizer="word")
    files = dict(d_model=256, num_heads=4, num_layers=3, d_ff=1024, dropout=0.1, tokenizer="bpe")
    base = small if embedded else files
    return {k: (getattr(o, k) if getattr(o, k) is not None else v) for k, v in base.items()}


def _read_pairs(path: str, skip_malformed: bool = False) -> tuple[list[tuple[str, str]], int]:
    reader = read_tsv(path, skip_malformed=skip_malformed)
    pairs = list(reader)
    if not pairs:
        raise ValueError(f"{path}: no sentence pairs found")
    return pairs, reader.skipped


def prepare_translation(o: TranslationOptions, skip_malformed: bool = False) -> TranslationSetup:
    """Read or generate the data, train the tokenizers, build the model and the task."""
    embedded = o.data is None
    d = _defaults(o, embedded)
    test: list[tuple[str, str]] = []
    skipped = 0
    if embedded:
        train, valid, test = number_corpus(n_train=o.corpus_size, seed=o.seed)
    else:
        train, skipped = _read_pairs(o.data, skip_malformed)
        if o.valid:
            valid, more = _read_pairs(o.valid, skip_malformed)
            skipped += more
        else:   # hold out a deterministic 2% (at most 1000 pairs)
            order = list(range(len(train)))
            random.Random(o.seed).shuffle(order)
            n = min(1000, max(1, len(train) // 50))
            held = set(order[:n])
            valid = [p for i, p in enumerate(train) if i in held]
            train = [p for i, p in enumerate(train) if i not in held]
    src_tok, tgt_tok = train_tokenizers(d["tokenizer"], [s for s, _ in train], [t for _, t in train],
                                        shared=o.shared_vocab, vocab_size=o.vocab_size or 8000)
    encoded = [(src_tok.encode(s), tgt_tok.encode(t)) for s, t in train]
    keep = [i for i, n in enumerate(pair_lengths(encoded)) if n <= o.max_len]
    skipped += len(encoded) - len(keep)
    encoded = [encoded[i] for i in keep]
    shared = o.shared_vocab and src_tok is tgt_tok
    config = TransformerConfig(
        src_vocab_size=src_tok.vocab_size, tgt_vocab_size=tgt_tok.vocab_size, d_model=d["d_model"],
        num_heads=d["num_heads"], num_encoder_layers=d["num_layers"], num_decoder_layers=d["num_layers"],
        d_ff=d["d_ff"], max_seq_len=max(o.max_len + 2, 64), dropout=d["dropout"], norm_first=o.norm_first,
        tie_output=o.tie_embeddings, share_embeddings=o.tie_embeddings and shared)
    torch.manual_seed(o.seed)          # the initial weights depend on the seed alone
    model = Transformer.from_config(config)
    task = TranslationTask(model, src_tok, tgt_tok, encoded, valid, max_tokens=o.max_tokens,
                           label_smoothing=o.label_smoothing, eval_size=o.eval_size, eval_beam=o.eval_beam)
    return TranslationSetup(task, test, skipped)


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF (sacrebleu, default settings) and exact-match accuracy in %."""
    refs = list(references)
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, refs))
    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), [refs]).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), [refs]).score,
            "exact": 100.0 * exact / max(len(refs), 1)}


class TranslationTask:
    """The Trainer's view of translation (see :class:`attnlab.train.Task`).

    Source ids carry no BOS/EOS; the decoder reads BOS + target and predicts target + EOS.
    Targets are right-padded, so the causal mask already keeps real positions away from
    padding; the loss ignores padded targets.
    """

    def __init__(self, model: Transformer, src_tok, tgt_tok, train: list[tuple[list[int], list[int]]],
                 valid: list[tuple[str, str]], *, max_tokens: int = 4096, label_smoothing: float = 0.1,
                 eval_size: int = 500, eval_beam: int = 1):
        if not train:
            raise ValueError("TranslationTask: no training pairs")
        self.model, self.src_tok, self.tgt_tok = model, src_tok, tgt_tok
        self.train, self.valid = train, list(valid)
        self.lengths = pair_lengths(train)
        self.max_tokens, self.label_smoothing = max_tokens, label_smoothing
        self.eval_size, self.eval_beam = eval_size, eval_beam
        self._valid_ids = [(src_tok.encode(s), tgt_tok.encode(t)) for s, t in self.valid]

    def plan(self, epoch: int, seed: int) -> list[dict]:
        batches = plan_batches(self.lengths, self.max_tokens, seed=seed, epoch=epoch)
        tok = self.tgt_tok
        return [collate(self.train, b, tok.pad_id, tok.bos_id, tok.eos_id) for b in batches]

    def loss(self, model: nn.Module, batch: dict) -> tuple[Tensor, int, dict]:
        logits = model(batch["src"], batch["tgt_in"], batch["src_mask"])
        target = batch["tgt_out"]
        loss = label_smoothed_cross_entropy(logits, target, self.label_smoothing, self.tgt_tok.pad_id)
        with torch.no_grad():
            correct = ((logits.argmax(-1) == target) & batch["tgt_mask"]).sum()
        return loss, int(batch["num_tokens"]), {"token_acc": correct}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        tok = self.tgt_tok
        nll, tokens = 0.0, 0
        for b in plan_batches(pair_lengths(self._valid_ids), self.max_tokens, shuffle=False):
            batch = collate(self._valid_ids, b, tok.pad_id, tok.bos_id, tok.eos_id)
            logits = model(batch["src"].to(device), batch["tgt_in"].to(device), batch["src_mask"].to(device))
            nll += float(label_smoothed_cross_entropy(logits, batch["tgt_out"].to(device), 0.0, tok.pad_id))
            tokens += int(batch["num_tokens"])
        subset = self.valid[: self.eval_size]
        hyps = translate(model, self.src_tok, tok, [s for s, _ in subset], beam_size=self.eval_beam, src_eos=False)
        return {"val_loss": nll / max(tokens, 1), **score_translations(hyps, [t for _, t in subset])}

    def save_assets(self, directory: Path) -> None:
        directory = Path(directory)
        shared = self.src_tok is self.tgt_tok
        self.src_tok.save(directory / "src_tokenizer.json")
        if not shared:
            self.tgt_tok.save(directory / "tgt_tokenizer.json")
        meta = {"task": "translate", "model": asdict(self.model.config), "shared_vocab": shared}
        (directory / META).write_text(json.dumps(meta, indent=1))


def load_translator(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode, src tokenizer, tgt tokenizer) from a checkpoint or a run directory; the
    model has :func:`attnlab.nn.optimize_for_inference` applied (faster gradient-free CPU calls).

    A run directory resolves to its best/ checkpoint if there is one, else the latest.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if (path / "best" / META).exists():
        path = path / "best"
    ckpt = path if (path / META).exists() else resolve_checkpoint(path)
    if ckpt is None or not (Path(ckpt) / META).exists():
        raise ValueError(f"{path} is not a translation checkpoint (no {META} found)")
    ckpt = Path(ckpt)
    meta = json.loads((ckpt / META).read_text())
    model = Transformer.from_config(meta["model"])
    load_checkpoint(ckpt, model)
    src_tok = load_tokenizer(ckpt / "src_tokenizer.json")
    tgt_tok = src_tok if meta["shared_vocab"] else load_tokenizer(ckpt / "tgt_tokenizer.json")
    return optimize_for_inference(model.to(device).eval()), src_tok, tgt_tok
