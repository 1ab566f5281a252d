"""Length-bucketed batches under a token budget, and padding them into tensors.

A batch is a list of example indices. Its padded size is ``max_len * batch_size`` where an
example's length is the larger of its source length and its target length plus one (the
decoder sees BOS + target and predicts target + EOS; see ``pair_lengths``). ``plan_batches``
keeps that size within ``max_tokens``:

1. shuffle the indices with a generator seeded by (seed, epoch);
2. cut them into pools of ``pool_size`` examples and sort each pool by length, so examples
   of similar length share a batch and little is padding ("bucketing");
3. fill batches greedily from each sorted pool, then shuffle the batch order.

The plan is a pure function of (lengths, max_tokens, seed, epoch): a trainer resuming at
batch i of epoch e recomputes the plan and skips i batches. An example longer than
``max_tokens`` gets a batch of its own (it cannot share one); pass ``max_len`` to reject
such examples with a ValueError instead.
"""
from __future__ import annotations

import random
from typing import Sequence

import torch

Ids = Sequence[int]


def pair_lengths(pairs: Sequence[tuple[Ids, Ids]]) -> list[int]:
    """Padded length each (source ids, target ids) pair needs: max(len(src), len(tgt) + 1)."""
    return [max(len(src), len(tgt) + 1) for src, tgt in pairs]


def plan_batches(lengths: Sequence[int], max_tokens: int, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                 pool_size: int = 8192, max_len: int | None = None,
                 max_examples: int | None = None) -> list[list[int]]:
    """Group example indices into batches whose ``max_len * batch_size`` is <= ``max_tokens``
    and, if ``max_examples`` is given, that hold at most that many examples (a classifier's
    batch of texts: its loss counts examples, not tokens).

    Every index appears in exactly one batch. With ``shuffle=False`` (evaluation) indices
    are bucketed in their given order and batches keep pool order.
    """
    if max_tokens < 1 or pool_size < 1:
        raise ValueError(f"max_tokens and pool_size must be positive, got {max_tokens} and {pool_size}")
    if max_len is not None:
        too_long = [i for i, n in enumerate(lengths) if n > max_len]
        if too_long:
            i = too_long[0]
            raise ValueError(f"{len(too_long)} example(s) longer than max_len={max_len}; "
                             f"the first is example {i} with length {lengths[i]}")
    rng = random.Random(f"plan_batches:{seed}:{epoch}")  # str seeds hash the same in every process
    order = list(range(len(lengths)))
    if shuffle:
        rng.shuffle(order)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool_size):
        pool = sorted(order[start:start + pool_size], key=lambda i: lengths[i])  # stable: ties stay shuffled
        batch: list[int] = []
        longest = 0
        for i in pool:
            # lengths ascend within the pool, so lengths[i] is the new longest
            if batch and (max(longest, lengths[i]) * (len(batch) + 1) > max_tokens or len(batch) == max_examples):
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, lengths[i])
        if batch:
            batches.append(batch)
    if shuffle:
        rng.shuffle(batches)
    return batches


def shard_batches(batches: list[list[int]], rank: int, world_size: int) -> list[list[int]]:
    """The batches of one rank in distributed training: every ``world_size``-th, from ``rank``.

    All ranks must run the same number of steps or collective ops hang, so the plan is first
    truncated to a multiple of ``world_size``: up to ``world_size - 1`` batches are dropped
    each epoch (different ones each epoch, since the plan is reshuffled).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    usable = len(batches) - len(batches) % world_size
    return batches[rank:usable:world_size]


def collate(pairs: Sequence[tuple[Ids, Ids]], indices: Sequence[int], pad_id: int = 0, bos_id: int = 1,
            eos_id: int = 2) -> dict:
    """Pad the pairs at ``indices`` into a batch for teacher forcing.

    Returns ``src`` (B, S) long, ``src_mask`` (B, S) bool, ``tgt_in`` = BOS + target and
    ``tgt_out`` = target + EOS, both (B, T) long, ``tgt_mask`` (B, T) bool (masks are True for
    real tokens), and ``num_tokens``, the number of real target tokens (the loss normaliser).
    The source is used as given, without BOS or EOS.
    """
    if not indices:
        raise ValueError("collate needs at least one index")
    srcs = [list(pairs[i][0]) for i in indices]
    tgts = [list(pairs[i][1]) for i in indices]
    B, S, T = len(indices), max(len(s) for s in srcs), max(len(t) for t in tgts) + 1
    src = torch.full((B, S), pad_id, dtype=torch.long)
    tgt_in = torch.full((B, T), pad_id, dtype=torch.long)
    tgt_out = torch.full((B, T), pad_id, dtype=torch.long)
    src_mask = torch.zeros(B, S, dtype=torch.bool)
    tgt_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (s, t) in enumerate(zip(srcs, tgts)):
        src[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        src_mask[b, :len(s)] = True
        tgt_in[b, :len(t) + 1] = torch.tensor([bos_id] + t, dtype=torch.long)
        tgt_out[b, :len(t) + 1] = torch.tensor(t + [eos_id], dtype=torch.long)
        tgt_mask[b, :len(t) + 1] = True
    return {"src": src, "src_mask": src_mask, "tgt_in": tgt_in, "tgt_out": tgt_out, "tgt_mask": tgt_mask,
            "num_tokens": int(tgt_mask.sum())}
