"""Training objectives, owned by the models: a task asks a model for its loss on a batch and
names no family.

    out = training_loss(model, batch, forward=wrapped)   # an Objective
    out.loss / out.count                                 # the mean the Trainer reports

A kind states its objective when it is registered (:func:`attnlab.models.registry.register_kind`,
``objective=``); a model class refines it by defining ``loss(batch, forward=None) -> Objective``
(DeiT learns from a teacher's logits as well as the labels, MAE reconstructs its masked patches).
``forward`` is what runs the model: the model itself, or a DistributedDataParallel or compiled
wrapper of it, so that gradients are synchronised as the Trainer set them up; the objective reads
the model's config and helpers from the model, and runs it only through ``forward``.

``loss`` is a SUM over ``count`` items (images, masked tokens, active tokens), so a Trainer that
accumulates micro-batches divides once by the total count; ``metrics`` are sums the task reports
(correct predictions).

The objectives here are those every family of a kind shares: classification's cross-entropy,
masked-LM's (plus next-sentence or sentence-order prediction), ELECTRA's replaced-token detection.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Objective", "IGNORE_INDEX", "classification", "masked_lm", "replaced_token"]

IGNORE_INDEX = -100          # a label that is no target (transformers' convention)


@dataclass
class Objective:
    """A batch's training loss: ``loss`` summed over ``count`` items, and ``metrics`` (sums)."""
    loss: Tensor
    count: int
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _main_input(batch: dict) -> tuple[str, Tensor]:
    key = "pixel_values" if "pixel_values" in batch else "input_ids"
    return key, batch[key]


def classification(model: nn.Module, batch: dict, forward: Callable | None = None) -> Objective:
    """Cross-entropy of the class logits against ``batch["labels"]`` (B,), summed over the batch
    (``batch["label_smoothing"]``, default 0); metric ``correct``. The batch holds the model's main
    input (``pixel_values`` or ``input_ids``) and, for text, its ``attention_mask``."""
    forward = forward or model
    key, x = _main_input(batch)
    extra = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
    logits = forward(x, **extra).float()
    y = batch["labels"]
    loss = F.cross_entropy(logits, y, reduction="sum", label_smoothing=float(batch.get("label_smoothing", 0.0)))
    with torch.no_grad():
        correct = (logits.argmax(-1) == y).sum()
    return Objective(loss, int(y.numel()), {"correct": correct})


def masked_lm(model: nn.Module, batch: dict, forward: Callable | None = None) -> Objective:
    """Masked-LM cross-entropy summed over the masked tokens (``labels`` not IGNORE_INDEX), plus,
    for a model with a sentence head (kind "pretraining"), the mean sentence-pair cross-entropy
    against ``sentence_label`` times the masked tokens: divided by ``count`` (the masked tokens) it
    is the sum of the two means, transformers' ``BertForPreTraining`` loss. The head scores the
    masked positions alone (``masked_positions``), sparing the vocabulary-wide product elsewhere.
    Metrics: ``mlm_loss`` (the sum), ``mlm_correct`` and, with a sentence head, ``pair_loss`` (the
    mean) and ``pair_correct``."""
    forward = forward or model
    labels = batch["labels"]
    picked = labels != IGNORE_INDEX
    out = forward(batch["input_ids"], attention_mask=batch.get("attention_mask"),
                  token_type_ids=batch.get("token_type_ids"), masked_positions=picked)
    token_logits, sentence_logits = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
    n = int(picked.sum())
    logits = token_logits.float()
    mlm = F.cross_entropy(logits, labels[picked], reduction="sum")
    metrics = {"mlm_loss": mlm.detach(), "mlm_correct": (logits.argmax(-1) == labels[picked]).sum().float()}
    if sentence_logits is None:
        return Objective(mlm, n, metrics)
    pair = F.cross_entropy(sentence_logits.float(), batch["sentence_label"])
    metrics.update(pair_loss=pair.detach(),
                   pair_correct=(sentence_logits.argmax(-1) == batch["sentence_label"]).sum().float())
    return Objective(mlm + pair * max(n, 1), n, metrics)


def replaced_token(model: nn.Module, batch: dict, forward: Callable | None = None) -> Objective:
    """ELECTRA's discriminator loss: binary cross-entropy of the (B, T) replaced-token logits
    against ``labels`` (1 where the generator replaced the token), summed over the real tokens
    (``attention_mask`` 1; every token without one): divided by ``count`` it is transformers'
    ``ElectraForPreTraining`` loss. Metric ``correct``: tokens whose replaced-or-not is right."""
    forward = forward or model
    mask = batch.get("attention_mask")
    logits = forward(batch["input_ids"], attention_mask=mask).float()
    labels = batch["labels"].float()
    active = torch.ones_like(labels, dtype=torch.bool) if mask is None else mask.bool()
    loss = F.binary_cross_entropy_with_logits(logits[active], labels[active], reduction="sum")
    with torch.no_grad():
        correct = ((logits[active] > 0).float() == labels[active]).sum()
    return Objective(loss, int(active.sum()), {"correct": correct})
