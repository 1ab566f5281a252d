"""Tokenizers: text <-> token ids, with the same special ids in every kind.

Every tokenizer has ``encode(text) -> ids`` (no BOS/EOS added: callers add them),
``decode(ids) -> text``, ``tokens(ids) -> pieces`` (readable labels for attention plots),
``vocab_size``, and ``save(path)`` / ``load(path)`` as JSON (never pickle). Ids 0-3 are
always the special tokens ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>``.

- ``CharTokenizer``: one id per character.
- ``WordTokenizer``: one id per whitespace-separated word (fits the built-in corpus).
- ``BPETokenizer``: byte-pair encoding trained with Hugging Face ``tokenizers``; words are
  marked with a leading "▁" (metaspace), so ``decode(encode(s)) == s`` for text with single
  spaces between words and no leading or trailing space.
- ``HFTokenizer``: any Hugging Face ``tokenizer.json`` (a pretrained model's own tokenizer),
  with the special ids that model uses (from ``tokenizer_config.json`` beside it when there is
  one); ``encode`` adds the model's own special tokens (a LLaMA BOS, say) as its post-processor
  says, because that is what the model was trained on.

:func:`load_tokenizer` reads either format: an attnlab tokenizer file, a Hugging Face
``tokenizer.json``, or a directory holding one.

For the trained kinds, ``decode`` drops ``<pad>``, ``<bos>`` and ``<eos>`` wherever they are (cut at the first EOS
before decoding if tokens may follow it) and writes ``<unk>`` for unknown tokens, so lost
text stays visible.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from itertools import chain
from typing import ClassVar, Iterable

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_DROPPED_ON_DECODE = frozenset((PAD_ID, BOS_ID, EOS_ID))
_FORMAT_VERSION = 1


class Tokenizer:
    """Common interface; subclasses register themselves under their ``kind``."""
    kind: ClassVar[str]
    modality: ClassVar[str] = "text"      # what it processes (attnlab.processors)
    registry: ClassVar[dict[str, type[Tokenizer]]] = {}
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            Tokenizer.registry[cls.kind] = cls

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> Tokenizer:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def tokens(self, ids: Iterable[int]) -> list[str]:
        raise NotImplementedError

    def vocabulary(self) -> dict[str, int]:
        """Piece -> id for every id (two tokenizers with equal vocabularies encode alike)."""
        return {p: i for i, p in enumerate(self.tokens(range(self.vocab_size)))}

    def _state(self) -> dict:
        raise NotImplementedError

    @classmethod
    def _from_state(cls, state: dict) -> Tokenizer:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        data = {"type": self.kind, "version": _FORMAT_VERSION, **self._state()}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        data = _read_json(path)
        if data.get("type") != cls.kind:
            raise ValueError(f"{path}: holds a {data.get('type')!r} tokenizer, not {cls.kind!r}")
        return cls._from_state(data)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


def _read_json(path: str | os.PathLike) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a tokenizer JSON file ({e})") from None
    if isinstance(data, dict) and "type" not in data and isinstance(data.get("model"), dict):
        raise ValueError(f"{path}: a Hugging Face tokenizer.json, not an attnlab tokenizer file; "
                         "attnlab.tokenizer.load_tokenizer reads both")
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"{path}: not an attnlab tokenizer file (no 'type' field)")
    if data.get("version") != _FORMAT_VERSION:
        raise ValueError(f"{path}: tokenizer format version {data.get('version')!r}, expected {_FORMAT_VERSION}")
    return data


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer of either format: an attnlab tokenizer file (the class is chosen by its
    "type" field), a Hugging Face ``tokenizer.json`` (an :class:`HFTokenizer`), or a directory
    holding a ``tokenizer.json``."""
    path = Path(path)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in this directory")
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such tokenizer file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a tokenizer JSON file ({e})") from None
    if isinstance(raw, dict) and "type" not in raw and isinstance(raw.get("model"), dict):
        return HFTokenizer.from_file(path)
    data = _read_json(path)
    cls = Tokenizer.registry.get(data["type"])
    if cls is None:
        raise ValueError(f"{path}: unknown tokenizer type {data['type']!r}; known: {sorted(Tokenizer.registry)}")
    return cls._from_state(data)


class _VocabTokenizer(Tokenizer):
    """A tokenizer that is a list of pieces: id i is ``vocab[i]``."""

    def __init__(self, vocab: list[str]):
        if tuple(vocab[:len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"vocabulary must start with {SPECIAL_TOKENS}")
        if len(set(vocab)) != len(vocab):
            raise ValueError("vocabulary has repeated pieces")
        self.vocab = list(vocab)
        self._ids = {p: i for i, p in enumerate(self.vocab)}

    @staticmethod
    def _split(text: str) -> list[str]:
        raise NotImplementedError

    @staticmethod
    def _join(pieces: list[str]) -> str:
        raise NotImplementedError

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> _VocabTokenizer:
        """Keep the most frequent pieces (ties alphabetically), up to ``vocab_size`` ids in all."""
        if vocab_size is not None and vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens")
        counts = Counter(p for text in texts for p in cls._split(text))
        for special in SPECIAL_TOKENS:
            counts.pop(special, None)
        pieces = sorted(counts, key=lambda p: (-counts[p], p))
        if vocab_size is not None:
            pieces = pieces[:vocab_size - len(SPECIAL_TOKENS)]
        return cls(list(SPECIAL_TOKENS) + pieces)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(p, UNK_ID) for p in self._split(text)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._join([self.vocab[i] for i in ids if i not in _DROPPED_ON_DECODE])

    def tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.vocab[i] for i in ids]

    def _state(self) -> dict:
        return {"vocab": self.vocab}

    @classmethod
    def _from_state(cls, state: dict) -> _VocabTokenizer:
        return cls(state["vocab"])


class CharTokenizer(_VocabTokenizer):
    """One id per character; ``tokens`` shows a space as "▁" so plot labels stay visible."""
    kind = "char"

    @staticmethod
    def _split(text: str) -> list[str]:
        return list(text)

    @staticmethod
    def _join(pieces: list[str]) -> str:
        return "".join(pieces)

    def tokens(self, ids: Iterable[int]) -> list[str]:
        return ["▁" if p == " " else p for p in super().tokens(ids)]


class WordTokenizer(_VocabTokenizer):
    """One id per whitespace-separated word; decoding joins words with single spaces."""
    kind = "word"

    @staticmethod
    def _split(text: str) -> list[str]:
        return text.split()

    @staticmethod
    def _join(pieces: list[str]) -> str:
        return " ".join(pieces)


class BPETokenizer(Tokenizer):
    """Byte-pair encoding from Hugging Face ``tokenizers`` (models.BPE, metaspace pre-tokenizer)."""
    kind = "bpe"

    def __init__(self, hf_tokenizer):
        for i, special in enumerate(SPECIAL_TOKENS):
            if hf_tokenizer.token_to_id(special) != i:
                raise ValueError(f"BPE tokenizer must have {special!r} at id {i}")
        self.hf = hf_tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = 8000) -> BPETokenizer:
        """Learn merges from an iterable of texts; the result has at most ``vocab_size`` ids."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers
        vocab_size = 8000 if vocab_size is None else vocab_size
        if vocab_size <= len(SPECIAL_TOKENS):
            raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens")
        hf = HFTokenizer(models.BPE(unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Metaspace()
        hf.decoder = decoders.Metaspace()
        # limit_alphabet keeps rare characters from pushing the vocabulary past vocab_size
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      limit_alphabet=vocab_size - len(SPECIAL_TOKENS), show_progress=False)
        hf.train_from_iterator(iter(texts), trainer=trainer)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode([i for i in ids if i not in _DROPPED_ON_DECODE], skip_special_tokens=False)

    def tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.hf.id_to_token(i) for i in ids]

    def _state(self) -> dict:
        return {"tokenizer": json.loads(self.hf.to_str())}

    @classmethod
    def _from_state(cls, state: dict) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_str(json.dumps(state["tokenizer"])))


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers.Tokenizer`` (a pretrained model's ``tokenizer.json``) behind
    attnlab's interface: ``encode``/``decode``/``tokens``/``vocab_size`` and the special ids.

    The special ids are instance attributes, None where the tokenizer has no such token; they
    come from ``special`` (token names per role, e.g. from ``tokenizer_config.json``) or, failing
    that, from the tokens the conventional names denote (``<pad>``, ``<s>``, ``</s>``,
    ``<|endoftext|>``, ``<unk>``, ``[PAD]``, ``[CLS]``, ``[SEP]``, ``[UNK]``).
    ``encode`` adds the tokenizer's own special tokens (its post-processor: BERT's [CLS] ... [SEP]),
    neither pads nor truncates (the file's padding and truncation settings are switched off on
    the given tokenizer), and ``decode`` skips every special token.
    """
    kind = "huggingface"
    ROLES = ("pad", "bos", "eos", "unk")
    _CONVENTIONAL = {"pad": ("<pad>", "[PAD]", "<|pad|>"), "bos": ("<s>", "<bos>", "[CLS]", "<|begin_of_text|>"),
                     "eos": ("</s>", "<eos>", "[SEP]", "<|endoftext|>", "<|end_of_text|>"),
                     "unk": ("<unk>", "[UNK]", "<|unk|>")}

    def __init__(self, hf_tokenizer, special: dict[str, str | None] | None = None, chat_template: str | None = None):
        # A tokenizer.json may keep the padding and truncation its writer used (all-MiniLM-L6-v2's
        # pads every text to 128 ids with [PAD]); ``encode`` gives one text's own ids, as
        # transformers' tokenizer does unless asked to pad or truncate: batching pads, with a mask.
        hf_tokenizer.no_padding()
        hf_tokenizer.no_truncation()
        self.hf = hf_tokenizer
        self.chat_template = chat_template            # a Jinja template (tokenizer_config.json's, a GGUF file's)
        self.special = {}
        for role in self.ROLES:
            names = [special[role]] if special and special.get(role) else list(self._CONVENTIONAL[role])
            token = next((n for n in names if n is not None and hf_tokenizer.token_to_id(n) is not None), None)
            self.special[role] = token
            setattr(self, f"{role}_id", None if token is None else hf_tokenizer.token_to_id(token))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> HFTokenizer:
        """``tokenizer.json`` (special-token roles from ``tokenizer_config.json`` beside it)."""
        from tokenizers import Tokenizer as _HF
        path = Path(path)
        try:
            hf = _HF.from_file(str(path))
        except Exception as e:                     # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{path}: not a readable Hugging Face tokenizer.json: {e}") from None
        config = path.with_name("tokenizer_config.json")
        return cls(hf, _special_from_config(config), _chat_template_from_config(config))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of ``text``, with the model's own special tokens ([CLS] ... [SEP], a BOS)
        unless ``add_special_tokens`` is False (pieces to be packed by the caller)."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (e.g. "[MASK]"), None if the vocabulary has no such token."""
        return self.hf.token_to_id(token)

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.hf.id_to_token(i) for i in ids]

    def vocabulary(self) -> dict[str, int]:
        return self.hf.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        """The conversation as the model's chat template writes it (the string transformers'
        ``apply_chat_template(..., tokenize=False)`` gives; :mod:`attnlab.chat_template`)."""
        from .chat_template import render_chat
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        tokens = {f"{role}_token": token for role, token in self.special.items() if token is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **{**tokens, **kwargs})

    def _state(self) -> dict:
        state = {"tokenizer": json.loads(self.hf.to_str()), "special": self.special}
        return state if self.chat_template is None else dict(state, chat_template=self.chat_template)

    @classmethod
    def _from_state(cls, state: dict) -> HFTokenizer:
        from tokenizers import Tokenizer as _HF
        return cls(_HF.from_str(json.dumps(state["tokenizer"])), state.get("special"), state.get("chat_template"))


BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece(texts: Iterable[str], vocab_size: int = 8000, lowercase: bool = True) -> HFTokenizer:
    """A BERT-style WordPiece tokenizer trained on ``texts`` with Hugging Face ``tokenizers``:
    BERT's normaliser (lower-casing unless ``lowercase`` is False) and pre-tokeniser, "##"
    continuation pieces, ids 0-4 = [PAD] [UNK] [CLS] [SEP] [MASK], and the post-processor that
    makes ``encode`` give ``[CLS] text [SEP]`` (pairs: ``[CLS] a [SEP] b [SEP]``, token types 0/1).
    Its ``tokenizer.json`` loads in transformers' BertTokenizerFast."""
    from tokenizers import Tokenizer as _HF, decoders, models, normalizers, pre_tokenizers, processors, trainers
    if vocab_size <= len(BERT_SPECIAL_TOKENS):
        raise ValueError(f"train_wordpiece: vocab_size must exceed the {len(BERT_SPECIAL_TOKENS)} special tokens, "
                         f"got {vocab_size}")
    hf = _HF(models.WordPiece(unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    hf.decoder = decoders.WordPiece()
    hf.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, show_progress=False,
                                                            special_tokens=list(BERT_SPECIAL_TOKENS)))
    cls, sep = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
    hf.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                      special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return HFTokenizer(hf, {"pad": "[PAD]", "bos": "[CLS]", "eos": "[SEP]", "unk": "[UNK]"})


def _chat_template_from_config(path: Path) -> str | None:
    """A ``tokenizer_config.json``'s chat template (a string; the first of a list of named ones),
    else a ``chat_template.jinja`` beside it; None if neither."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(template, str) and path.with_name("chat_template.jinja").is_file():
        template = path.with_name("chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) else None


def _special_from_config(path: Path) -> dict[str, str | None] | None:
    """Token names per role from a ``tokenizer_config.json`` (values may be strings or
    {"content": ...} objects); None if there is no readable file."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    out = {}
    for role in HFTokenizer.ROLES:
        value = config.get(f"{role}_token")
        out[role] = value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None
    return out


def train_tokenizers(kind: str, src_texts: Iterable[str], tgt_texts: Iterable[str], shared: bool = True,
                     vocab_size: int | None = None) -> tuple[Tokenizer, Tokenizer]:
    """Train (source, target) tokenizers of ``kind`` ("char", "word", "bpe").

    With ``shared`` one tokenizer is trained on both sides and returned twice (the same
    object); otherwise each side gets its own. ``vocab_size`` caps each vocabulary (None: no
    cap for char/word, 8000 for BPE).
    """
    cls = Tokenizer.registry.get(kind)
    if cls is None:
        raise ValueError(f"unknown tokenizer kind {kind!r}; known: {sorted(Tokenizer.registry)}")
    if shared:
        tok = cls.train(chain(src_texts, tgt_texts), vocab_size)
        return tok, tok
    return cls.train(src_texts, vocab_size), cls.train(tgt_texts, vocab_size)
