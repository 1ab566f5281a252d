"""Tokenizers: fixed special ids, round trips, JSON save/load, BPE vocabulary size."""
import json

import pytest

from attnlab.data import number_corpus
from attnlab.tokenizer import (BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, BPETokenizer, CharTokenizer,
                               WordTokenizer, load_tokenizer, train_tokenizers)

TEXTS = ["der Hund sieht die Katze", "the dog sees the cat", "siebenundvierzig Vögel schlafen , weil es regnet",
         "forty-seven birds sleep because it rains", "ein großes Kind läuft mit dem Mädchen"]
KINDS = {"char": CharTokenizer, "word": WordTokenizer, "bpe": BPETokenizer}


@pytest.fixture(scope="module", params=list(KINDS))
def tok(request):
    return KINDS[request.param].train(TEXTS * 3, vocab_size=120 if request.param == "bpe" else None)


def test_special_ids_fixed(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3) == (PAD_ID, BOS_ID, EOS_ID, UNK_ID)
    assert tok.tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(4 <= i < tok.vocab_size for i in ids)  # no specials added, nothing unknown
    assert tok.decode(ids) == text
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == text  # specials dropped


def test_tokens_give_readable_pieces(tok):
    pieces = tok.tokens(tok.encode("der Hund"))
    assert "".join(pieces).replace("▁", " ").strip().replace("  ", " ") in ("der Hund", "derHund")
    assert all(p for p in pieces)


def test_unknown_maps_to_unk(tok):
    ids = tok.encode("der Zebra€")
    assert UNK_ID in ids and "<unk>" in tok.decode(ids)


def test_save_load_identical_ids(tok, tmp_path):
    path = tmp_path / "tok.json"
    tok.save(path)
    assert json.loads(path.read_text(encoding="utf-8"))["type"] == tok.kind
    for loaded in (type(tok).load(path), load_tokenizer(path)):
        assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
        for text in TEXTS + ["der Zebra€ läuft"]:
            assert loaded.encode(text) == tok.encode(text)
            assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_load_rejects_wrong_files(tmp_path):
    (tmp_path / "x.json").write_text('{"vocab": []}')
    with pytest.raises(ValueError, match="no 'type' field"):
        load_tokenizer(tmp_path / "x.json")
    (tmp_path / "y.json").write_text('{"type": "sentencepiece", "version": 1}')
    with pytest.raises(ValueError, match="unknown tokenizer type"):
        load_tokenizer(tmp_path / "y.json")
    CharTokenizer.train(["ab"]).save(tmp_path / "c.json")
    with pytest.raises(ValueError, match="'char' tokenizer"):
        WordTokenizer.load(tmp_path / "c.json")


@pytest.mark.parametrize("vocab_size", [10, 40, 200])
def test_bpe_vocab_size_at_most_requested(vocab_size):
    tok = BPETokenizer.train(TEXTS, vocab_size=vocab_size)
    assert tok.vocab_size <= vocab_size
    assert tok.tokens([0, 1, 2, 3]) == list(SPECIAL_TOKENS)


def test_bpe_learns_merges():
    tok = BPETokenizer.train(TEXTS * 5, vocab_size=200)
    assert len(tok.encode("der Hund sieht die Katze")) < len("der Hund sieht die Katze") / 2


def test_word_and_char_vocab_cap():
    assert WordTokenizer.train(TEXTS, vocab_size=8).vocab_size == 8
    tok = CharTokenizer.train(["aaab"], vocab_size=5)
    assert tok.tokens(tok.encode("ab")) == ["a", "<unk>"]
    assert CharTokenizer.train(["a b"]).tokens(CharTokenizer.train(["a b"]).encode("a b"))[1] == "▁"


def test_train_tokenizers_shared_and_separate():
    train = number_corpus(300, 0, 0, seed=2).train
    src, tgt = [s for s, _ in train], [t for _, t in train]
    a, b = train_tokenizers("word", src, tgt, shared=True)
    assert a is b and a.encode("Hund") != [UNK_ID] and a.encode("dog") != [UNK_ID]
    s, t = train_tokenizers("bpe", src, tgt, shared=False, vocab_size=150)
    assert s is not t and s.vocab_size <= 150 and t.vocab_size <= 150
    assert t.decode(t.encode(tgt[0])) == tgt[0] and s.decode(s.encode(src[0])) == src[0]
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        train_tokenizers("sentencepiece", src, tgt)


# ----------------------------------------------------------------------------- Hugging Face tokenizer.json
def _hf_file(directory, with_config: bool):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2, "[UNK]": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.add_special_tokens(["<s>", "</s>", "<pad>", "[UNK]"])
    tok.save(str(directory / "tokenizer.json"))
    if with_config:
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>", "unk_token": "[UNK]"}))
    return tok


@pytest.mark.parametrize("with_config", [True, False])
def test_a_hugging_face_tokenizer_json_is_a_first_class_tokenizer(tmp_path, with_config):
    from attnlab.tokenizer import HFTokenizer
    hf = _hf_file(tmp_path, with_config)
    for where in (tmp_path, tmp_path / "tokenizer.json"):          # a directory or the file: one loader
        tok = load_tokenizer(where)
        assert isinstance(tok, HFTokenizer) and tok.vocab_size == hf.get_vocab_size() == 6
        assert tok.encode("hello there world") == hf.encode("hello there world").ids == [0, 4, 3, 5]
        assert tok.decode([0, 4, 5, 1]) == "hello world"                # special tokens skipped
        assert tok.tokens([4, 5]) == ["hello", "world"]
        # the roles: from tokenizer_config.json, else the conventional names
        assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 2, 3)
    tok.save(tmp_path / "attnlab.json")                                # into attnlab's own file and back
    again = load_tokenizer(tmp_path / "attnlab.json")
    assert isinstance(again, HFTokenizer) and again.encode("world hello") == [0, 5, 4]
    assert (again.bos_id, again.eos_id) == (0, 1) and again.vocabulary() == tok.vocabulary()


def test_load_tokenizer_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in this directory"):
        load_tokenizer(tmp_path)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"broken\.json: not a tokenizer JSON file"):
        load_tokenizer(tmp_path / "broken.json")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(ValueError, match=r"tokenizer\.json: not a readable Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match=r"other\.json: not an attnlab tokenizer file"):
        load_tokenizer(tmp_path / "other.json")
