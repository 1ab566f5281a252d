"""Helpers of the encoder parity tests (BERT, ELECTRA, ALBERT, DeBERTa): a random
transformers model saved and loaded through attnlab, right-padded batches, comparisons over the
real tokens only, the padded-equals-alone check (padding must not change a real token) and the
input errors every encoder reports."""
from __future__ import annotations

import pytest
import torch

import attnlab
import contract
from _tolerance import FP32, assert_close_scaled


def hf_pair(hf_cls, hf_config, tmp_path, seed: int = 0):
    """(transformers model with O(1) random weights, the attnlab model loaded from its
    save_pretrained directory), both in eval mode."""
    torch.manual_seed(seed)
    hf = hf_cls(hf_config)
    contract.randomize_(hf, seed)
    hf.eval().save_pretrained(tmp_path)
    return hf, attnlab.from_pretrained(tmp_path)


def padded_batch(vocab_size: int, lengths: list[int], seed: int = 0, types: int = 0):
    """(ids (B, L), mask (B, L) True for real tokens, token types or None): right padding, with
    junk ids in the padding so that a leak shows; token types 0 then 1 from the middle of each row."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(0, vocab_size, (len(lengths), L), generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
    token_types = None
    if types > 1:
        token_types = (torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None] // 2).long() * mask
    return ids, mask, token_types


def padded_two_segment_batch(vocab_size: int, B: int = 3, T: int = 12, seed: int = 1):
    """:func:`padded_batch` with rows of T, 7 and 3 real tokens and two segments, plus type 2 on
    the first row's last two tokens (for models with three token types)."""
    ids, mask, types = padded_batch(vocab_size, [T, 7, 3][:B], seed, types=2)
    types[0, -2:] = 2
    return ids, mask, types


def close_on_real(got, want, mask, what: str, rtol: float = FP32) -> None:
    """Compare (B, T, ...) outputs at the real tokens only (padding rows are free to differ)."""
    assert_close_scaled(got[mask], want[mask], rtol, what)


def compare(got, want, mask, what: str) -> None:
    """Per-token outputs (B, T, ...) at the real tokens, per-sequence ones (B, C) whole."""
    if got.dim() >= 3:
        close_on_real(got, want, mask, what)
    else:
        assert_close_scaled(got, want, FP32, what)


def check_in_transformers(model, tmp_path, lengths: list[int], types: int = 0) -> None:
    """``model`` (weights randomised to O(1)) -> attnlab.save_pretrained -> transformers' class of
    the same name: no missing, unexpected or mismatched key, and every output equal on a
    right-padded batch."""
    import transformers
    contract.randomize_(model)
    model.eval()
    attnlab.save_pretrained(model, tmp_path)
    hf, info = getattr(transformers, type(model).__name__).from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), f"transformers reports {info}"
    ids, mask, token_types = padded_batch(model.config.vocab_size, lengths, types=types)
    with torch.no_grad():
        got = contract.outputs(model(ids, mask, token_types))
        out = hf.eval()(input_ids=ids, attention_mask=mask.long(), token_type_ids=token_types)
    want = [out[k] for k in ("last_hidden_state", "prediction_logits", "sop_logits", "logits") if k in out]
    for g, w in zip(got, want, strict=True):
        compare(g, w, mask, f"{type(model).__name__} in transformers")


def check_padding_invariance(model, vocab_size: int, lengths: list[int], what: str, types: int = 0) -> None:
    """Each row of a right-padded batch equals that row alone, unpadded, at its real tokens.
    Works on per-token outputs (B, T, ...) or (B, T) and per-sequence ones (B, C)."""
    ids, mask, token_types = padded_batch(vocab_size, lengths, seed=3, types=types)
    with torch.no_grad():
        batch = contract.outputs(model(ids, mask, token_types))
        for b, n in enumerate(lengths):
            types_alone = None if token_types is None else token_types[b:b + 1, :n]
            alone = contract.outputs(model(ids[b:b + 1, :n], None, types_alone))
            for got, want in zip(batch, alone, strict=True):
                got = got[b, :want.size(1)] if got.dim() >= 2 else got[b]      # per-token: the first n
                assert_close_scaled(got, want[0], FP32, f"{what}: row {b} padded vs alone")


def check_input_errors(model) -> None:
    """One clear ValueError each for ids out of range, a sequence longer than the positions, a
    mask of the wrong shape and float ids."""
    V, P = model.config.vocab_size, model.config.max_position_embeddings
    ids = torch.randint(0, V, (2, 5))
    with pytest.raises(ValueError, match=rf"input_ids holds {V}, outside \[0, vocab_size={V}\)"):
        model(torch.full((2, 5), V))
    with pytest.raises(ValueError, match=r"input_ids holds -1, outside"):
        model(torch.full((2, 5), -1))
    with pytest.raises(ValueError, match=rf"a sequence of {P + 1} tokens is longer than max_position_embeddings={P}"):
        model(torch.zeros(1, P + 1, dtype=torch.long))
    for shape in ((2, 4), (5, 2)):
        with pytest.raises(ValueError, match=r"attention_mask must be \(batch, seq\) = \(2, 5\)"):
            model(ids, torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"input_ids must be a non-empty integer"):
        model(torch.rand(2, 5))
