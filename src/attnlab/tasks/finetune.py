"""Fine-tuning an image classifier from a pre-trained encoder: what ``attnlab train image --init
RUN_OR_HF_DIR`` calls, for any checkpoint whose encoder fits an image classifier (an ``attnlab train
mae`` or image run, a Hugging Face ViTMAE, ViT, DeiT or Swin directory) through one interface,
:mod:`attnlab.models.transfer`. A module of its own, below both tasks: the image task calls it and
the MAE task reads the image task's data, so neither imports the other both ways."""
from __future__ import annotations

from pathlib import Path

from torch import nn

from ..processors import IMAGE_CONFIG, ImageProcessor
from .settings import Settings
from .run import RunError, inspect_path, load_model, load_processors

__all__ = ["fine_tuning_start", "init_family"]

KIND = "image-classifier"
_SIZES = {"d_model": "d_model", "heads": "num_heads", "layers": "num_layers", "d_ff": "d_ff"}


def init_family(path: str, flag: str = "--init") -> str:
    """The family whose image classifier the encoder at ``path`` starts (read from its config
    alone), for ``--model``'s default; RunError in one line where it starts none."""
    from ..models.registry import family
    from ..models.transfer import TransferError, transfer_family
    try:
        info = inspect_path(path)
    except FileNotFoundError:
        raise RunError(f"{flag} {path}: no such run or directory") from None
    if info.kind == "run":
        model_type, name = info.run.model_type, info.run.architecture
    else:
        model_type, name = info.model_type, (info.architectures or (None,))[0]
    try:
        return transfer_family(family(model_type).architecture(name), KIND).model_type
    except (TransferError, ValueError) as e:
        raise RunError(f"{flag} {path}: {info.describe()}: {e}") from None


def _source(path: str) -> tuple[nn.Module, ImageProcessor | None]:
    """(the checkpoint's model, its image processor or None) of a run or a Hugging Face directory."""
    from ..hub import from_pretrained
    info = inspect_path(path)
    if info.kind == "run":
        return load_model(info.run), load_processors(info.run).get("image")
    processor = ImageProcessor.load(path) if (Path(path) / IMAGE_CONFIG).is_file() else None
    return from_pretrained(path), processor


def fine_tuning_start(s: Settings, labels: list[str], build=None, flag: str = "--init") -> tuple[nn.Module, ImageProcessor]:
    """(an image classifier whose encoder holds the weights of the checkpoint ``s[flag]`` names and
    whose head is new, the image processor to train it with) for ``attnlab train image``.

    The classifier is of the family the encoder starts (:func:`attnlab.models.transfer.transfer_family`;
    ``--model`` must name it where given), its config the checkpoint's (the run's dropout, new labels);
    a family option given (``--norm``) must be the encoder's. The encoder's image sizes, and its
    widths where its config has the task's names for them, are written into ``s`` so that the run's
    config.yaml records what was built. ``build`` is unused (the family's own config is copied).
    The processor is the checkpoint's where it has one, else the image task's own default."""
    from ..models.registry import architecture_of, family
    from ..models.transfer import TransferError, transfer_encoder, transfer_family
    path = s[flag.removeprefix("--").replace("-", "_")]
    info = inspect_path(path)
    source, processor = _source(path)
    try:
        target = transfer_family(architecture_of(source), KIND)
    except TransferError as e:
        raise RunError(f"{flag} {path}: {info.describe()}: {e}") from None
    if s.model not in (None, target.model_type):
        raise RunError(f"{flag} {path}: its encoder starts a {target.model_type} classifier, not --model {s.model}")
    s.model = target.model_type
    config = source.config
    for option in target.options_for("image"):
        given, theirs = s[option.name], getattr(config, option.keyword, None)
        if given is not None and theirs is not None and given != theirs:
            raise RunError(f"{flag} {path}: the encoder uses {theirs}, not {option.flag} {given}")
    limits = family(architecture_of(source).model_type).input_limits(config)
    s.update(image_size=limits["image_size"], patch_size=limits["patch_size"], channels=limits["in_channels"])
    # the widths where the config has them as one number (a Swin's heads are one per stage)
    s.update({ours: getattr(config, theirs) for ours, theirs in _SIZES.items()
              if isinstance(getattr(config, theirs, None), int) and not isinstance(getattr(config, theirs), bool)})
    overrides = {"num_labels": len(labels), "id2label": dict(enumerate(labels)), "dropout": s.dropout,
                 "attention_dropout": s.dropout}
    try:
        model = transfer_encoder(source, target, kind=KIND, overrides=overrides, seed=s.seed)
    except TransferError as e:
        raise RunError(f"{flag} {path}: {e}") from None
    if processor is None or processor.channels != limits["in_channels"]:
        grey = [0.5] * limits["in_channels"]
        processor = ImageProcessor(size=limits["image_size"], image_mean=grey, image_std=grey)
    return model, processor
