"""Inputs for the encoder parity tests (BERT, ELECTRA): a right-padded batch with two segments."""
import torch


def padded_two_segment_batch(vocab_size: int, B: int = 3, T: int = 12, seed: int = 1):
    """(ids (B, T), mask (B, T) bool, token types (B, T)): rows of T, 7 and 3 real tokens, pad id 0,
    segment B (type 1) from the middle of each row, and type 2 on the first row's last two tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab_size, (B, T), generator=g)
    lengths = torch.tensor([T, 7, 3])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, 0)
    types = (torch.arange(T)[None, :] >= (lengths[:, None] // 2)).long() * mask
    types[0, -2:] = 2
    return ids, mask, types
