"""Answering questions about images: a vision-language model (any registered family of kind
"vision-language": a vision tower, a projector, a causal LM) trained on images with generated
question/answer pairs, for the Trainer.

    attnlab train vlm                         # the embedded digits: "what digit is this?" -> "3"
    attnlab train vlm --data photos/          # "what is in the picture?" -> the class folder's name

Each example is ``<image> question answer <eos>``: the image placeholder expanded to as many image
tokens as the model's vision tower gives features (the model's ``config.image_tokens``), the
question one of :data:`QUESTIONS` drawn per example, the answer the image's class name. The model
learns the answer tokens only (the cross-entropy summed over them; the image and question tokens
are no targets). The vocabulary is the questions' and answers' words with the image placeholder
as its last id, where the sizing builder of such a family puts the image token.

Validation and the report: each held-out image with a question, the answer decoded greedily (up to
the end token, at most 4 words) and counted right when it is the class name exactly.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.images import AUGMENTATIONS, augment
from ..models.objective import IGNORE_INDEX
from ..processors import ImageProcessor
from ..tokenizer import EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, WordTokenizer
from .base import Option, Setup, positive, register_task
from .contrastive import ImagesWithText
from .image import _arrays, _bytes, data_source
from .run import RunInfo, build_model, load_model, load_processors, resume_point, write_run
from .settings import Settings

__all__ = ["VisionLanguageTraining", "LoadedVisionLanguage", "QUESTIONS", "IMAGE_TOKEN", "answer", "answer_tokens"]

KIND = "vision-language"
IMAGE_TOKEN = "<image>"
QUESTIONS = {"digits": ("what digit is this?", "which digit is shown?", "what number is in the picture?"),
             "folder": ("what is this?", "what is in the picture?", "which class is shown?")}
_M, _D = "model", "data and evaluation"
MAX_ANSWER = 4


def _prompt(tokenizer, question: str, image_tokens: int) -> list[int]:
    image = tokenizer.vocab_size - 1
    return [image] * image_tokens + tokenizer.encode(question)


class VisionLanguageTask:
    """The Trainer's view: images as resized bytes with their class index; a planned batch is
    (image indices, seed of the augmentation and of the questions drawn)."""

    def __init__(self, model: nn.Module, processor: ImageProcessor, tokenizer, labels: list[str], questions,
                 train: tuple[Tensor, Tensor], valid: tuple[Tensor, Tensor], *, batch_size: int, augmentation: str):
        self.model, self.processor, self.tokenizer, self.labels = model, processor, tokenizer, labels
        self.questions, self.batch_size, self.augmentation = list(questions), batch_size, augmentation
        (self.train_x, self.train_y), (self.valid_x, self.valid_y) = train, valid

    def plan(self, epoch: int, seed: int) -> list[tuple[Tensor, int]]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        order = torch.randperm(len(self.train_y), generator=g).split(self.batch_size)
        seeds = torch.randint(0, 2 ** 62, (len(order),), generator=g).tolist()
        return list(zip(order, seeds))

    def examples(self, labels: Sequence[int], seed: int) -> tuple[Tensor, Tensor, Tensor]:
        """(input_ids, attention_mask, targets) (B, T): prompt + answer + <eos>, right-padded; targets
        are the next token at the answer's positions, IGNORE_INDEX elsewhere."""
        rng = random.Random(seed)
        rows, targets = [], []
        for y in labels:
            prompt = _prompt(self.tokenizer, rng.choice(self.questions), self.model.config.image_tokens)
            answer = self.tokenizer.encode(self.labels[y]) + [EOS_ID]
            seq = prompt + answer
            rows.append(seq[:-1])
            targets.append([IGNORE_INDEX] * (len(prompt) - 1) + answer)
        T = max(map(len, rows))
        ids = torch.full((len(rows), T), PAD_ID)
        mask = torch.zeros(len(rows), T, dtype=torch.long)
        tgt = torch.full((len(rows), T), IGNORE_INDEX)
        for i, (r, t) in enumerate(zip(rows, targets)):
            ids[i, :len(r)], mask[i, :len(r)], tgt[i, :len(t)] = torch.tensor(r), 1, torch.tensor(t)
        return ids, mask, tgt

    def loss(self, model: nn.Module, batch: tuple[Tensor, int]) -> tuple[Tensor, int, dict]:
        index, seed = batch
        device, index = index.device, index.cpu()
        pixels = self.processor.finish(augment(self.train_x[index], self.augmentation, int(seed))).to(device)
        ids, mask, tgt = (t.to(device) for t in self.examples(self.train_y[index].tolist(), int(seed)))
        logits = model(ids, pixels, mask).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss, int((tgt != IGNORE_INDEX).sum()), {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        answers = answer(model, self.tokenizer, self.processor.finish(self.valid_x), self.questions[0])
        right = sum(a == self.labels[y] for a, y in zip(answers, self.valid_y.tolist()))
        return {"accuracy": 100.0 * right / max(1, len(answers))}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "vlm", self.model, {"image": self.processor, "text": self.tokenizer},
                  {"labels": self.labels, "questions": self.questions})


def answer_tokens(model: nn.Module, prompt: Sequence[int], pixels: Tensor, max_new_tokens: int,
                  temperature: float = 0.0, generator: torch.Generator | None = None) -> Iterator[Tensor]:
    """The answer's tokens, one column (N,) at a time, to ``prompt`` (ids, the image tokens first)
    about each image of ``pixels`` (N, C, H, W): the prompt read once into the model's KV cache, then
    one token per step; greedy at ``temperature`` 0, else sampled (``generator``). A row that gave
    <eos> gives <eos> from then on; it stops when every row has, or after ``max_new_tokens``."""
    from ..generate.sampling import sample
    device = pixels.device
    ids = torch.tensor(list(prompt), device=device).expand(len(pixels), -1)
    cache = model.new_cache()
    logits = model(ids, pixels, cache=cache)[:, -1].float()
    done = torch.zeros(len(pixels), dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1) if temperature == 0 else sample(logits, temperature, generator=generator)
        nxt = torch.where(done, torch.full_like(nxt, EOS_ID), nxt)
        yield nxt
        done |= nxt == EOS_ID
        if bool(done.all()) or step + 1 == max_new_tokens:
            return
        logits = model(nxt[:, None], cache=cache)[:, -1].float()


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens[:tokens.index(EOS_ID)] if EOS_ID in tokens else tokens)


@torch.no_grad()
def answer(model: nn.Module, tokenizer, pixels: Tensor, question: str, batch_size: int = 100) -> list[str]:
    """The greedy answer to ``question`` about each image (pixel values (N, C, H, W)): tokens up to
    <eos>, at most :data:`MAX_ANSWER` words, decoded. Every prompt has one length, so no padding is needed."""
    device = next(model.parameters()).device
    prompt = _prompt(tokenizer, question, model.config.image_tokens)
    out = []
    for start in range(0, len(pixels), batch_size):
        columns = list(answer_tokens(model, prompt, pixels[start:start + batch_size].to(device), MAX_ANSWER + 1))
        out += [_text(tokenizer, row) for row in torch.stack(columns, 1).tolist()]
    return out


@dataclass
class LoadedVisionLanguage:
    model: nn.Module
    processor: ImageProcessor
    tokenizer: object
    questions: list[str]
    path: Path

    def answer(self, images: Sequence, question: str | None = None) -> list[str]:
        """Answers for image files, PIL images or uint8 arrays."""
        return answer(self.model, self.tokenizer, self.processor(images), question or self.questions[0])

    def prompt_ids(self, question: str) -> list[int]:
        """The ids the model reads for ``question``: the image's tokens, then the question's."""
        return _prompt(self.tokenizer, question, self.model.config.image_tokens)

    def unknown_words(self, question: str) -> list[str]:
        """The words of ``question`` that the run's vocabulary lacks (each read as <unk>)."""
        return [w for w, i in zip(question.split(), self.tokenizer.encode(question)) if i == UNK_ID]

    @torch.no_grad()
    def ask(self, image, question: str | None = None, *, max_new_tokens: int = MAX_ANSWER + 1,
            temperature: float = 0.0, seed: int = 0, on_text: Callable[[str], None] | None = None) -> str:
        """The answer to ``question`` (default: the run's first question) about one image (a file,
        a PIL image or a uint8 array), up to <eos> or ``max_new_tokens`` tokens (fewer where the
        context ends); ``on_text`` gets its text as each token is decoded. Greedy at ``temperature``
        0, as the task's validation and report answer; ValueError if the prompt fills the context."""
        from ..generate.text import TextStreamer
        from ..models.registry import input_limits
        prompt = self.prompt_ids(self.questions[0] if question is None else question)
        context = int(input_limits(self.model)["context"])
        budget = min(max_new_tokens, context - len(prompt))
        if budget < 1:
            words = context - 1 - self.model.config.image_tokens
            raise ValueError(f"the question has {len(prompt) - self.model.config.image_tokens} words; this model's "
                             f"context ({context} tokens, {self.model.config.image_tokens} of them the image's) holds "
                             f"at most {words} with a one-word answer")
        pixels = self.processor([image]).to(next(self.model.parameters()).device)
        streamer = TextStreamer(self.tokenizer, [], on_text)
        generator = torch.Generator(pixels.device).manual_seed(seed)
        for column in answer_tokens(self.model, prompt, pixels, budget, temperature, generator):
            if int(column[0]) == EOS_ID:
                break
            streamer(column)
        return streamer.end()


class VisionLanguageTraining(ImagesWithText):
    name = "vlm"
    kind = KIND
    help = ("a vision-language model (any registered family of kind vision-language) answering generated questions "
            "about the embedded digits or a folder of labelled images")
    example = ('attnlab train vlm                      # the digits: "what digit is this?" -> "3"\n'
               "  attnlab train vlm --data photos/ --time-budget 10")
    options = [
        Option("model", str, None, "a registered family of kind vision-language (default: the only one)", group=_M),
        Option("image_size", int, None, "images resized to this many pixels square (default: 8 for the digits, 32 "
               "for a folder)", check=positive, group=_M),
        Option("patch_size", int, None, "pixels per patch side (default: 2 for the digits, 4 for a folder)",
               check=positive, group=_M),
        Option("d_model", int, 64, "width of the vision tower and the language model", check=positive, group=_M),
        Option("heads", int, 4, "attention heads", check=positive, group=_M),
        Option("layers", int, 2, "layers of each", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's)", check=positive, group=_M),
        Option("batch_size", int, 64, "images per micro-batch", check=positive, group=_D),
        Option("augment", str, None, "augmentation of the training images (default: affine for the digits, "
               "crop-flip for a folder)", choices=AUGMENTATIONS, group=_D),
    ]
    data_paths = ("directory",)
    data_help = "an image folder: one sub-folder of images per class"

    def _data(self, s: Settings, processor: ImageProcessor) -> dict:
        if data_source(s) == "digits":
            from ..data.digits import DIGIT_LABELS, digits_split
            sets = {k: (_bytes(_arrays(x.expand(-1, 3, -1, -1)), processor), y) for k, (x, y) in digits_split().items()}
            return dict(sets, labels=list(DIGIT_LABELS), root="the embedded 8x8 handwritten digits")
        from .image import IMAGE, _folder_labels
        train, valid, test = IMAGE._folders(s)
        labels = train.classes
        sets = {k: (_bytes(f.paths, processor), _folder_labels(f, labels, k))
                for k, f in (("train", train), ("valid", valid), ("test", test)) if f is not None}
        return dict(sets, labels=labels, root=str(train.root))

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        questions = QUESTIONS[data_source(s)]
        if saved is not None:
            processors = load_processors(saved)
            processor, tokenizer = processors["image"], processors["text"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
            data = self._data(s, processor)
        else:
            resample = "box" if data_source(s) == "digits" else "bilinear"
            processor = ImageProcessor(size=s.image_size, resample=resample)
            data = self._data(s, processor)
            words = sorted({w for text in list(questions) + data["labels"] for w in text.split()} - set(SPECIAL_TOKENS))
            tokenizer = WordTokenizer(list(SPECIAL_TOKENS) + words + [IMAGE_TOKEN])   # the image token last
            from ..models.registry import family
            fam = family(s.model)
            longest = (s.image_size // s.patch_size) ** 2 + 1 + max(len(q.split()) for q in questions) \
                + MAX_ANSWER + 2
            config = fam.build_config(image_size=s.image_size, patch_size=s.patch_size, in_channels=3,
                                      vocab_size=tokenizer.vocab_size, context=longest, d_model=s.d_model,
                                      num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                      **self.family_sizes(s))
            torch.manual_seed(s.seed)
            model = fam.for_kind(KIND).build(config)
        task = VisionLanguageTask(model, processor, tokenizer, data["labels"], questions, data["train"], data["valid"],
                                  batch_size=s.batch_size, augmentation=s.augment)
        return self._setup(s, task, len(data["train"][1]),
                           f"{data['root']}: {len(data['train'][1]):,} training images, {len(data['valid'][1]):,} "
                           f"validation; questions such as {questions[0]!r}, answers: {', '.join(data['labels'][:12])}",
                           extra={"test": data.get("test")})

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        held_out = self._held_out(run_dir, setup)
        if held_out is None:
            return
        vlm, (x, y) = held_out
        for question in vlm.questions:
            got = answer(vlm.model, vlm.tokenizer, vlm.processor.finish(x), question)
            right = sum(a == setup.task.labels[t] for a, t in zip(got, y.tolist()))
            print(f"held-out test images, {question!r}: {100.0 * right / len(got):.1f} % answered right "
                  f"of {len(got)} (e.g. {got[0]!r} for a {setup.task.labels[int(y[0])]})")

    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedVisionLanguage:
        from .run import resolve_device
        processors = load_processors(run, {"image": "image processor", "text": "tokenizer"})
        model = load_model(run).to(resolve_device(device)).eval()
        return LoadedVisionLanguage(model, processors["image"], processors["text"], list(run.task_options["questions"]),
                                    run.path)


VLM = register_task(VisionLanguageTraining())
