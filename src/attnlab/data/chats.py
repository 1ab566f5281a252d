"""Chat files and chat templates: conversations in, token ids with the assistant's tokens marked out.

    chats = read_chat_file("chats.jsonl")           # one {"messages": [{"role", "content"}, ...]} per line
    template = ChatTemplate.for_model("SmolLM2/")   # the model's own template (tokenizer_config.json), or ChatML
    ids, trains = encode_chat(tokenizer, template, chats[0])    # trains[i]: ids[i] is the assistant's

A chat template is a Jinja template over ``messages`` and ``add_generation_prompt`` (the form
Hugging Face tokenizers keep in tokenizer_config.json or chat_template.jinja); it is rendered by
:func:`attnlab.chat_template.render_chat`, exactly as transformers renders it. A model without one gets ChatML
(``<|im_start|>role\\ncontent<|im_end|>\\n``), the format of SmolLM2 and Qwen.

Which tokens are the assistant's. The conversation is rendered prefix by prefix: for the i-th
message, if it is the assistant's, the text between ``render(messages[:i], add_generation_prompt=True)``
and ``render(messages[:i + 1])`` is its reply (its content and the end-of-turn marker the template
puts after it, so that the model learns to stop); everything else (system and user turns, the
"assistant" header) is context. Each piece is tokenized alone, so no token straddles a
boundary between context and reply; a template whose renderings are not prefixes of one another
cannot be split this way and is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

from .files import DataFormatError, _lines

__all__ = ["CHATML", "ChatTemplate", "read_chat_file", "chat_segments", "encode_chat", "is_chat_file"]

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ROLES = ("system", "user", "assistant", "tool")


def _message_problem(m) -> str | None:
    if not isinstance(m, dict):
        return f"a message must be an object with 'role' and 'content', got {type(m).__name__}"
    if m.get("role") not in ROLES:
        return f"message role must be one of {', '.join(ROLES)}, got {m.get('role')!r}"
    if not isinstance(m.get("content"), str):
        return f"message content must be a string, got {type(m.get('content')).__name__}"
    return None


def read_chat_file(path: str | Path) -> list[list[dict]]:
    """The conversations of a JSONL file, one ``{"messages": [...]}`` object per line (blank lines
    skipped); each needs at least one assistant message. DataFormatError naming the file and line."""
    path = str(path)
    chats = []
    for number, line in _lines(path):
        if isinstance(line, DataFormatError):
            raise line
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataFormatError(path, number, f"not valid JSON ({e.msg} at column {e.colno})") from None
        messages = item.get("messages") if isinstance(item, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataFormatError(path, number, 'expected an object {"messages": [{"role": ..., "content": ...}, '
                                  '...]} with at least one message')
        for m in messages:
            problem = _message_problem(m)
            if problem:
                raise DataFormatError(path, number, problem)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataFormatError(path, number, "the conversation has no assistant message to learn from")
        chats.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not chats:
        raise DataFormatError(path, 1, "the file holds no conversation")
    return chats


def is_chat_file(path: str | Path | None) -> bool:
    """Whether ``path`` is a .jsonl file whose first non-blank line is an object with "messages"."""
    if path is None or not str(path).lower().endswith(".jsonl") or not Path(path).is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    return isinstance(item := json.loads(line), dict) and "messages" in item
                except json.JSONDecodeError:
                    return True               # a chat file with a bad first line: its reader names the line
    return False


class ChatTemplate:
    """A Jinja chat template (see the module docstring); ``source`` is the template text."""

    def __init__(self, source: str = CHATML, bos_token: str | None = None, eos_token: str | None = None):
        from ..chat_template import _compile
        try:
            _compile(source)                  # the one renderer of attnlab (chat_template.py), checked here
        except ValueError as e:
            raise ValueError(f"chat template: not a valid Jinja template ({e})") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def for_model(cls, path: str | Path | None, tokenizer=None) -> "ChatTemplate":
        """The template the tokenizer carries, else a model directory's (chat_template.jinja, or
        tokenizer_config.json's ``chat_template``), else ChatML; the tokenizer's BOS and EOS tokens fill ``bos_token`` / ``eos_token``."""
        special = getattr(tokenizer, "special", None) or {}
        kw = {"bos_token": special.get("bos"), "eos_token": special.get("eos")}
        own = getattr(tokenizer, "chat_template", None)       # a tokenizer that carries its template (GGUF's)
        if isinstance(own, str) and own:
            return cls(own, **kw)
        directory = Path(path) if path is not None else None
        if directory is not None and (directory / "chat_template.jinja").is_file():
            return cls((directory / "chat_template.jinja").read_text(encoding="utf-8"), **kw)
        config = directory / "tokenizer_config.json" if directory is not None else None
        if config is not None and config.is_file():
            try:
                source = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            except json.JSONDecodeError as e:
                raise ValueError(f"{config}: not valid JSON ({e.msg}, line {e.lineno})") from None
            if isinstance(source, list):          # named templates: the default one
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
            if isinstance(source, str):
                return cls(source, **kw)
        return cls(CHATML, **kw)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as transformers' ``apply_chat_template(..., tokenize=False)`` writes it
        (:func:`attnlab.chat_template.render_chat`: tojson, loop controls, ``strftime_now``)."""
        from ..chat_template import render_chat
        try:
            return render_chat(self.source, messages, add_generation_prompt=add_generation_prompt,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except ValueError as e:
            raise ValueError(f"chat template: {e}") from None

    def end_of_turn(self) -> str | None:
        """The text the template puts after a reply (ChatML's ``<|im_end|>``), found by rendering a
        probe; generation stops there. None if the template puts nothing there."""
        probe = "\x00probe\x00"
        text = self.render([{"role": "user", "content": "u"}, {"role": "assistant", "content": probe}])
        tail = text.split(probe, 1)[-1].strip()
        return tail or None


def chat_segments(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is the assistant's reply) pieces, in order."""
    full = template.render(messages)
    pieces, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        after = template.render(messages[:i + 1])
        if not (after.startswith(before) and full.startswith(after) and len(before) >= done):
            raise ValueError("chat template: its renderings of a conversation's prefixes are not prefixes of one "
                             "another, so the assistant's tokens cannot be told apart")
        pieces += [(full[done:len(before)], False), (full[len(before):len(after)], True)]
        done = len(after)
    pieces.append((full[done:], False))
    return [(text, trains) for text, trains in pieces if text]


def encode_chat(tokenizer, template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(the conversation's ids, for each id whether it belongs to an assistant's reply)."""
    ids, trains = [], []
    for text, reply in chat_segments(template, messages):
        try:
            piece = tokenizer.encode(text, add_special_tokens=False)     # the template writes the specials
        except TypeError:
            piece = tokenizer.encode(text)
        ids += piece
        trains += [reply] * len(piece)
    return ids, trains
