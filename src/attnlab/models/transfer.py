"""Encoder transfer by kind: the pre-trained encoder of one model starts another of a target kind
(a classifier with a new head), whatever the family, through one interface::

    fam = transfer_family(source_arch, "image-classifier")     # whose classifier takes the encoder
    model = transfer_encoder(source, fam, kind="image-classifier", labels=[...], seed=0)

A model's **encoder** is its checkpoint's tensors that its family's base rules name (transformers'
names relative to the base): everything under its architecture's prefix that no head rule makes.
So a classifier, a bare encoder and a pre-training model with a decoder (MAE) give the same
encoder, and it fits a target whose base has the same names with the same shapes. A family whose
encoder is another family's (MAE pre-trains a ViT) says so on its model classes:
``transfers_to = "vit"``; every other model transfers to its own family.

The target's config is the source's, field by field where the target's config class has the
field, except the head's (``num_labels``, ``id2label``), then the caller's ``overrides`` (the
labels; the fine-tuning run's own dropout). A part outside the encoder that the source also holds
under the same name and shape (BERT's pooler) comes along; the rest of the head is new.

Text and images go through it alike: ``attnlab train image --init`` (ViT, DeiT, Swin, MAE's
encoder) and ``attnlab train classify --init DIR --head native`` (the BERT family's encoders into
their own sequence classifier).
"""
from __future__ import annotations

from dataclasses import fields

import torch
from torch import Tensor, nn

from . import convert
from .pretrained import from_hf_state_dict, to_hf_state_dict
from .registry import Architecture, Family, architecture_of, family

__all__ = ["TransferError", "transfer_family", "encoder_tensors", "transfer_config", "transfer_encoder"]

_HEAD_FIELDS = ("num_labels", "id2label")


class TransferError(ValueError):
    """The source's encoder does not fit the target (the message says why, in one line)."""


def transfer_family(arch: Architecture, kind: str) -> Family:
    """The family of the ``kind`` model that ``arch``'s encoder starts: its classes' ``transfers_to``,
    else its own; TransferError if that family has no ``kind`` architecture."""
    fam = family(getattr(arch.model_cls, "transfers_to", None) or arch.model_type)
    if kind not in fam.kinds():
        raise TransferError(f"a {arch.name} encoder starts a {fam.model_type} model, which has no {kind} "
                            f"architecture")
    return fam


def _head_keys(model: nn.Module, arch: Architecture) -> set[str]:
    if not arch.head_rules:
        return set()
    own, _ = convert.own_tensors(model)
    return set(convert.convert(own, list(arch.head_rules), model.config, True)[0])


def encoder_tensors(model: nn.Module) -> dict[str, Tensor]:
    """``model``'s encoder: its checkpoint tensors by the base's names (prefix removed), without the
    head's (a classifier's, a bare encoder's pooler, MAE's decoder)."""
    arch = architecture_of(model)
    heads = _head_keys(model, arch)
    return {k[len(arch.prefix):]: v for k, v in to_hf_state_dict(model).items()
            if k.startswith(arch.prefix) and k not in heads}


def transfer_config(source_config, target: Family, overrides: dict):
    """The target family's config: the source's fields it has (not the head's), then those of
    ``overrides`` it has (the head's labels, the run's dropout)."""
    names = {f.name for f in fields(target.config_cls)}
    shared = {n: getattr(source_config, n) for n in names if hasattr(source_config, n) and n not in _HEAD_FIELDS}
    return target.config_cls(**{**shared, **{k: v for k, v in overrides.items() if k in names}})


def transfer_encoder(source: nn.Module, target: Family, *, kind: str, overrides: dict, seed: int = 0) -> nn.Module:
    """A new ``kind`` model of ``target`` (seeded by ``seed``) whose encoder holds ``source``'s and
    whose head is new; TransferError naming what has no place or is not supplied, or a shape that
    differs."""
    arch = target.for_kind(kind)
    torch.manual_seed(seed)
    model = arch.build(transfer_config(source.config, target, overrides))
    given = encoder_tensors(source)
    fresh = to_hf_state_dict(model)
    heads = _head_keys(model, arch)
    wanted = {k[len(arch.prefix):] for k in fresh if k.startswith(arch.prefix) and k not in heads}
    unplaced, lacking = sorted(set(given) - wanted), sorted(wanted - set(given))
    if unplaced or lacking:
        raise TransferError(f"its encoder does not fit a {arch.name} (no place for {unplaced[:3]}, not supplied "
                            f"{lacking[:3]})")
    bad = [k for k in wanted if fresh[arch.prefix + k].shape != given[k].shape]
    if bad:
        raise TransferError(f"its encoder does not fit a {arch.name}: {bad[0]} is {tuple(given[bad[0]].shape)}, "
                            f"the model's {tuple(fresh[arch.prefix + bad[0]].shape)}")
    # a part the target keeps outside its encoder under the source's names (BERT's pooler, which
    # BertForSequenceClassification trains and BertModel keeps) comes along, as transformers loads it
    source_arch = architecture_of(source)
    kept = {k[len(source_arch.prefix):]: v for k, v in to_hf_state_dict(source).items()
            if k.startswith(source_arch.prefix)}
    also = {k: kept[k[len(arch.prefix):]] for k in heads if k.startswith(arch.prefix)
            and kept.get(k[len(arch.prefix):]) is not None and kept[k[len(arch.prefix):]].shape == fresh[k].shape}
    model.load_state_dict(from_hf_state_dict(model, {**fresh, **{arch.prefix + k: v for k, v in given.items()},
                                                     **also}))
    return model
