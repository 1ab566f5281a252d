"""A pretrained model's base, and its family's own classifier around it, for every task.

``attnlab train classify --init DIR`` and ``attnlab embed DIR`` start from a checkpoint someone
else trained: a Hugging Face directory (config.json and weights) or an attnlab run. What they need
from it is the same, so it lives here, beside the tasks rather than inside one of them:

- :func:`load_base`: the checkpoint's base model (registered kind "base", such as BertModel: a
  forward that gives token vectors) and its tokenizer, whatever head the checkpoint was saved
  with: a masked LM, a language model, a classifier;
- :func:`native_classifier`: the family's registered sequence classifier (kind "classifier",
  transformers' layout, such as BertForSequenceClassification) holding a loaded base's weights and
  a new head for the given labels.

Both move weights through the registry's declared names: an architecture's weight map and the
``prefix`` under which its checkpoints keep the base's keys ("bert." for the BERT heads), so no
module attribute of one class is assumed to match another's.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Sequence

import torch
from torch import Tensor, nn

from ..tokenizer import Tokenizer
from .run import RunError, inspect_path, load_model, load_processors

__all__ = ["load_base", "native_classifier", "base_from_checkpoint"]

# what a family's classifier configuration must carry for a new head, as transformers' configs do
_LABEL_FIELDS = ("num_labels", "id2label")


def load_base(path: str, flag: str = "--init") -> tuple[nn.Module, Tokenizer]:
    """(a pretrained model of kind "base", its processor: the tokenizer of a text model) from a
    Hugging Face model directory or an attnlab run, each read as the model's modality says
    (:func:`attnlab.processors.load_processor`). A checkpoint with a head (BertForMaskedLM,
    GPT2LMHeadModel) gives its family's base architecture with the weights under the head
    architecture's prefix; a fine-tuned EncoderClassifier gives its encoder. ``flag``: the option that named ``path``, for messages."""
    from ..hub import from_pretrained, load_processor
    from ..models.classifier import EncoderClassifier
    from ..models.pretrained import read_config, read_weights, to_hf_state_dict
    from ..models.registry import architecture_of
    info = inspect_path(path)
    where = f"{flag} {path}: {info.describe()}".lstrip()
    if info.kind == "run":
        model = load_model(info.run)
        processors = load_processors(info.run)
        tok = processors.get("text") or next(iter(processors.values()))
        if isinstance(model, EncoderClassifier):
            return model.encoder, tok
        arch = architecture_of(model)
        if arch.kind == "base":
            return model, tok
        return base_from_checkpoint(arch, model.config, to_hf_state_dict(model) if arch.family.hf else {}, where), tok
    arch, config, _ = read_config(path)
    tok = load_processor(path, arch.family.modality)
    if arch.kind == "base":
        return from_pretrained(path).train(), tok
    return base_from_checkpoint(arch, config, read_weights(path), where), tok


def native_classifier(base: nn.Module, labels: Sequence[str], dropout: float | None = None,
                      seed: int = 0) -> nn.Module:
    """The family's registered classifier around ``base``, by encoder transfer
    (:func:`attnlab.models.transfer.transfer_encoder`, as ``attnlab train image --init`` does): a
    new classifier (seeded by ``seed``) of the family ``base``'s encoder starts, its configuration
    ``base``'s with ``len(labels)`` classes (their names saved as ``id2label``) and ``dropout``
    before the head (None: the configuration's own), its encoder holding every weight of ``base``;
    the head (and a pooler the classifier keeps outside its encoder) is new. A base weight the
    classifier has no place for, or one it lacks, is an error: the two would not be the same encoder."""
    from ..models.registry import architecture_of
    from ..models.transfer import TransferError, transfer_encoder, transfer_family
    arch = architecture_of(base)
    try:
        target = transfer_family(arch, "classifier")
    except TransferError:
        raise RunError(f"--head native: the {arch.model_type} family has no sequence-classification model; "
                       "use --head pooling") from None
    names = {f.name for f in fields(target.config_cls)}
    if not set(_LABEL_FIELDS) <= names:
        raise RunError(f"--head native: {target.for_kind('classifier').name}'s configuration takes no number of "
                       "labels; use --head pooling")
    overrides = {"num_labels": len(labels), "id2label": dict(enumerate(labels))}
    if dropout is not None and "classifier_dropout" in names:
        overrides["classifier_dropout"] = dropout
    try:
        return transfer_encoder(base, target, kind="classifier", overrides=overrides, seed=seed)
    except TransferError as e:
        raise RunError(f"--head native: {arch.name}'s {e}") from None


def base_from_checkpoint(arch, config, checkpoint: dict[str, Tensor], where: str) -> nn.Module:
    """The family's base architecture built from ``config``, with the base's weights from a
    checkpoint of ``arch`` (a model with a head, whose base keys sit under ``arch.prefix``).
    Weights the checkpoint lacks keep their fresh initialisation only if the base declares that
    no output reads them (``unread_weights``: the pooler a masked-LM checkpoint leaves out, as
    transformers allows); any other missing parameter is an error."""
    from ..models.convert import convert, unread_tensors
    from ..models.pretrained import from_hf_state_dict, to_hf_state_dict
    base_arch = next((a for a in arch.family.architectures.values() if a.kind == "base"), None)
    if base_arch is None or not arch.prefix:
        raise RunError(f"{where}, whose family has no base encoder to fine-tune (a registered architecture of "
                       f"kind 'base')")
    base = base_arch.build(config)
    tensors = {k[len(arch.prefix):]: v for k, v in checkpoint.items() if k.startswith(arch.prefix)}
    fill = {k: v for k, v in to_hf_state_dict(base).items() if k not in tensors}
    if fill:                              # what the checkpoint's own tensors give, in our names
        given = set(convert(tensors, base_arch.weight_map, base.config, to_hf=False)[0])
        needed = sorted({name for name, _ in base.named_parameters()} - given - unread_tensors(base))
        if needed:
            raise RunError(f"{where}: the checkpoint lacks weights its encoder uses: {', '.join(needed[:5])}")
    state = from_hf_state_dict(base, {**fill, **tensors}, base_arch.load_rules, base_arch.skip_on_load)
    base.load_state_dict(state, strict=False)
    return base
