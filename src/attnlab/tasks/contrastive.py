"""Contrastive image-text training: images with captions, an image processor, a caption tokenizer and
any registered family of kind "contrastive", for the Trainer; then zero-shot classification and
embeddings of images and texts.

    attnlab train clip                                   # the embedded digits, "a photo of a 3"
    attnlab train clip --data photos/ --template "a photo of a {}"
    attnlab train clip --data photos/ --captions captions.tsv
    attnlab classify runs/clip --labels "cat,dog" cat.png
    attnlab embed runs/clip "a photo of a 3" --images three.png

Captions. From an image folder (one sub-folder per class, as ``attnlab train image`` reads it) each
image's caption is ``--template`` filled with its class folder's name; ``--captions FILE`` gives
captions of one's own instead, one ``IMAGE<TAB>caption`` per line, IMAGE relative to ``--data``.
Without ``--data``: the embedded 8x8 digits (:mod:`attnlab.data.digits`, the image task's split:
1,497 to train on, 100 to validate with, 200 held out for the report).

Batches. The loss scores each image of a batch against the batch's distinct captions: images
of one class share a caption, which then takes every one of them as its target (the model's
objective with ``text_index``), so no image is pushed away from a caption that describes it. A
batch holds as many images of each of its captions (``--batch-size`` // captions, at least one;
rounds of that many from each caption, in shuffled order): with unequal counts every caption's
vector was pulled along the images' common direction, and on the digits the ten captions' vectors
became one (cosine 1.0000 within 25 steps) and stayed there at chance accuracy.

The tokenizer. A byte-pair vocabulary trained on the captions, with one token added after it, the
end of text: the text's vector is read at the end token, which models of this kind find either by
its id or as the text's largest id (the rule transformers applies to configs whose end id is 2,
attnlab's ``<eos>``); an end token that is the vocabulary's last token and not id 2 is found by
both. Its post-processor appends it, so transformers' tokenizer, reading the exported
tokenizer.json, encodes a caption as the run did.

Validation and the report: every image scored against the distinct captions of its split (with
class captions: zero-shot classification over the classes), accuracy = its own caption first.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..data.images import AUGMENTATIONS, ImageFolder, augment, image_splits, read_image_folder
from ..processors import ImageProcessor
from ..tokenizer import BPETokenizer, HFTokenizer
from .base import Option, Setup, TaskDefinition, describe_training, positive, register_task, training_schedule
from .image import _arrays, _bytes, data_source
from .run import RunError, RunInfo, build_model, load_model, load_processors, resume_point, write_run
from .settings import Settings

__all__ = ["ImagesWithText", "ContrastiveTraining", "ContrastiveTask", "LoadedContrastive",
           "load_pretrained_contrastive", "caption_tokenizer", "END_TOKEN"]

KIND = "contrastive"
END_TOKEN = "<|endoftext|>"
_M, _D = "model", "data and evaluation"
_SIZES = {"digits": dict(image_size=8, patch_size=2, augment="affine", steps=1500, lr=2e-3),
          "folder": dict(image_size=32, patch_size=4, augment="crop-flip", steps=None, lr=1e-3)}


def caption_tokenizer(captions: Sequence[str], vocab_size: int) -> HFTokenizer:
    """A BPE vocabulary of at most ``vocab_size`` pieces learnt from ``captions``, then
    :data:`END_TOKEN` as its last id, appended to every encoded text (the module docstring says why)."""
    from tokenizers import processors
    hf = BPETokenizer.train(captions, vocab_size).hf
    hf.add_special_tokens([END_TOKEN])
    hf.post_processor = processors.TemplateProcessing(single=f"$A {END_TOKEN}",
                                                      special_tokens=[(END_TOKEN, hf.token_to_id(END_TOKEN))])
    return HFTokenizer(hf, {"pad": "<pad>", "bos": "<bos>", "eos": END_TOKEN, "unk": "<unk>"})


def encode_captions(tokenizer, captions: Sequence[str], context: int) -> tuple[Tensor, Tensor]:
    """(input_ids (N, T), attention_mask (N, T)) right-padded; a caption longer than ``context``
    keeps its first context - 1 tokens and its end token."""
    rows = []
    for c in captions:
        ids = tokenizer.encode(c)
        rows.append(ids if len(ids) <= context else ids[:context - 1] + ids[-1:])
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    return ids, mask


def _read_captions(file: str, root: str) -> tuple[list[Path], list[str]]:
    """(image paths, captions) of a captions file; ValueError naming the file and line."""
    from ..processors import IMAGE_SUFFIXES
    paths, captions = [], []
    for n, line in enumerate(Path(file).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 2 or not parts[0].strip() or not parts[1].strip():
            raise ValueError(f"{file}, line {n}: expected IMAGE<TAB>caption")
        path = Path(root) / parts[0].strip()
        if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
            raise ValueError(f"{file}, line {n}: {path} is not an image file")
        paths.append(path)
        captions.append(parts[1].strip())
    if len(set(captions)) < 2:
        raise ValueError(f"{file}: needs at least two different captions")
    return paths, captions


# ----------------------------------------------------------------------------- the Trainer's task
class ContrastiveTask:
    """The Trainer's view: images as resized bytes, each with the index of its caption; a planned
    batch is (image indices, augmentation seed)."""

    def __init__(self, model: nn.Module, processor: ImageProcessor, tokenizer, captions: list[str],
                 train: tuple[Tensor, Tensor], valid: tuple[Tensor, Tensor], *, batch_size: int, augmentation: str,
                 task_options: Settings):
        self.model, self.processor, self.tokenizer, self.batch_size = model, processor, tokenizer, batch_size
        self.captions, self.augmentation, self.task_options = captions, augmentation, task_options
        self.context = model.config.context
        self.ids, self.mask = encode_captions(tokenizer, captions, self.context)
        (self.train_x, self.train_c), (self.valid_x, self.valid_c) = train, valid
        self.train_y = self.train_c                     # what the shared schedule counts

    def plan(self, epoch: int, seed: int) -> list[tuple[Tensor, int]]:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        groups = [m[torch.randperm(len(m), generator=g)] for c in self.train_c.unique()
                  for m in [(self.train_c == c).nonzero().flatten()]]
        k = max(1, self.batch_size // len(groups))              # images per caption in a batch
        batches = []
        for r in range(0, max(map(len, groups)), k):
            round_ = torch.cat([m[r:r + k] for m in groups if len(m) > r])
            batches += list(round_[torch.randperm(len(round_), generator=g)].split(self.batch_size))
        order = torch.randperm(len(batches), generator=g).tolist()
        seeds = torch.randint(0, 2 ** 62, (len(batches),), generator=g).tolist()
        return [(batches[i], s) for i, s in zip(order, seeds)]

    def inputs(self, images: Tensor, caption_index: Tensor, device) -> dict:
        """The model's batch: the images, their distinct captions, and which caption is each image's."""
        captions, text_index = caption_index.unique(return_inverse=True)
        ids, mask = self.ids[captions], self.mask[captions]
        T = int(mask.sum(1).max())
        return {"input_ids": ids[:, :T].to(device), "pixel_values": self.processor.finish(images).to(device),
                "attention_mask": mask[:, :T].to(device), "text_index": text_index.to(device)}

    def loss(self, model: nn.Module, batch: tuple[Tensor, int]) -> tuple[Tensor, int, dict]:
        from ..models.registry import training_loss
        index, seed = batch
        device, index = index.device, index.cpu()
        images = augment(self.train_x[index], self.augmentation, int(seed))
        out = training_loss(self.model, self.inputs(images, self.train_c[index], device), forward=model)
        return out.loss, out.count, {"accuracy": out.metrics["correct"]}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict:
        device = next(model.parameters()).device
        kept = self.valid_c.unique()                   # the distinct captions of the validation images
        ids, mask = self.ids[kept].to(device), self.mask[kept].to(device)
        logits = torch.cat([model(ids, self.processor.finish(self.valid_x[b]).to(device), mask)[0].float()
                            for b in torch.arange(len(self.valid_c)).split(256)])
        target = torch.searchsorted(kept, self.valid_c).to(device)
        return {"val_loss": float(F.cross_entropy(logits, target)),
                "accuracy": 100.0 * float((logits.argmax(-1) == target).float().mean())}

    def save_assets(self, directory: Path) -> None:
        write_run(directory, "clip", self.model, {"image": self.processor, "text": self.tokenizer}, self.task_options)


# ----------------------------------------------------------------------------- inference
@dataclass
class LoadedContrastive:
    """A trained run for inference: ``labels`` (each put into ``template``) are what
    :meth:`probabilities` chooses among; :meth:`zero_shot` gives the same model with other labels."""
    model: nn.Module
    processor: ImageProcessor
    tokenizer: object
    labels: list[str]
    template: str
    path: Path

    def zero_shot(self, labels: Sequence[str]) -> "LoadedContrastive":
        return replace(self, labels=list(labels))

    def _device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def text_vectors(self, texts: Sequence[str], normalize: bool = True, batch_size: int = 64) -> Tensor:
        """(N, P) projected text vectors."""
        out = []
        for start in range(0, len(texts), batch_size):
            ids, mask = encode_captions(self.tokenizer, texts[start:start + batch_size], self.model.config.context)
            out.append(self.model.text_features(ids.to(self._device()), mask.to(self._device())).float().cpu())
        v = torch.cat(out)
        return F.normalize(v, dim=-1) if normalize else v

    @torch.no_grad()
    def image_vectors(self, images: Sequence, normalize: bool = True, batch_size: int = 64) -> Tensor:
        """(N, P) projected image vectors for paths, PIL images or uint8 arrays."""
        v = torch.cat([self.model.image_features(self.processor(images[s:s + batch_size]).to(self._device()))
                       .float().cpu() for s in range(0, len(images), batch_size)])
        return F.normalize(v, dim=-1) if normalize else v

    @torch.no_grad()
    def probabilities(self, images: Sequence, batch_size: int = 64) -> Tensor:
        """(N, L) zero-shot probabilities over ``labels``, row i for images[i]."""
        if not self.labels:
            raise ValueError(f"{self.path}: the run has no class names; give the candidates with --labels")
        texts = self.text_vectors([self.template.format(label) for label in self.labels])
        scale = float(self.model.logit_scale.exp())
        return torch.softmax(scale * self.image_vectors(images, batch_size=batch_size) @ texts.t(), -1)


def load_pretrained_contrastive(path: str | Path, device: str | None = None) -> LoadedContrastive:
    """A Hugging Face directory of a contrastive image-text model (``CLIPModel.save_pretrained`` with
    its processor's ``save_pretrained``) for embedding images and texts as transformers'
    ``get_image_features`` / ``get_text_features`` do. The image processor is preprocessor_config.json,
    or the ``image_processor`` section of processor_config.json (where transformers 5 writes a
    processor's parts); the tokenizer is tokenizer.json, and without one ``tokenizer`` is None
    (images only)."""
    from ..hub import from_pretrained
    from ..processors import IMAGE_CONFIG, ImageProcessor, load_processor
    from .run import _read_json, resolve_device
    combined = Path(path, "processor_config.json")
    if Path(path, IMAGE_CONFIG).is_file():
        processor = load_processor(path, "image")
    elif combined.is_file() and "image_processor" in _read_json(combined):
        processor = ImageProcessor.from_dict(_read_json(combined)["image_processor"], str(combined))
    else:
        raise RunError(f"{path}: no {IMAGE_CONFIG} (nor an image processor in processor_config.json); save the "
                       "model's processor beside it (CLIPProcessor.save_pretrained)")
    model = from_pretrained(path).to(resolve_device(device)).eval()
    tokenizer = load_processor(path, "text") if Path(path, "tokenizer.json").is_file() else None
    return LoadedContrastive(model, processor, tokenizer, [], "{}", Path(path))


class ImagesWithText(TaskDefinition):
    """What the tasks on images and texts share: the family of the task's kind, the sizes and the
    schedule of the digits or of a folder (:data:`_SIZES`), the best checkpoint by accuracy."""

    def check(self, s: Settings) -> None:
        self.check_family_of_kind(s)
        super().check(s)
        if s.data is None and s.valid is not None:
            raise ValueError("--valid: give the training images too (--data DIR); the digits have their own split")
        for name in ("image_size", "patch_size", "augment"):
            if s[name] is None:
                s[name] = _SIZES[data_source(s)][name]
        if s.image_size % s.patch_size:
            raise ValueError(f"--image-size {s.image_size} is not a multiple of --patch-size {s.patch_size}")

    def _schedule(self, s: Settings, n_images: int) -> dict:
        kind = data_source(s)
        steps = _SIZES[kind]["steps"] or max(100, min(5000, 10 * -(-n_images // s.batch_size)))
        return training_schedule(s, dict(steps=steps, lr=_SIZES[kind]["lr"]),
                                 lambda steps, budget: 50 if budget else max(1, steps // 10),
                                 lambda steps, budget: max(steps // 5, 20), 4)

    def train_config(self, s: Settings, setup: Setup) -> dict:
        return dict(setup.schedule, betas=(0.9, 0.98), best_metric="accuracy", best_mode="max")

    def _setup(self, s: Settings, task, n_train: int, data: str, model: str = "", extra: dict | None = None) -> Setup:
        """The Setup of a task on images and texts: its schedule computed once for ``n_train`` images
        (the lr it chose written into ``s``), and the lines printed before training: ``data``, the
        model with its size (``model``: what follows), the schedule."""
        t = self._schedule(s, n_train)
        s.lr = t["lr"]
        n = sum(p.numel() for p in task.model.parameters()) / 1e6
        lines = [f"data: {data}", f"model: {type(task.model).__name__} ({s.model}), {n:.2f}M parameters{model}",
                 describe_training(s, t)]
        return Setup(task, lines, dict(extra or {}), schedule=t)

    def _held_out(self, run_dir: Path, setup: Setup):
        """(the trained run loaded for inference, the held-out test (images, indices)), or None when
        the data has no test split: what a report scores."""
        from .run import open_run
        test = setup.extra.get("test")
        if test is None or not len(test[1]):
            return None
        return self.load(open_run(run_dir)), test


class ContrastiveTraining(ImagesWithText):
    name = "clip"
    kind = KIND
    help = ("a contrastive image-text model (any registered family of kind contrastive) on the embedded digits or "
            "a folder of images with captions")
    example = ('attnlab train clip                                      # the digits, "a photo of a 3"\n'
               "  attnlab train clip --data photos/ --time-budget 10\n"
               "  attnlab classify runs/clip --labels \"0,1,2,3,4,5,6,7,8,9\" digit.png")
    options = [
        Option("model", str, None, "a registered family of kind contrastive (default: its default family)",
               group=_M),
        Option("image_size", int, None, "images resized to this many pixels square (default: 8 for the digits, "
               "32 for a folder)", check=positive, group=_M),
        Option("patch_size", int, None, "pixels per patch side (default: 2 for the digits, 4 for a folder)",
               check=positive, group=_M),
        Option("d_model", int, 64, "width of both towers", check=positive, group=_M),
        Option("heads", int, 4, "attention heads", check=positive, group=_M),
        Option("layers", int, 2, "layers of each tower", check=positive, group=_M),
        Option("d_ff", int, None, "feed-forward width (default: the family's)", check=positive, group=_M),
        Option("context", int, 32, "the longest caption in tokens, the end token included", check=positive,
               group=_M),
        Option("vocab_size", int, 1000, "at most this many caption pieces (byte-pair encoding)",
               check=lambda v: None if v > 4 else "must exceed the 4 special tokens", group=_M),
        Option("template", str, "a photo of a {}", "a class folder's caption, {} standing for its name (also what "
               "zero-shot classification puts each label into)",
               check=lambda v: None if v.count("{}") == 1 else "must hold {} once", group=_D),
        Option("captions", str, None, "a file of IMAGE<TAB>caption lines (IMAGE relative to --data) instead of "
               "the class folders' captions", metavar="FILE", group=_D),
        Option("batch_size", int, 64, "images per micro-batch", check=positive, group=_D),
        Option("augment", str, None, "augmentation of the training images (default: affine for the digits, "
               "crop-flip for a folder)", choices=AUGMENTATIONS, group=_D),
    ]
    data_paths = ("directory",)
    data_help = "an image folder: one sub-folder of images per class (or any images, with --captions)"

    def check(self, s: Settings) -> None:
        if s.data is None and s.captions is not None:
            raise ValueError("--captions: give the images too (--data DIR)")
        super().check(s)

    # ------------------------------------------------------------------ data
    def _examples(self, s: Settings) -> dict:
        """{"train"/"valid"/"test": (images: paths or arrays, captions), "labels": class names, "root"}."""
        template = s.template
        if data_source(s) == "digits":
            from ..data.digits import DIGIT_LABELS, digits_split
            split = digits_split()
            sets = {k: (_arrays(x.expand(-1, 3, -1, -1)), [template.format(DIGIT_LABELS[i]) for i in y.tolist()])
                    for k, (x, y) in split.items()}
            return dict(sets, labels=list(DIGIT_LABELS), root="the embedded 8x8 handwritten digits")
        if s.captions is not None:
            paths, captions = _read_captions(s.captions, s.data)
            order = list(range(len(paths)))
            random.Random(s.seed).shuffle(order)
            held = set(order[:max(1, len(paths) // 10)])
            pick = lambda keep: ([p for i, p in enumerate(paths) if (i in held) != keep],    # noqa: E731
                                 [c for i, c in enumerate(captions) if (i in held) != keep])
            return dict(train=pick(True), valid=pick(False), labels=[], root=s.captions)
        from .image import IMAGE
        train, valid, test = IMAGE._folders(s)
        caption = lambda f: (f.paths, [template.format(y) for y in f.labels])           # noqa: E731
        out = dict(train=caption(train), valid=caption(valid), labels=train.classes, root=str(train.root))
        if test is not None:
            out["test"] = caption(test)
        return out

    def prepare(self, s: Settings, resume_from: Path | None) -> Setup:
        self.check_once(s)
        saved = None if resume_from is None else resume_point(resume_from, self.name)
        examples = self._examples(s)
        if saved is not None:            # the run's own tokenizer, processor and model (pitfall: a rebuilt vocabulary)
            processors = load_processors(saved)
            processor, tokenizer = processors["image"], processors["text"]
            model = build_model(saved.model_type, saved.config, saved.architecture)
        else:
            resample = "box" if data_source(s) == "digits" else "bilinear"
            processor = ImageProcessor(size=s.image_size, resample=resample)
            tokenizer = caption_tokenizer(examples["train"][1], s.vocab_size)
            model = None
        captions = sorted(set(c for k in ("train", "valid", "test") if k in examples for c in examples[k][1]))
        index = {c: i for i, c in enumerate(captions)}
        sets = {k: (_bytes(examples[k][0], processor), torch.tensor([index[c] for c in examples[k][1]]))
                for k in ("train", "valid", "test") if k in examples}
        longest = max(len(tokenizer.encode(c)) for c in captions)
        if longest > s.context:
            raise ValueError(f"--context {s.context}: the longest caption has {longest} tokens; give at least that")
        if model is None:
            from ..models.registry import family
            fam = family(s.model)
            config = fam.build_config(image_size=s.image_size, patch_size=s.patch_size, in_channels=3,
                                      vocab_size=tokenizer.vocab_size, context=s.context, d_model=s.d_model,
                                      num_heads=s.heads, num_layers=s.layers, d_ff=s.d_ff,
                                      **self.family_sizes(s, tokenizer))
            torch.manual_seed(s.seed)
            model = fam.for_kind(KIND).build(config)
        options = {"labels": examples["labels"], "template": s.template}
        task = ContrastiveTask(model, processor, tokenizer, captions, sets["train"], sets["valid"],
                               batch_size=s.batch_size, augmentation=s.augment, task_options=options)
        return self._setup(s, task, len(sets["train"][1]),
                           f"{examples['root']}: {len(sets['train'][1]):,} training images, {len(sets['valid'][1]):,} "
                           f"validation, {len(captions):,} distinct captions (e.g. {captions[0]!r})",
                           f"; images {s.image_size}x{s.image_size} in patches of {s.patch_size}, captions of at "
                           f"most {s.context} tokens (vocabulary {tokenizer.vocab_size})", {"test": sets.get("test")})

    def report(self, run_dir: Path, setup: Setup, s: Settings) -> None:
        held_out = self._held_out(run_dir, setup)
        if held_out is None:
            return
        (clf, test), task = held_out, setup.task
        if not clf.labels:
            return
        pred = clf.probabilities(_arrays(test[0])).argmax(-1)
        gold = torch.tensor([clf.labels.index(self._label(task.captions[c], clf.template)) for c in test[1].tolist()])
        acc = 100.0 * float((pred == gold).float().mean())
        print(f"held-out test images, zero-shot over {len(clf.labels)} labels ({clf.template!r}): {acc:.1f} % of "
              f"{len(gold)}")

    @staticmethod
    def _label(caption: str, template: str) -> str:
        head, tail = template.split("{}")
        return caption[len(head):len(caption) - len(tail)]

    def load(self, run: RunInfo, device: str | None = None, dtype: str = "fp32") -> LoadedContrastive:
        from ..nn.linear import prepare_for_inference
        from .run import resolve_device
        processors = load_processors(run, {"image": "image processor", "text": "tokenizer"})
        model, _ = prepare_for_inference(load_model(run).to(resolve_device(device)).eval(), dtype)
        return LoadedContrastive(model, processors["image"], processors["text"], list(run.task_options["labels"]),
                                 run.task_options["template"], run.path)


CONTRASTIVE = register_task(ContrastiveTraining())
