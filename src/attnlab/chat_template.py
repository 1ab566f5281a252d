"""Chat templates: a conversation -> the one string a chat model was trained to read.

    render_chat(template, [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "Hi"}], add_generation_prompt=True)
    -> "<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"

A chat template is a Jinja program shipped with the model (tokenizer_config.json's
``chat_template``, a GGUF file's ``tokenizer.chat_template``). A reply is only as good as this
string is exact: a missing newline or special token puts the model off the format it was tuned on
and degrades the answer without any error, so the template is rendered the way transformers'
``apply_chat_template(..., tokenize=False)`` renders it:

- in Jinja's immutable sandbox (a template from the internet is untrusted code), with
  ``trim_blocks`` and ``lstrip_blocks`` (a block tag's own newline and indentation vanish) and the
  loop-control extension (``{% break %}``, ``{% continue %}``);
- with ``raise_exception(message)`` (a template's way to refuse a conversation, e.g. roles that
  do not alternate), ``strftime_now(format)`` (today's date in a system prompt) and a ``tojson``
  filter that leaves non-ASCII text and HTML characters as they are;
- with the variables ``messages``, ``add_generation_prompt`` (end with the header of the
  assistant's turn, so that the model writes the reply), ``tools`` and ``documents`` (None unless
  given) and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...).

``{% generation %}`` blocks (which transformers uses to mark the assistant's tokens for training
masks) render their body unchanged.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

__all__ = ["render_chat", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """A template that does not compile, or one that refused the conversation (raise_exception)."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("chat templates need the 'jinja2' package: pip install jinja2") from None

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None


def _check(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"a conversation is a list of messages, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
    return [dict(m) for m in messages]


def render_chat(template: str, messages, *, add_generation_prompt: bool = False, tools=None, documents=None,
                **variables) -> str:
    """The conversation ``messages`` (dicts with "role" and "content") written by ``template``;
    ``variables`` are further names the template may read (special tokens, a template's own options).
    ChatTemplateError for a template that does not compile or that refuses the conversation."""
    from jinja2.exceptions import TemplateError
    compiled = _compile(template)
    try:
        return compiled.render(messages=_check(messages), tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the conversation: {e}") from None
