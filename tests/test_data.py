"""Built-in corpus, file readers and length-bucketed batching (pitfall 19: equal shards)."""
import random
import warnings

import pytest
import torch

from attnlab.data import (DataFormatError, collate, english_number, german_number, number_corpus, pair_lengths,
                          plan_batches, read_parallel, read_tsv, shard_batches)
from attnlab.data.numbers import NP, Clause, random_pair


@pytest.fixture(scope="module")
def corpus():
    return number_corpus(n_train=1500, n_valid=200, n_test=200, seed=0)


# ---- the built-in corpus -------------------------------------------------------------

def test_corpus_deterministic_per_seed(corpus):
    assert number_corpus(1500, 200, 200, seed=0) == corpus
    other = number_corpus(1500, 200, 200, seed=1)
    assert other.train != corpus.train and other.test != corpus.test


def test_corpus_sizes_and_disjoint_splits(corpus):
    train, valid, test = corpus
    assert (len(train), len(valid), len(test)) == (1500, 200, 200)
    sources = [s for split in corpus for s, _ in split]
    assert len(set(sources)) == len(sources)  # no source twice, within or across splits


def test_test_split_stable_when_train_size_changes(corpus):
    assert number_corpus(n_train=100, n_valid=200, n_test=200, seed=0).test == corpus.test


def test_corpus_lengths_and_vocabulary(corpus):
    for side in (0, 1):
        lengths = [len(p[side].split()) for split in corpus for p in split]
        assert min(lengths) >= 3 and max(lengths) <= 20
        assert 6 <= sum(lengths) / len(lengths) <= 14
        vocab = {w for split in corpus for p in split for w in p[side].split()}
        assert len(vocab) < 210  # 98 number words plus a small grammar


def test_corpus_is_a_function_of_the_source():
    rng, seen = random.Random(5), {}
    for _ in range(3000):
        src, tgt = random_pair(rng)
        assert seen.setdefault(src, tgt) == tgt


@pytest.mark.parametrize("n, en, de", [(1, "one", "eins"), (7, "seven", "sieben"), (16, "sixteen", "sechzehn"),
                                       (17, "seventeen", "siebzehn"), (20, "twenty", "zwanzig"),
                                       (21, "twenty-one", "einundzwanzig"), (30, "thirty", "dreißig"),
                                       (47, "forty-seven", "siebenundvierzig"),
                                       (66, "sixty-six", "sechsundsechzig"), (99, "ninety-nine", "neunundneunzig")])
def test_number_words(n, en, de):
    assert english_number(n) == en and german_number(n) == de


def test_numbers_out_of_range():
    with pytest.raises(ValueError):
        german_number(100)


def test_corpus_translates_numbers_with_reordering(corpus):
    en_to_de = {english_number(n): german_number(n) for n in range(2, 100)}
    checked = 0
    for src, tgt in corpus.train:
        for word in src.split():
            if "-" in word:
                assert en_to_de[word] in tgt.split()
                checked += 1
    assert checked > 100


def test_subordinate_clause_puts_verb_last():
    sub = Clause(NP("dog"), "see", (NP("cat"),))
    main = Clause(NP("woman"), "sleep")
    assert sub.english() == "the dog sees the cat"
    assert f"{main.german()} , weil {sub.german('sub')}" == "die Frau schläft , weil der Hund die Katze sieht"
    assert Clause(NP("dog", plural=True), "see", (NP("cat"),)).german("sub") == "die Hunde die Katze sehen"


VERBS = {"sieht", "sehen", "mag", "mögen", "findet", "finden", "hört", "hören", "folgt", "folgen", "hilft", "helfen",
         "gibt", "geben", "zeigt", "zeigen", "schläft", "schlafen", "läuft", "laufen", "wartet", "warten", "sagt",
         "sagen", "denkt", "denken"}


def test_verb_second_after_fronted_adverb_in_corpus(corpus):
    n = 0
    for src, tgt in corpus.train:
        if src.split()[0] == "today":
            assert tgt.split()[0] == "heute" and tgt.split()[1] in VERBS
            n += 1
    assert n > 20


def test_subordinate_clauses_in_corpus_end_with_verb(corpus):
    n = 0
    for src, tgt in corpus.train:
        if " because " in src:
            assert tgt.split()[-1] in VERBS and " , weil " in tgt
            n += 1
    assert n > 20


def test_case_and_adjective_agreement():
    gives = Clause(NP("man"), "give", (NP("child", adj="small"), NP("book", "a", "old")))
    assert gives.english() == "the man gives the small child an old book"
    assert gives.german() == "der Mann gibt dem kleinen Kind ein altes Buch"
    assert gives.german("v2") == "gibt der Mann dem kleinen Kind ein altes Buch"
    sees = Clause(NP("woman", "a", "big"), "see", (NP("dog", "a", "black"),), pp=("with", NP("cat", 47, "red")))
    assert sees.german() == "eine große Frau sieht einen schwarzen Hund mit siebenundvierzig roten Katzen"
    assert Clause(NP("bird", 3), "follow", (NP("teacher", plural=True),)).german() == \
        "drei Vögel folgen den Lehrern"
    assert Clause(NP("dog", "one", "big"), "find", (NP("car", 2),), pp=("for", NP("man"))).german() == \
        "ein großer Hund findet zwei Autos für den Mann"
    likes = Clause(NP("girl"), "like", (NP("flower", adj="red"),), pp=("from", NP("child", adj="small")))
    assert likes.german("sub") == "das Mädchen die rote Blume von dem kleinen Kind mag"
    assert Clause(NP("horse", adj="old", plural=True), "show", (NP("girl", 12), NP("car", 5))).german() == \
        "die alten Pferde zeigen zwölf Mädchen fünf Autos"
    assert NP("car", 5, "old").german("dat") == "fünf alten Autos"  # no -n after -s
    assert NP("child", adj="small").german("acc") == "das kleine Kind"


def test_grammar_rejects_bad_structures():
    with pytest.raises(ValueError):
        NP("dog", "a", plural=True)
    with pytest.raises(ValueError):
        Clause(NP("dog"), "give", (NP("cat"),))


# ---- file readers --------------------------------------------------------------------

def write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_read_tsv_streams_pairs(tmp_path):
    p = write(tmp_path / "d.tsv", "a b\tx y\n  c \td\n".encode())
    reader = read_tsv(p)
    it = iter(reader)
    assert next(it) == ("a b", "x y")
    assert list(it) == [("c", "d")]


@pytest.mark.parametrize("line, problem", [("no tab here", "no tab"), ("a\tb\tc", "2 tabs"),
                                           ("\tb", "empty source"), ("a\t ", "empty target"), ("", "empty line")])
def test_read_tsv_malformed_line_names_file_and_line(tmp_path, line, problem):
    p = write(tmp_path / "pairs.tsv", f"a\tb\nc\td\n{line}\ne\tf\n".encode())
    with pytest.raises(ValueError) as err:
        list(read_tsv(p))
    assert "pairs.tsv" in str(err.value) and "line 3:" in str(err.value) and problem in str(err.value)
    assert isinstance(err.value, DataFormatError) and err.value.line == 3


def test_read_tsv_skip_mode_counts(tmp_path):
    p = write(tmp_path / "d.tsv", b"a\tb\nbad\nc\td\n\t\ne\tf\n")
    reader = read_tsv(p, skip_malformed=True)
    with pytest.warns(UserWarning, match="skipped 2 malformed"):
        pairs = list(reader)
    assert pairs == [("a", "b"), ("c", "d"), ("e", "f")]
    assert reader.skipped == 2 and reader.skipped_lines == [2, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clean = read_tsv(write(tmp_path / "ok.tsv", b"a\tb\n"), skip_malformed=True)
        assert list(clean) == [("a", "b")] and clean.skipped == 0


def test_read_tsv_bom_and_crlf(tmp_path):
    p = write(tmp_path / "w.tsv", "\ufeffHund\tdog\r\nKatze\tcat\r\n".encode())
    assert list(read_tsv(p)) == [("Hund", "dog"), ("Katze", "cat")]


def test_non_utf8_error_names_file_and_line(tmp_path):
    p = write(tmp_path / "latin.tsv", "a\tb\nKäse\tcheese\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.tsv, line 2: not valid UTF-8"):
        list(read_tsv(p))


def test_read_parallel(tmp_path):
    src = write(tmp_path / "s.txt", "\ufeffthe dog\r\nthe cat\n".encode())
    tgt = write(tmp_path / "t.txt", b"der Hund\ndie Katze\n")
    assert list(read_parallel(src, tgt)) == [("the dog", "der Hund"), ("the cat", "die Katze")]


def test_read_parallel_length_mismatch_names_both_files(tmp_path):
    src = write(tmp_path / "src.txt", b"a\nb\nc\n")
    tgt = write(tmp_path / "tgt.txt", b"x\ny\n")
    reader = read_parallel(src, tgt, skip_malformed=True)
    with pytest.raises(ValueError) as err:
        list(reader)
    msg = str(err.value)
    assert "src.txt" in msg and "tgt.txt" in msg and "line 3" in msg and "ended after 2 lines" in msg


def test_read_parallel_empty_line(tmp_path):
    src = write(tmp_path / "src.txt", b"a\nb\nc\n")
    tgt = write(tmp_path / "tgt.txt", b"x\n \nz\n")
    with pytest.raises(ValueError, match=r"tgt\.txt, line 2: empty line"):
        list(read_parallel(src, tgt))
    reader = read_parallel(src, tgt, skip_malformed=True)
    with pytest.warns(UserWarning):
        assert list(reader) == [("a", "x"), ("c", "z")]
    assert reader.skipped == 1 and reader.skipped_lines == [2]


# ---- batching ------------------------------------------------------------------------

def test_pair_lengths_count_bos_eos():
    assert pair_lengths([([5, 6, 7], [8]), ([5], [8, 9, 10])]) == [3, 4]


@pytest.fixture(scope="module")
def lengths():
    rng = random.Random(0)
    return [rng.randint(3, 40) for _ in range(3000)] + [500]  # one example over the budget


def test_batches_cover_every_example_once_within_budget(lengths):
    batches = plan_batches(lengths, max_tokens=400, seed=0, epoch=0, pool_size=500)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 400 or len(b) == 1
    assert [b for b in batches if len(lengths) - 1 in b] == [[len(lengths) - 1]]  # its own batch
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert padded < 1.1 * sum(lengths)  # bucketing keeps padding small


def test_batches_deterministic_per_seed_and_epoch(lengths):
    a = plan_batches(lengths, 400, seed=3, epoch=1)
    assert a == plan_batches(lengths, 400, seed=3, epoch=1)
    assert a != plan_batches(lengths, 400, seed=3, epoch=2)
    assert a != plan_batches(lengths, 400, seed=4, epoch=1)
    groups = lambda batches: {frozenset(b) for b in batches}  # noqa: E731
    assert groups(a) != groups(plan_batches(lengths, 400, seed=3, epoch=2))  # new batch mates, not only order


def test_unshuffled_plan_is_ordered(lengths):
    batches = plan_batches(lengths[:100], 400, shuffle=False, pool_size=1000)
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)


def test_max_len_rejects_long_example(lengths):
    with pytest.raises(ValueError, match="example 3000 with length 500"):
        plan_batches(lengths, 400, max_len=100)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shard_batches_equal_counts(lengths, world_size):
    batches = plan_batches(lengths, 400)
    shards = [shard_batches(batches, r, world_size) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1
    assert len(shards[0]) == len(batches) // world_size
    taken = [tuple(b) for s in shards for b in s]
    assert len(set(taken)) == len(taken)  # no batch on two ranks
    with pytest.raises(ValueError):
        shard_batches(batches, world_size, world_size)


def test_collate_shapes_masks_and_shift():
    pairs = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]
    batch = collate(pairs, [0, 1], pad_id=0, bos_id=1, eos_id=2)
    assert batch["src"].tolist() == [[5, 6, 7], [5, 0, 0]]
    assert batch["src_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["tgt_in"].tolist() == [[1, 8, 9, 0, 0], [1, 8, 9, 10, 11]]
    assert batch["tgt_out"].tolist() == [[8, 9, 2, 0, 0], [8, 9, 10, 11, 2]]
    assert batch["tgt_mask"].tolist() == [[True] * 3 + [False] * 2, [True] * 5]
    assert batch["num_tokens"] == 8
    assert batch["src"].dtype == torch.long and batch["tgt_mask"].dtype == torch.bool
    assert torch.equal(batch["tgt_in"][:, 1:][batch["tgt_mask"][:, 1:]],
                       batch["tgt_out"][:, :-1][batch["tgt_mask"][:, 1:]])  # shifted by one
    assert collate(pairs, [1])["src"].shape == (1, 1)
