"""Masked-language-model inputs and sentence pairs: the data side of BERT-style pre-training.

Masking (Devlin et al. 2019, section 3.1, "Task #1"). Each real token that is not a special
token ([CLS], [SEP], [PAD], ...) is *selected* with probability 15 %. A selected token is
the one the model must predict (its label is the original id; every other label is
:data:`IGNORE_INDEX`, which the loss skips), and its input is replaced:

    80 % of the selected  -> [MASK]
    10 %                  -> a random token (never a special one)
    10 %                  -> left as it is

so that the model cannot learn that only [MASK] positions matter. Selection is one Bernoulli
draw per token (as the reference data collators do), so a short sentence may have none; the
masks are drawn afresh for every batch ("dynamic masking", RoBERTa) from a generator the
caller seeds, which keeps a resumed run identical to an uninterrupted one.

Sentence pairs. BERT learns next-sentence prediction (NSP): given (A, B), is B the sentence
that follows A in its document (label 0) or a random sentence from another document
(label 1)? Half of the pairs are each. ALBERT replaces it by sentence-order prediction (SOP,
Lan et al. 2020, section 3.2): (A, B) are always consecutive, in order (label 0) or swapped
(label 1), so topic alone does not give the answer. The labels follow transformers'
``next_sentence_label`` and ``sentence_order_label``.

A pair is packed as ``[CLS] A [SEP] B [SEP]`` with token types 0 for [CLS] A [SEP] and 1 for
B [SEP]; the longer side is trimmed first when the pair is too long.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "mask_tokens", "SentencePair", "sentence_pairs", "pack_pair", "collate_pairs"]

IGNORE_INDEX = -100          # the label of a position the loss skips (torch's cross_entropy default)


def mask_tokens(input_ids: Tensor, *, mask_id: int, vocab_size: int, special_ids: Sequence[int] = (),
                padding_mask: Tensor | None = None, probability: float = 0.15,
                generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """(inputs, labels) for masked-LM training from ``input_ids`` (B, T), by the 80/10/10 rule above.

    ``padding_mask`` (B, T) bool, True for real tokens (padding is never selected);
    ``special_ids``: ids never selected and never drawn as random replacements ([MASK] is
    always treated as special). ``labels`` hold the original id where a token was selected,
    :data:`IGNORE_INDEX` elsewhere. The input tensor is not modified.
    """
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"mask_tokens: input_ids must be a (batch, seq) long tensor, got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}")
    if not 0.0 <= probability <= 1.0:
        raise ValueError(f"mask_tokens: probability must be in [0, 1], got {probability}")
    if not 0 <= mask_id < vocab_size:
        raise ValueError(f"mask_tokens: mask_id {mask_id} is outside the vocabulary (size {vocab_size})")
    if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= vocab_size):
        raise ValueError(f"mask_tokens: ids must be in [0, {vocab_size}), got [{int(input_ids.min())}, "
                         f"{int(input_ids.max())}]")
    if padding_mask is not None and padding_mask.shape != input_ids.shape:
        raise ValueError(f"mask_tokens: padding_mask shape {tuple(padding_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    specials = torch.tensor(sorted(set(special_ids) | {mask_id}), dtype=torch.long)
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[specials[(specials >= 0) & (specials < vocab_size)]] = False
    replacements = ordinary.nonzero().squeeze(1)              # the ids a random replacement is drawn from
    if replacements.numel() == 0:
        raise ValueError("mask_tokens: every id of the vocabulary is special; nothing to draw replacements from")

    eligible = ordinary[input_ids]
    if padding_mask is not None:
        eligible &= padding_mask.bool()
    shape, dev = input_ids.shape, input_ids.device
    draw = torch.rand(shape, generator=generator)
    selected = (draw < probability).to(dev) & eligible
    how = torch.rand(shape, generator=generator).to(dev)        # which of the three treatments
    random_ids = replacements[torch.randint(len(replacements), shape, generator=generator)].to(dev)

    inputs = input_ids.clone()
    inputs[selected & (how < 0.8)] = mask_id
    swap = selected & (how >= 0.8) & (how < 0.9)
    inputs[swap] = random_ids[swap]
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return inputs, labels


@dataclass(frozen=True)
class SentencePair:
    """Two token-id sentences and the pair's label (NSP: 0 = B follows A, 1 = B is random;
    SOP: 0 = in order, 1 = swapped)."""
    a: list[int]
    b: list[int]
    label: int


def sentence_pairs(documents: Sequence[Sequence[Sequence[int]]], objective: str,
                   rng: random.Random) -> list[SentencePair]:
    """Pairs of sentences for ``objective`` "nsp" or "sop" (see the module docstring), half of
    each label (each pair's label is a fair coin). ``documents``: lists of sentences (token ids);
    every two consecutive sentences of a document give one pair. NSP draws the random sentence
    from another document, so it needs at least two documents with sentences."""
    if objective not in ("nsp", "sop"):
        raise ValueError(f"sentence_pairs: objective must be 'nsp' or 'sop', got {objective!r}")
    nonempty = [i for i, d in enumerate(documents) if len(d) > 0]
    if objective == "nsp" and len(nonempty) < 2:
        raise ValueError("sentence_pairs: next-sentence prediction needs at least two documents with sentences")
    pairs = []
    for i, doc in enumerate(documents):
        for a, b in zip(doc, doc[1:]):
            label = rng.random() < 0.5
            if objective == "sop":
                pairs.append(SentencePair(list(b), list(a), 1) if label else SentencePair(list(a), list(b), 0))
                continue
            if label:
                other = i
                while other == i:
                    other = rng.choice(nonempty)
                b = rng.choice(documents[other])
            pairs.append(SentencePair(list(a), list(b), int(label)))
    return pairs


def pack_pair(a: Sequence[int], b: Sequence[int] | None, *, cls_id: int, sep_id: int,
              max_len: int) -> tuple[list[int], list[int]]:
    """``[CLS] a [SEP] b [SEP]`` (or ``[CLS] a [SEP]`` without b) and its token types, at most
    ``max_len`` ids: the longer sentence loses its last token until the pair fits."""
    specials = 2 if b is None else 3
    if max_len < specials + (1 if b is None else 2):
        raise ValueError(f"pack_pair: max_len {max_len} leaves no room for the sentences")
    a, b = list(a), None if b is None else list(b)
    while len(a) + (len(b) if b is not None else 0) + specials > max_len:
        if b is not None and len(b) > len(a):
            b.pop()
        else:
            a.pop()
    ids = [cls_id, *a, sep_id]
    types = [0] * len(ids)
    if b is not None:
        ids += [*b, sep_id]
        types += [1] * (len(b) + 1)
    return ids, types


def collate_pairs(packed: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, Tensor]:
    """Right-pad packed (ids, token types) into ``input_ids``, ``token_type_ids`` (B, T) long
    and ``attention_mask`` (B, T) bool (True = real token)."""
    if not packed:
        raise ValueError("collate_pairs: empty batch")
    T = max(len(ids) for ids, _ in packed)
    input_ids = torch.full((len(packed), T), pad_id, dtype=torch.long)
    token_types = torch.zeros((len(packed), T), dtype=torch.long)
    for row, (ids, types) in enumerate(packed):
        input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        token_types[row, :len(types)] = torch.tensor(types, dtype=torch.long)
    lengths = torch.tensor([len(ids) for ids, _ in packed])
    attention_mask = torch.arange(T)[None, :] < lengths[:, None]
    return {"input_ids": input_ids, "token_type_ids": token_types, "attention_mask": attention_mask}
