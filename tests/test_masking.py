"""The masked-LM rule and sentence pairs (attnlab.data.masking), tested statistically.

Counts are compared with their binomial expectation within 5 standard deviations: a correct
rule fails such a check about once in 3.5 million runs, while a rule off by a few percent
points (say 75/15/10 instead of 80/10/10) fails it every time at these sample sizes."""
import math
import random

import pytest
import torch

from attnlab.data.masking import IGNORE_INDEX, collate_pairs, mask_tokens, pack_pair, sentence_pairs
from attnlab.data.numbers import english_documents

V, PAD, CLS, SEP, MASK = 1000, 0, 1, 2, 3
SPECIALS = (PAD, CLS, SEP, MASK)


def within(count: int, n: int, p: float, what: str, sigmas: float = 5.0) -> None:
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    assert abs(count - mean) <= sigmas * sd, f"{what}: {count} of {n}, expected {mean:.0f} +- {sigmas * sd:.0f}"


def _batch(seed=0, B=256, T=128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, V, (B, T), generator=g)
    lengths = torch.randint(8, T + 1, (B,), generator=g)
    real = torch.arange(T)[None] < lengths[:, None]
    ids[:, 0] = CLS
    ids[torch.arange(B), lengths - 1] = SEP
    ids[~real] = PAD
    return ids, real


def test_80_10_10_of_the_selected_15_percent_never_specials_or_padding():
    ids, real = _batch()
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=V, special_ids=SPECIALS, padding_mask=real,
                                 generator=torch.Generator().manual_seed(1))
    selected = labels != IGNORE_INDEX
    eligible = real & (ids > MASK)
    assert not (selected & ~eligible).any(), "a special token or padding was selected"
    assert torch.equal(labels[selected], ids[selected]), "labels must hold the original ids"
    assert torch.equal(inputs[~selected], ids[~selected]), "unselected tokens must stay as they are"
    n_sel = int(selected.sum())
    within(n_sel, int(eligible.sum()), 0.15, "selected")
    masked = int((inputs[selected] == MASK).sum())
    changed = int(((inputs != ids) & (inputs != MASK) & selected).sum())
    within(masked, n_sel, 0.8, "replaced by [MASK]")
    # a random replacement equals the original with probability 1/(ordinary vocabulary): count both
    kept = n_sel - masked - changed
    p_same = 1 / (V - len(SPECIALS))
    within(changed, n_sel, 0.1 * (1 - p_same), "replaced by a random token")
    within(kept, n_sel, 0.1 + 0.1 * p_same, "left as they are")
    replaced = inputs[selected & (inputs != MASK)]
    assert not torch.isin(replaced, torch.tensor(SPECIALS)).any(), "a random replacement was a special token"


def test_random_replacements_cover_the_ordinary_vocabulary_uniformly():
    ids = torch.full((400, 250), 10)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=50, special_ids=SPECIALS, probability=1.0,
                                 generator=torch.Generator().manual_seed(3))
    drawn = inputs[(inputs != MASK) & (inputs != 10)]
    counts = torch.bincount(drawn, minlength=50)
    assert counts[list(SPECIALS)].sum() == 0
    ordinary = [i for i in range(50) if i not in SPECIALS and i != 10]
    for i in ordinary:      # each of the 46 ordinary ids: 1/46 of the random draws that changed the token
        within(int(counts[i]), len(drawn) + int(counts[10]), 1 / 46, f"id {i}")


def test_masking_is_deterministic_for_a_generator_and_fresh_per_draw():
    ids, real = _batch(B=8, T=32)
    kw = dict(mask_id=MASK, vocab_size=V, special_ids=SPECIALS, padding_mask=real)
    a = mask_tokens(ids, generator=torch.Generator().manual_seed(5), **kw)
    b = mask_tokens(ids, generator=torch.Generator().manual_seed(5), **kw)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    g = torch.Generator().manual_seed(5)
    first, second = mask_tokens(ids, generator=g, **kw), mask_tokens(ids, generator=g, **kw)
    assert not torch.equal(first[1], second[1]), "two batches drawn from one generator got the same masks"


@pytest.mark.parametrize("bad, message", [
    (dict(input_ids=torch.tensor([[1, 2]]), mask_id=5, vocab_size=5), "mask_id 5 is outside"),
    (dict(input_ids=torch.tensor([[1, 7]]), mask_id=3, vocab_size=5), r"ids must be in \[0, 5\)"),
    (dict(input_ids=torch.tensor([1, 2]), mask_id=3, vocab_size=5), "must be a \\(batch, seq\\) long tensor"),
    (dict(input_ids=torch.tensor([[1, 2]]), mask_id=3, vocab_size=5, probability=1.5), "probability"),
    (dict(input_ids=torch.tensor([[1, 2]]), mask_id=3, vocab_size=5, padding_mask=torch.ones(1, 3, dtype=torch.bool)),
     "padding_mask shape"),
])
def test_bad_arguments_name_the_problem(bad, message):
    with pytest.raises(ValueError, match=message):
        mask_tokens(**bad)


def _docs(n=300):
    return [[[d * 1000 + s * 10 + w for w in range(3)] for s in range(5)] for d in range(n)]


def test_next_sentence_pairs_are_half_consecutive_half_from_another_document():
    docs = _docs()
    pairs = sentence_pairs(docs, "nsp", random.Random(0))
    assert len(pairs) == 300 * 4
    within(sum(p.label for p in pairs), len(pairs), 0.5, "random next sentences")
    for p in pairs:
        doc_a, sent_a = divmod(p.a[0], 1000)
        doc_b, sent_b = divmod(p.b[0], 1000)
        if p.label == 0:
            assert (doc_b, sent_b) == (doc_a, sent_a + 10), "IsNext pair is not the following sentence"
        else:
            assert doc_b != doc_a, "a random next sentence came from the same document"


def test_sentence_order_pairs_are_consecutive_and_half_swapped():
    pairs = sentence_pairs(_docs(), "sop", random.Random(0))
    within(sum(p.label for p in pairs), len(pairs), 0.5, "swapped pairs")
    for p in pairs:
        first, second = (p.b, p.a) if p.label else (p.a, p.b)
        assert divmod(first[0], 1000)[0] == divmod(second[0], 1000)[0]
        assert second[0] == first[0] + 10, "not consecutive in the stated order"


def test_nsp_needs_two_documents():
    with pytest.raises(ValueError, match="at least two documents"):
        sentence_pairs([[[1], [2]]], "nsp", random.Random(0))


def test_pack_pair_types_truncation_and_collate():
    ids, types = pack_pair([5, 6, 7, 8, 9], [10, 11], cls_id=CLS, sep_id=SEP, max_len=8)
    assert ids == [CLS, 5, 6, 7, SEP, 10, 11, SEP] and types == [0, 0, 0, 0, 0, 1, 1, 1]
    ids, types = pack_pair([5, 6], None, cls_id=CLS, sep_id=SEP, max_len=8)
    assert ids == [CLS, 5, 6, SEP] and types == [0] * 4
    batch = collate_pairs([pack_pair([5], [6, 7], cls_id=CLS, sep_id=SEP, max_len=9),
                           pack_pair([5], None, cls_id=CLS, sep_id=SEP, max_len=9)], pad_id=PAD)
    assert batch["input_ids"].tolist() == [[CLS, 5, SEP, 6, 7, SEP], [CLS, 5, SEP, PAD, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[True] * 6, [True] * 3 + [False] * 3]
    assert batch["token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 1], [0] * 6]


def test_embedded_documents_follow_one_subject():
    from os.path import commonprefix
    docs = english_documents(50, seed=3)
    assert english_documents(50, seed=3) == docs and english_documents(50, seed=4) != docs
    adverbs = {"today", "now", "often", "sometimes", "here"}
    for doc in docs:
        assert 4 <= len(doc) <= 8
        starts = [s.split()[1:] if s.split()[0] in adverbs else s.split() for s in doc]
        shared = commonprefix(starts)     # the protagonist, "the [adjective] noun", opens every sentence
        assert len(shared) >= 2 and shared[0] == "the", doc
