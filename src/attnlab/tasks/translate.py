"""The translation task: parallel text + tokenizers + an encoder-decoder model, for the Trainer.

    attnlab train translate                                  # the embedded English->German corpus
    attnlab train translate --data train.tsv --valid valid.tsv --time-budget 30

Data: the embedded corpus (:mod:`attnlab.data.numbers`, with a held-out test split) or a TSV of
source<TAB>target (``--data``; 2 % of it held out for validation unless ``--valid`` is given).
Source ids carry no BOS/EOS; the decoder reads BOS + target and predicts target + EOS. Batches
hold at most ``--max-tokens`` padded tokens and group pairs of similar length.

Defaults (each one overridden by its flag, 0 included where valid). The embedded corpus trains
the main job's small Post-Norm model for 400 steps. A file's vocabulary, model and batch follow
its number of training pairs (:data:`FILE_SIZES`), with Pre-Norm layers (stable without a long
warmup); with ``--time-budget`` and no ``--steps`` the schedule is sized to end with the budget,
and sized again whenever the measured speed drifts (:mod:`attnlab.train.budget`), with two
evaluations (halfway and at the end). The chosen values are printed and saved in the run's
config.yaml.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from ..data.batching import collate, pair_lengths, plan_batches
from ..data.files import read_tsv
from ..data.numbers import number_corpus
from ..data.sniff import data_directory, describe_file, scored_file
from ..tokenizer import train_tokenizers
from ..train.losses import label_smoothed_cross_entropy
from .settings import EvalSettings, Settings
from .base import (Option, Setup, TaskDefinition, beyond_specials, describe_training, family_recipe, fraction,
                   non_negative, positive, register_task, training_schedule)
from .run import RunInfo, build_model, load_model, load_tokenizers, open_run, resume_point, write_run

__all__ = ["TranslationTask", "Translate", "Translator", "load_translator", "score_translations", "read_pairs"]

_M, _D = "model", "data and evaluation"

# A file's defaults by its number of training pairs: (at most this many pairs, sizes). The
# middle row is the Multi30k recipe (29,000 pairs), whose sizes won inside 30 minutes on a
# 2-core CPU; smaller corpora get a smaller model that does not memorise them, larger ones the
# paper's base sizes with larger batches.
FILE_SIZES: list[tuple[float, dict]] = [
    (10_000, dict(vocab_size=4000, d_model=128, heads=4, layers=2, d_ff=512, dropout=0.1, max_tokens=1024,
                  lr=1e-3, warmup=100, steps=2000)),
    (200_000, dict(vocab_size=8000, d_model=256, heads=4, layers=3, d_ff=1024, dropout=0.1, max_tokens=2048,
                   lr=1e-3, warmup=150, steps=4000)),
    (2_000_000, dict(vocab_size=16000, d_model=512, heads=8, layers=6, d_ff=2048, dropout=0.1, max_tokens=4096,
                     lr=7e-4, warmup=1000, steps=30000)),
    (float("inf"), dict(vocab_size=32000, d_model=512, heads=8, layers=6, d_ff=2048, dropout=0.1,
                        max_tokens=8192, lr=7e-4, warmup=4000, steps=100_000)),
]
# The embedded corpus: the main job, exactly as it has always trained (README and tests rely on it).
EMBEDDED_SIZES = dict(vocab_size=None, d_model=128, heads=4, layers=2, d_ff=256, dropout=0.1, max_tokens=2048,
                      lr=2e-3, warmup=40, steps=400)
BUDGET_EVALS = 2             # evaluations (and checkpoints) spread over a schedule sized by --time-budget


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF (sacrebleu, default settings) and exact-match accuracy in %."""
    import sacrebleu
    refs = list(references)
    exact = sum(h.strip() == r.strip() for h, r in zip(hypotheses, refs))
    return {"bleu": sacrebleu.corpus_bleu(list(hypotheses), [refs]).score,
            "chrf": sacrebleu.corpus_chrf(list(hypotheses), [refs]).score,
            "exact": 100.0 * exact / max(len(refs), 1)}


def read_pairs(path: str, skip_malformed: bool = False) -> tuple[list[tuple[str, str]], int]:
    """(pairs, skipped lines) of a TSV; ValueError if it holds no pair."""
    reader = read_tsv(path, skip_malformed=skip_malformed)
    pairs = list(reader)
    if not pairs:
        raise ValueError(f"{path}: no sentence pairs found")
    return pairs, reader.skipped


class TranslationTask:
    """The Trainer's view of translation (see :class:`attnlab.train.Task`).

    Targets are right-padded, so the causal mask already keeps real positions away from
    padding; the loss ignores padded targets.
    """

    def __init__(self, model: nn.Module, src_tok, tgt_tok, train: list[tuple[list[int], list[int]]],
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
        logits = model(batch["src"], batch["tgt_in"], src_key_padding_mask=batch["src_mask"])
        target = batch["tgt_out"]
        loss = label_smoothed_cross_entropy(logits, target, self.label_smoothing, self.tgt_tok.pad_id)
        with torch.no_grad():
            correct = ((logits.argmax(-1) == target) & batch["tgt_mask"]).sum()
        return loss, int(batch["num_tokens"]), {"token_acc": correct}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        from ..generate import translate
        device = next(model.parameters()).device
        tok = self.tgt_tok
        nll, tokens = 0.0, 0
        for b in plan_batches(pair_lengths(self._valid_ids), self.max_tokens, shuffle=False):
            batch = collate(self._valid_ids, b, tok.pad_id, tok.bos_id, tok.eos_id)
            logits = model(batch["src"].to(device), batch["tgt_in"].to(device),
                           src_key_padding_mask=batch["src_mask"].to(device))
            nll += float(label_smoothed_cross_entropy(logits, batch["tgt_out"].to(device), 0.0, tok.pad_id))
            tokens += int(batch["num_tokens"])
        metrics = {"val_loss": nll / max(tokens, 1)}
        subset = self.valid[: self.eval_size]
        if subset:
            hyps = translate(model, self.src_tok, tok, [s for s, _ in subset], beam_size=self.eval_beam,
                             src_eos=False)
            metrics.update(score_translations(hyps, [t for _, t in subset]))
        return metrics

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "translate", self.model, {"source": self.src_tok, "target": self.tgt_tok})


class Translator:
    """A trained translation run, ready to translate: ``translator(["a text", ...]) -> [str]``."""

    def __init__(self, model: nn.Module, src_tok, tgt_tok, path: Path):
        self.model, self.src_tok, self.tgt_tok, self.path = model, src_tok, tgt_tok, path

    def __call__(self, texts: Sequence[str], beam_size: int = 1, length_penalty: float = 1.0) -> list[str]:
        from ..generate import translate
        return translate(self.model, self.src_tok, self.tgt_tok, texts, beam_size=beam_size,
                         length_penalty=length_penalty, src_eos=False)


def _device(device):
    from .run import resolve_device
    return resolve_device(device)


class Translate(TaskDefinition):
    name = "translate"
    kind = "seq2seq"
    data_paths = ("file", "directory")     # --data DIR: its train.tsv and valid.tsv (attnlab.data.sniff.data_directory)
    data_help = "a TSV of source<TAB>target lines, or a directory with train.tsv and valid.tsv"
    help = "an encoder-decoder Transformer translating one language into another"
    example = ("attnlab train translate --steps 400 --out runs/numbers\n"
               "  attnlab train translate --data train.de-en.tsv --valid valid.de-en.tsv --time-budget 30")
    options = [
        Option("model", str, "transformer", "architecture: a registered encoder-decoder family", group=_M),
        Option("tokenizer", str, None, "default: word (embedded corpus), bpe (files)", choices=("word", "char", "bpe"),
               group=_M),
        Option("vocab_size", int, None, "BPE vocabulary size (default: by corpus size, 8000 for ~30k pairs)",
               check=beyond_specials, group=_M),
        Option("separate_vocab", bool, False, "separate source and target vocabularies", group=_M),
        Option("d_model", int, None, "model width (default 128 embedded; files: by corpus size, 256 for ~30k "
               "pairs)", check=positive, group=_M),
        Option("heads", int, None, "attention heads (default 4; 8 for corpora over 200k pairs)", check=positive,
               group=_M),
        Option("layers", int, None, "encoder and decoder layers each (default 2 embedded; files: by corpus size, "
               "3 for ~30k pairs)", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default 256 embedded; files: 4 d_model)", check=positive,
               group=_M),
        Option("dropout", float, None, "dropout (default 0.1)", check=fraction, group=_M),
        Option("pre_norm", bool, None, "Pre-Norm layers (default: Pre-Norm for files; Post-Norm, as the paper, "
               "for the embedded corpus)", group=_M),
        Option("max_tokens", int, None, "padded tokens per micro-batch (default 2048 embedded; files: by corpus "
               "size, 2048 for ~30k pairs)", check=positive, group=_D),
        Option("max_len", int, 256, "longer training pairs are skipped and counted", check=positive, group=_D),
        Option("label_smoothing", float, 0.1, "label smoothing of the loss", check=fraction, group=_D),
        Option("eval_size", int, 500, "validation pairs translated for BLEU at each evaluation (0 = none)",
               check=non_negative, group=_D),
        Option("corpus_size", int, 20000, "embedded corpus: training pairs", check=positive, group=_D),
    ]

    eval_options = [
        Option("beam", int, 4, "beam size (1 = greedy)", check=positive),
        Option("limit", int, None, "score only the first N items", check=positive),
        Option("skip_malformed", bool, False, "skip malformed lines of the data file"),
    ]

    # ------------------------------------------------------------------ training
    def _sizes(self, s: Settings, n_pairs: int) -> dict:
        """The model, vocabulary, batch and optimisation defaults for ``n_pairs`` training pairs
        (the embedded corpus: the main job's), each replaced by its option when given."""
        if s.data is None:
            base = dict(EMBEDDED_SIZES, tokenizer="word", pre_norm=False)
        else:
            base = dict(next(sizes for most, sizes in FILE_SIZES if n_pairs <= most), tokenizer="bpe", pre_norm=True)
        base.update(family_recipe(s, s.model))            # a family's own optimizer, lr and weight decay
        from ..models.registry import family
        if "norm_first" not in family(s.model).options:
            base["pre_norm"] = None                 # a fixed layer order (T5's): nothing to choose or record
        if s.tokenizer not in (None, "bpe") or base["tokenizer"] != "bpe":
            base["vocab_size"] = None               # word and char vocabularies are what the text holds
        chosen = s.given_or(base)
        if s.d_model is not None and s.d_ff is None and s.data is not None:
            chosen["d_ff"] = 4 * s.d_model       # the family's usual ratio when only the width is given
        return chosen

    def _schedule(self, s: Settings, d: dict) -> dict:
        """The Trainer's length, lr, warmup and evaluation defaults (flags win)."""
        def warmup(steps: int, budget: bool) -> int:
            if budget:                    # shortened to a tenth of the planned steps if the budget is short
                return d["warmup"]
            return min(d["warmup"] if s.data is not None else 4000, max(1, steps // 10))   # a tenth at most

        return training_schedule(s, d, warmup, lambda steps, budget: max(500 if budget else steps // 5, 100),
                                 BUDGET_EVALS)

    def _describe(self, s: Settings, d: dict, t: dict, n_pairs: int, src_tok, tgt_tok, saved) -> list[str]:
        """One line per group of the chosen values (as ``attnlab train`` prints them)."""
        if saved is not None:
            model = "model: from the checkpoint"
        else:
            vocab = (f"{d['tokenizer']} vocabulary {src_tok.vocab_size}/{tgt_tok.vocab_size}"
                     f"{' (shared)' if src_tok is tgt_tok else ''}")
            from ..models.registry import family
            norm = f"{'Pre' if d['pre_norm'] else 'Post'}-Norm " if "norm_first" in family(s.model).options else ""
            model = (f"model (for {n_pairs:,} pairs): {vocab}, d_model {d['d_model']}, {d['heads']} heads, "
                     f"{d['layers']}+{d['layers']} {norm}layers, d_ff {d['d_ff']}, dropout {d['dropout']}, "
                     f"family {s.model}")
        return [model, f"batches: at most {d['max_tokens']:,} padded tokens",
                describe_training(s, t)]

    def check(self, s: Settings) -> None:
        from ..models.registry import families, family
        known = sorted(f.model_type for f in families(kind=self.kind))
        if s.model not in known:
            raise ValueError(f"--model: {s.model!r} is not a registered encoder-decoder family ({', '.join(known)})")
        super().check(s)
        if s.pre_norm is not None and "norm_first" not in family(s.model).options:
            # a family with a fixed layer order (T5 is Pre-Norm by design) would silently ignore it
            raise ValueError(f"--pre-norm/--no-pre-norm: --model {s.model} has a fixed layer order; the choice "
                             f"applies to families with a Norm option (transformer)")
        s.data, s.valid = data_directory(s.data, s.valid, (".tsv",))

    def _model(self, s: Settings, d: dict, src_tok, tgt_tok) -> nn.Module:
        """A fresh model of the chosen family through the model registry, sized by the options."""
        from ..models.registry import family
        fam = family(s.model)
        # what the task knows beyond the shared sizes; a family takes those its builder has (a family
        # without a Norm choice or with its own tying rule has no norm_first or tie_output), and the
        # target tokenizer's special ids it states (register_family's token_ids)
        known = dict(tgt_vocab_size=tgt_tok.vocab_size, norm_first=s.pre_norm, tie_output=True,
                     share_embeddings=src_tok is tgt_tok)
        config = fam.build_config(
            vocab_size=src_tok.vocab_size, context=max(s.max_len + 2, 64), d_model=d["d_model"],
            num_heads=d["heads"], num_layers=d["layers"], d_ff=d["d_ff"], dropout=d["dropout"],
            **{k: v for k, v in known.items() if k in fam.options}, **self.family_sizes(s, tgt_tok))
        torch.manual_seed(s.seed)              # the initial weights depend on the seed alone
        return fam.for_kind(self.kind).build(config)

    def _data(self, s: Settings) -> tuple[list, list, list, int]:
        if s.data is None:
            train, valid, test = number_corpus(n_train=s.corpus_size, seed=s.seed)
            return train, valid, test, 0
        train, skipped = read_pairs(s.data, s.skip_malformed)
        if s.valid:
            valid, more = read_pairs(s.valid, s.skip_malformed)
            return train, valid, [], skipped + more
        if len(train) < 2:
            raise ValueError(f"{s.data}: {len(train)} sentence pair: too few to hold out validation pairs and "
                             "train; give --valid FILE")
        order = list(range(len(train)))                  # hold out a deterministic 2% (at most 1000 pairs)
        random.Random(s.seed).shuffle(order)
        held = set(order[:min(1000, max(1, len(train) // 50))])
        return ([p for i, p in enumerate(train) if i not in held], [p for i, p in enumerate(train) if i in held],
                [], skipped)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        """Data, tokenizers, model and the Trainer's task. The data-derived defaults are written
        into ``s``, so the run's saved settings hold the values it used."""
        self.check_once(s)
        self.apply_family_defaults(s)
        train, valid, test, skipped = self._data(s)
        d = self._sizes(s, len(train))
        t = self._schedule(s, d)
        s.update({k: v for k, v in d.items() if k in s and k not in ("steps", "warmup", "lr")}, lr=t["lr"])
        if not t["budget_schedule"]:        # a budget's steps are planned in training, kept in its checkpoints
            s.update(steps=t["steps"], warmup=t["warmup_steps"])
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:               # the run's own tokenizers and model; the Trainer loads the weights
            toks = load_tokenizers(saved)
            src_tok, tgt_tok = toks["source"], toks["target"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        else:
            src_tok, tgt_tok = train_tokenizers(d["tokenizer"], [a for a, _ in train], [b for _, b in train],
                                                shared=not s.separate_vocab, vocab_size=d["vocab_size"] or 8000)
            model = self._model(s, d, src_tok, tgt_tok)
        encoded = [(src_tok.encode(a), tgt_tok.encode(b)) for a, b in train]
        kept = _within(encoded, s.max_len, s.data)
        skipped += len(encoded) - len(kept)
        encoded = kept
        embedded = s.data is None
        task = TranslationTask(model, src_tok, tgt_tok, encoded, valid, max_tokens=d["max_tokens"],
                               label_smoothing=s.label_smoothing, eval_size=s.eval_size)
        n_params = sum(p.numel() for p in model.parameters())
        lines = [f"data: {'the embedded English->German corpus' if embedded else s.data}: {len(encoded):,} "
                 f"training pairs, {len(valid):,} validation" + (f", {len(test):,} test" if test else "")]
        if skipped:
            lines.append(f"skipped {skipped} training pairs (malformed or longer than {s.max_len} tokens)")
        lines.append(f"model: {n_params / 1e6:.2f}M parameters, vocab {src_tok.vocab_size}/{tgt_tok.vocab_size}"
                     + (" (from the checkpoint)" if saved else ""))
        lines += self._describe(s, d, t, len(train), src_tok, tgt_tok, saved)
        return Setup(task, lines, {"test": test}, schedule=t)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        return dict(setup.schedule, betas=(0.9, 0.98 if s.beta2 is None else s.beta2),
                    best_metric="bleu" if s.eval_size else "val_loss", best_mode="max" if s.eval_size else "min")

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        """A few held-out translations and the test (embedded corpus) or validation scores."""
        translator = self.load(open_run(run_dir))
        pairs = setup.extra["test"] or setup.task.valid[:500]
        if not pairs:
            return
        hyps = translator([a for a, _ in pairs])
        for (a, b), h in list(zip(pairs, hyps))[:5]:
            print(f"  {a}\n    -> {h}\n    ref {b}")
        scores = score_translations(hyps, [b for _, b in pairs])
        name = "test" if setup.extra["test"] else "validation"
        print(f"{name} ({len(pairs)} pairs): BLEU {scores['bleu']:.2f}  chrF {scores['chrf']:.2f}  "
              f"exact match {scores['exact']:.1f}%")

    # ------------------------------------------------------------------ inference
    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> Translator:
        """The run's model for inference: oneDNN Linear layers; ``dtype`` "auto" adds bf16 weight
        copies for the large ones (at d_model 256 only the output projection) where the device does
        bf16 natively, "bf16" forces them. The default stays fp32 for translation: bf16's speed and
        BLEU on a translator have not been measured yet (GPT-2's decoding was, benchmarks/README.md)."""
        from ..nn.linear import prepare_for_inference
        toks = load_tokenizers(run)
        model, _ = prepare_for_inference(load_model(run).to(_device(device)).eval(), dtype)
        return Translator(model, toks["source"], toks["target"], run.path)


    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "fp32") -> None:
        data = scored_file(data, (".tsv",))
        shape = describe_file(data)
        if shape.kind in ("labelled", "jsonl"):
            raise ValueError(f"{data}: {shape.description}, which a classify run reads ('attnlab eval' of a classify "
                             "run); a translation run scores source<TAB>reference lines")
        pairs, _ = read_pairs(data, settings.skip_malformed)
        pairs = pairs[: settings.limit]
        translator = self.load(info.run, device, dtype)
        hyps = translator([a for a, _ in pairs], beam_size=settings.beam)
        scores = score_translations(hyps, [b for _, b in pairs])
        print(f"{data}: {len(pairs)} pairs, beam {settings.beam}: BLEU {scores['bleu']:.2f}  "
              f"chrF {scores['chrf']:.2f}  exact match {scores['exact']:.1f}%")


TRANSLATE = register_task(Translate())


def _within(encoded: list[tuple[list[int], list[int]]], max_len: int, data: str | None) -> list:
    """The encoded pairs of at most ``max_len`` tokens a side; ValueError naming the file if none is."""
    lengths = pair_lengths(encoded)
    kept = [p for p, n in zip(encoded, lengths) if n <= max_len]
    if encoded and not kept:
        raise ValueError(f"{data or 'the embedded corpus'}: every one of its {len(encoded):,} training pairs is longer "
                         f"than --max-len {max_len} tokens (the shortest has {min(lengths):,}); raise --max-len")
    return kept


def load_translator(path: str | Path, device: str | torch.device | None = None):
    """(model in eval mode, source tokenizer, target tokenizer) of a translation run or checkpoint
    (a run directory resolves to its best/ checkpoint, else its latest)."""
    run = open_run(path)
    if run.task != "translate":
        raise ValueError(f"{path}: an attnlab '{run.task}' run, not a translation run")
    t = TRANSLATE.load(run, device)
    return t.model, t.src_tok, t.tgt_tok
