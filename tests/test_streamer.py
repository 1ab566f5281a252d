"""The text streamer (attnlab.generate.text.TextStreamer) decodes incrementally: the pieces it
emits concatenate to the final text, characters whose UTF-8 bytes are spread over several tokens
included (a byte-level tokenizer: one token per byte here), and the work is linear in the reply
(the characters decoded per token are bounded, where decoding the whole text each time is
quadratic). Exact string equality; the work bound is a count."""
import pytest
import torch

from attnlab.generate.text import TextStreamer

TEXT = "naïve café — 日本語のテキスト, emoji 🙂👍🏽 and plain words. " * 8


class ByteTokenizer:
    """One token per UTF-8 byte; decode replaces an unfinished character by U+FFFD, as a
    byte-level BPE's decode does. Counts what it decodes."""

    def __init__(self):
        self.calls, self.chars = 0, 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        self.calls += 1
        self.chars += len(ids)
        return bytes(ids).decode("utf-8", errors="replace")


class WordTokenizer:
    """Words joined by spaces: a decode that is not byte-level."""
    words = ["the", "cat", "sat", "on", "mat"]

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)


def _stream(tok, prompt: list[int], reply: list[int]) -> tuple[list[str], str]:
    pieces = []
    streamer = TextStreamer(tok, prompt, pieces.append)
    for t in reply:
        streamer(torch.tensor([t]))
    return pieces, streamer.end()


def test_the_pieces_concatenate_to_the_final_text_multi_byte_characters_included():
    tok = ByteTokenizer()
    prompt, reply = tok.encode("prompt: é"), tok.encode(TEXT)
    pieces, final = _stream(tok, prompt, reply)
    assert final == TEXT and "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces), "a piece held half a character"
    assert any(len(p.encode()) > 1 and len(p) == 1 for p in pieces)       # a character of several tokens


def test_the_work_is_linear_in_the_reply():
    counts = {}
    for n in (200, 800):
        tok = ByteTokenizer()
        reply = tok.encode(TEXT * 4)[:n]
        while True:                      # end on a whole character
            try:
                bytes(reply).decode("utf-8")
                break
            except UnicodeDecodeError:
                reply = reply[:-1]
        _stream(tok, tok.encode("hi"), reply)
        counts[n] = tok.chars
        assert tok.chars <= 16 * n + 64, f"{tok.chars} tokens decoded for a reply of {n}"
    assert counts[800] < 5 * counts[200]     # quadratic work would be about 16 times


@pytest.mark.parametrize("prompt", [[], [0, 1]])
def test_a_word_tokenizer_streams_its_spaces_as_the_whole_text_has_them(prompt):
    pieces, final = _stream(WordTokenizer(), prompt, [2, 3, 0, 4])
    whole = WordTokenizer().decode(prompt + [2, 3, 0, 4])
    assert final == (whole[len(WordTokenizer().decode(prompt)):]) and "".join(pieces) == final
