"""Speech recognition: a model of kind "speech-to-text" (log-mel frames in, words out) trained from
scratch on the embedded spoken corpus (:mod:`attnlab.data.speech`), for the Trainer.

    attnlab train speech --time-budget 20            # sentences of the numbers corpus, spoken by espeak-ng
    attnlab transcribe runs/speech hello.wav         # the words it hears

The corpus is made on first use (espeak-ng speaks each sentence into a cached WAV file); the
training and validation sentences are spoken by six voices, the test sentences by a seventh that
training never hears. Each utterance becomes log-mel frames through the run's feature extractor
(:class:`attnlab.processors.LogMelFeatureExtractor`, saved as preprocessor_config.json), padded to
one chunk whose length is the longest utterance's, rounded up to whole seconds. The transcript is a
sequence of words (a word vocabulary of the grammar's words), decoded from <bos> greedily to <eos>.

Training masks random bands of frequency and spans of time in each example (SpecAugment, Park et
al. 2019), drawn from the batch's seed, so that a voice's particular formants matter less.
Validation and the report score word error rate (:func:`word_error_rate`): the word-level edit
distance to the reference (substitutions, deletions, insertions) over the reference's words.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import Tensor, nn

from ..processors import LogMelFeatureExtractor
from ..tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, WordTokenizer
from ..train.losses import label_smoothed_cross_entropy
from .base import Option, Setup, TaskDefinition, describe_training, fraction, positive, register_task, \
    training_schedule
from .run import RunInfo, build_model, load_model, load_processors, resume_point, write_run
from .settings import Settings

__all__ = ["SpeechTraining", "Transcriber", "word_error_rate", "word_errors", "transcribe", "spec_augment"]

KIND = "speech-to-text"
_M, _D = "model", "data and evaluation"
EXTRA_POSITIONS = 6            # decoder positions beyond the longest sentence's words, <bos> and <eos>


# ----------------------------------------------------------------------------- word error rate
def word_errors(hypothesis: str, reference: str) -> int:
    """The fewest word substitutions, deletions and insertions that turn ``hypothesis`` into
    ``reference`` (Levenshtein distance over whitespace-separated words)."""
    hyp, ref = hypothesis.split(), reference.split()
    previous = list(range(len(hyp) + 1))          # distances from ref[:0] to each hyp prefix
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1,                 # ref word deleted from the hypothesis
                               current[j - 1] + 1,              # hyp word inserted
                               previous[j - 1] + (r != h)))     # substituted, or right
        previous = current
    return previous[-1]


def word_error_rate(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus word error rate in percent: all the word errors over all the reference words."""
    if len(hypotheses) != len(references):
        raise ValueError(f"word_error_rate: {len(hypotheses)} hypotheses for {len(references)} references")
    words = sum(len(r.split()) for r in references)
    if words == 0:
        raise ValueError("word_error_rate: the references hold no words")
    return 100.0 * sum(word_errors(h, r) for h, r in zip(hypotheses, references)) / words


# ----------------------------------------------------------------------------- the Trainer's task
def spec_augment(x: Tensor, generator: torch.Generator, bands: int = 2, max_band: int = 6, spans: int = 2,
                 max_span: int = 25) -> Tensor:
    """Frames (B, M, F) with ``bands`` random bands of up to ``max_band`` mel bins and ``spans``
    random spans of up to ``max_span`` frames per example set to each example's mean (a copy)."""
    x = x.clone()
    B, M, F = x.shape
    fill = x.mean(dim=(1, 2))
    for b in range(B):
        for size, width, dim in ((M, max_band, 1), (F, max_span, 2)):
            for _ in range(bands if dim == 1 else spans):
                w = int(torch.randint(0, min(width, size) + 1, (1,), generator=generator))
                start = int(torch.randint(0, size - w + 1, (1,), generator=generator))
                if dim == 1:
                    x[b, start:start + w] = fill[b]
                else:
                    x[b, :, start:start + w] = fill[b]
    return x


def _targets(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
    """(decoder input <bos> + ids, target ids + <eos>), both (B, T) right-padded with <pad>."""
    T = max(map(len, rows)) + 1
    tgt_in, tgt_out = torch.full((len(rows), T), PAD_ID), torch.full((len(rows), T), PAD_ID)
    for i, r in enumerate(rows):
        tgt_in[i, :len(r) + 1] = torch.tensor([BOS_ID] + r)
        tgt_out[i, :len(r) + 1] = torch.tensor(r + [EOS_ID])
    return tgt_in, tgt_out


class SpeechTask:
    """The Trainer's view: utterances as precomputed frames with their word ids; a planned batch is
    (utterance indices, the seed of its augmentation)."""

    def __init__(self, model: nn.Module, extractor: LogMelFeatureExtractor, tokenizer, train: tuple[Tensor, list],
                 valid: tuple[Tensor, list[str]], *, batch_size: int, label_smoothing: float, augment: bool):
        self.model, self.extractor, self.tokenizer = model, extractor, tokenizer
        (self.train_x, self.train_ids), (self.valid_x, self.valid_text) = train, valid
        self.batch_size, self.label_smoothing, self.augment = batch_size, label_smoothing, augment

    def plan(self, epoch: int, seed: int) -> list[tuple[Tensor, int]]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(len(self.train_ids), generator=g).split(self.batch_size)
        seeds = torch.randint(0, 2 ** 62, (len(order),), generator=g).tolist()
        return list(zip(order, seeds))

    def loss(self, model: nn.Module, batch: tuple[Tensor, int]) -> tuple[Tensor, int, dict]:
        index, seed = batch
        device, index = index.device, index.cpu()
        x = self.train_x[index]
        if self.augment:
            x = spec_augment(x, torch.Generator().manual_seed(int(seed)))
        tgt_in, tgt_out = (t.to(device) for t in _targets([self.train_ids[i] for i in index.tolist()]))
        logits = model(x.to(device), tgt_in, decoder_attention_mask=tgt_in != PAD_ID)
        loss = label_smoothed_cross_entropy(logits, tgt_out, self.label_smoothing, PAD_ID)
        real = tgt_out != PAD_ID
        with torch.no_grad():
            correct = ((logits.argmax(-1) == tgt_out) & real).sum()
        return loss, int(real.sum()), {"token_acc": correct}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        hyps = transcribe(model, self.tokenizer, self.valid_x)
        return {"wer": word_error_rate(hyps, self.valid_text)}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "speech", self.model, {"audio": self.extractor, "text": self.tokenizer})


@torch.no_grad()
def transcribe(model: nn.Module, tokenizer, features: Tensor, beam_size: int = 1, batch_size: int = 64) -> list[str]:
    """The words ``model`` hears in log-mel frames (N, M, F): decoded from <bos> to <eos>, greedily
    (``beam_size`` 1) or by beam search, at most as many tokens as the decoder has positions."""
    from ..generate import beam_search, greedy_decode
    from ..models.registry import input_limits
    device = next(model.parameters()).device
    longest = input_limits(model)["context"] - 1
    out = []
    for start in range(0, len(features), batch_size):
        x = features[start:start + batch_size].to(device)
        if beam_size == 1:
            rows = greedy_decode(model, x, max_len=longest, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID).tolist()
        else:
            rows = beam_search(model, x, beam_size=beam_size, max_len=longest, bos_id=BOS_ID, eos_id=EOS_ID)
        out += [tokenizer.decode(r[:r.index(EOS_ID)] if EOS_ID in r else r) for r in rows]
    return out


@dataclass
class Transcriber:
    """A trained speech run: ``transcriber(["a.wav", ...]) -> [text]``."""
    model: nn.Module
    extractor: LogMelFeatureExtractor
    tokenizer: object
    path: Path

    def features(self, files: Sequence[str | Path]) -> Tensor:
        """Log-mel frames (N, M, F) of 16-bit PCM WAV files at the extractor's rate (AudioError naming a bad one)."""
        return torch.stack([self.extractor.features(f) for f in files])

    def __call__(self, files: Sequence[str | Path], beam_size: int = 1) -> list[str]:
        return transcribe(self.model, self.tokenizer, self.features(files), beam_size)


# ----------------------------------------------------------------------------- the task
def _vocabulary(max_words: int) -> WordTokenizer:
    """Every word of the grammar's English side (sentences of up to ``max_words`` words, and the
    number words 1-99): a vocabulary of the language, not of the sentences drawn for training."""
    from ..data.numbers import english_number, number_corpus
    texts = [en for en, _ in number_corpus(20000, 0, 0, seed=12345, max_words=max_words).train]
    words = {w for t in texts for w in t.split()} | {english_number(n) for n in range(1, 100)}
    return WordTokenizer(list(SPECIAL_TOKENS) + sorted(words - set(SPECIAL_TOKENS)))


def _features(extractor: LogMelFeatureExtractor, utterances) -> Tensor:
    from ..processors import read_wav
    return extractor([read_wav(u.path)[0] for u in utterances]) if utterances else \
        torch.zeros(0, extractor.feature_size, extractor.nb_max_frames)


class SpeechTraining(TaskDefinition):
    name = "speech"
    kind = KIND
    help = ("speech recognition (any registered family of kind speech-to-text) trained from scratch on the embedded "
            "spoken corpus: numbers-corpus sentences spoken by espeak-ng")
    example = ("attnlab train speech --time-budget 20 --out runs/speech\n"
               "  attnlab transcribe runs/speech utterance.wav")
    options = [
        Option("model", str, None, "a registered family of kind speech-to-text (default: its default family)",
               group=_M),
        Option("d_model", int, 128, "model width", check=positive, group=_M),
        Option("heads", int, 4, "attention heads", check=positive, group=_M),
        Option("layers", int, 2, "encoder and decoder layers each", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's)", check=positive, group=_M),
        Option("dropout", float, 0.1, "dropout", check=fraction, group=_M),
        Option("mel_bins", int, 40, "mel bands per frame", check=positive, group=_M),
        Option("hop_length", int, 320, "samples between frames (320: 20 ms of audio at 16 kHz; Whisper's own is "
               "160, 10 ms of audio: twice the frames and the encoder's work)", check=positive, group=_M),
        Option("chunk_seconds", int, None, "seconds of audio per input, padded or cut (default: the longest "
               "training utterance's, rounded up)", check=positive, group=_M),
        Option("sentences", int, 2000, "training sentences (each spoken once, in a voice and speed drawn with "
               "--seed)", check=positive, group=_D),
        Option("max_words", int, 8, "the longest sentence in words", check=lambda v: None if v >= 3 else
               "must be at least 3", group=_D),
        Option("eval_size", int, 100, "validation sentences (training voices), scored by word error rate",
               check=positive, group=_D),
        Option("test_size", int, 100, "test sentences in the held-out voice, scored after training", check=positive,
               group=_D),
        Option("audio_cache", str, None, "folder of the spoken corpus's WAV files (default: "
               "~/.cache/attnlab/spoken-numbers)", metavar="DIR", group=_D, resumable=True),
        Option("batch_size", int, 32, "utterances per micro-batch", check=positive, group=_D),
        Option("label_smoothing", float, 0.1, "label smoothing of the loss", check=fraction, group=_D),
        Option("augment", bool, True, "mask random frequency bands and time spans of the training frames", group=_D),
    ]

    def check(self, s: Settings) -> None:
        self.check_family_of_kind(s)
        super().check(s)
        if s.data is not None or s.valid is not None:
            raise ValueError("--data/--valid: the speech task trains on the embedded spoken corpus only")

    def _corpus(self, s: Settings):
        from ..data.speech import spoken_numbers
        return spoken_numbers(s.audio_cache, n_train=s.sentences, n_valid=s.eval_size, n_test=s.test_size,
                              seed=s.seed, max_words=s.max_words)

    def _schedule(self, s: Settings, n: int) -> dict:
        steps = max(200, min(4000, 15 * -(-n // s.batch_size)))
        return training_schedule(s, dict(steps=steps, lr=2e-3), lambda steps, budget: 100 if budget else
                                 max(1, min(200, steps // 10)), lambda steps, budget: max(steps // 5, 20), 5)

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        corpus = self._corpus(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        if saved is not None:               # the run's own extractor, vocabulary and model
            processors = load_processors(saved)
            extractor, tokenizer = processors["audio"], processors["text"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        else:
            from ..processors import read_wav
            longest = max(read_wav(u.path)[0].numel() for u in corpus.train) / 16000
            seconds = s.chunk_seconds or max(1, math.ceil(longest))
            extractor = LogMelFeatureExtractor(feature_size=s.mel_bins, chunk_length=seconds, hop_length=s.hop_length)
            tokenizer = _vocabulary(s.max_words)
            from ..models.registry import family
            fam = family(s.model)
            config = fam.build_config(num_mel_bins=s.mel_bins, frames=extractor.nb_max_frames,
                                      vocab_size=tokenizer.vocab_size, context=s.max_words + EXTRA_POSITIONS,
                                      d_model=s.d_model, num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                      dropout=s.dropout, **self.family_sizes(s, tokenizer))
            torch.manual_seed(s.seed)
            model = fam.for_kind(KIND).build(config)
        train_x, valid_x = _features(extractor, corpus.train), _features(extractor, corpus.valid)
        ids = [tokenizer.encode(u.text) for u in corpus.train]
        task = SpeechTask(model, extractor, tokenizer, (train_x, ids), (valid_x, [u.text for u in corpus.valid]),
                          batch_size=s.batch_size, label_smoothing=s.label_smoothing, augment=s.augment)
        t = self._schedule(s, len(ids))
        s.lr = t["lr"]
        n = sum(p.numel() for p in model.parameters()) / 1e6
        voices = sorted({u.voice for u in corpus.train})
        lines = [f"data: the spoken numbers corpus: {len(ids):,} training utterances in {len(voices)} voices "
                 f"({', '.join(voices)}), {len(corpus.valid):,} validation, {len(corpus.test):,} test in the held-out "
                 f"voice {corpus.test[0].voice if corpus.test else '-'}; {extractor.chunk_length} s chunks, "
                 f"{extractor.feature_size} mel bands",
                 f"model: {type(model).__name__} ({s.model}), {n:.2f}M parameters, {tokenizer.vocab_size} words"
                 + (" (from the checkpoint)" if saved else ""), describe_training(s, t)]
        return Setup(task, lines, {"test": corpus.test}, schedule=t)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        return dict(setup.schedule, betas=(0.9, 0.98 if s.beta2 is None else s.beta2), best_metric="wer",
                    best_mode="min")

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        from .run import open_run
        transcriber = self.load(open_run(run_dir))
        for name, utterances in (("validation (training voices)", None), ("test (held-out voice)", setup.extra["test"])):
            if utterances is None:
                hyps = transcribe(transcriber.model, transcriber.tokenizer, setup.task.valid_x)
                refs = setup.task.valid_text
            else:
                hyps = transcriber([u.path for u in utterances])
                refs = [u.text for u in utterances]
            if refs:
                print(f"{name}: word error rate {word_error_rate(hyps, refs):.1f} % over {len(refs)} sentences "
                      f"(e.g. {refs[0]!r} -> {hyps[0]!r})")

    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> Transcriber:
        from .run import resolve_device
        processors = load_processors(run, {"audio": "feature extractor", "text": "tokenizer"})
        model = load_model(run).to(resolve_device(device)).eval()
        return Transcriber(model, processors["audio"], processors["text"], run.path)


SPEECH = register_task(SpeechTraining())
