"""Chat templates rendered as transformers renders them, and ``attnlab chat``.

Templates: every string of :func:`attnlab.chat_template.render_chat` equals transformers'
``apply_chat_template(..., tokenize=False)`` (exact string equality) for SmolLM2's template and
for a template that uses what the sandbox provides (``raise_exception``, ``strftime_now``,
``tojson`` without HTML escaping, ``{% break %}``, ``trim_blocks``/``lstrip_blocks`` indentation,
the special tokens), over conversations with and without a system prompt, several turns, and the
generation prompt on and off; a conversation the template refuses is refused by both.

The command runs on a small random LLaMA with SmolLM2's tokenizer and template written as a GGUF
file (fast to load; the reply is noise, but the decoding is what is checked): its greedy reply
is exactly ``model.generate`` on the templated prompt, cut at the end-of-turn token, and
``/reset`` (through stdin) makes the next prompt the first one again.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.chat_template import ChatTemplateError, render_chat
from attnlab.cli import main
from attnlab.gguf import save_gguf
from attnlab.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402

FEATURES = """{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}\
{% set rest = messages[1:] %}{% else %}{% set sys = 'Today is ' + strftime_now('%d %B %Y') %}{% set rest = messages %}\
{% endif %}
<<SYS>>{{ sys }}<</SYS>>
{% for m in rest %}
    {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('roles must alternate user/assistant/user/...') }}
    {% endif %}
    {% if m['role'] == 'user' %}
[INST] {{ m['content'] | trim }} [/INST]
    {% else %}
 {{ m['content'] }}{{ eos_token }}
    {% endif %}
    {% if loop.index >= 5 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}Tools: {{ tools | tojson }}{% endif %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief & <polite>."}, {"role": "user", "content": "  Hi there \n"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3? — naïve 東京"}],
    [{"role": "user", "content": str(i)} if i % 2 == 0 else {"role": "assistant", "content": str(i)}
     for i in range(9)],
]


@pytest.fixture(scope="module")
def smol():
    return attnlab.load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def hf_tokenizer(smol):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=smol.hf, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")


@pytest.mark.parametrize("which", ["smollm2", "features"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_templates_equal_transformers(smol, hf_tokenizer, which, generation_prompt):
    template = smol.chat_template if which == "smollm2" else FEATURES
    tools = [{"name": "add", "description": "a + b <&>"}]
    for conv in CONVERSATIONS:
        want = hf_tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        if which == "smollm2":
            assert smol.apply_chat_template(conv, add_generation_prompt=generation_prompt) == want
        got = render_chat(template, conv, add_generation_prompt=generation_prompt, **_specials(smol))
        assert got == want, conv
    with_tools = hf_tokenizer.apply_chat_template(CONVERSATIONS[0], chat_template=FEATURES, tokenize=False,
                                                  tools=tools)
    assert render_chat(FEATURES, CONVERSATIONS[0], tools=tools, **_specials(smol)) == with_tools
    assert "<&>" in with_tools, "tojson keeps HTML characters"


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_sft_chat_template_equals_transformers(smol, hf_tokenizer, generation_prompt):
    """data.chats.ChatTemplate (what `train sft` and `serve` render with) writes the strings
    transformers' apply_chat_template writes, for the tokenizer's own template and for a given one."""
    from attnlab.data.chats import ChatTemplate
    own = ChatTemplate.for_model(None, smol)
    assert own.source == smol.chat_template
    given = ChatTemplate(FEATURES, bos_token="<|im_start|>", eos_token="<|im_end|>")
    for conv in CONVERSATIONS:
        for template, ours in ((smol.chat_template, own), (FEATURES, given)):
            want = hf_tokenizer.apply_chat_template(conv, chat_template=template, tokenize=False,
                                                    add_generation_prompt=generation_prompt)
            assert ours.render(conv, add_generation_prompt=generation_prompt) == want, conv


def _specials(tok) -> dict:
    return {f"{role}_token": t for role, t in tok.special.items() if t is not None}


def test_a_refused_conversation_is_refused(smol, hf_tokenizer):
    from jinja2.exceptions import TemplateError
    bad = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(TemplateError, match="roles must alternate"):
        hf_tokenizer.apply_chat_template(bad, chat_template=FEATURES, tokenize=False)
    with pytest.raises(ChatTemplateError, match="refused the conversation: roles must alternate"):
        render_chat(FEATURES, bad, **_specials(smol))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", bad)
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        render_chat(FEATURES, [{"content": "no role"}])


@pytest.fixture(scope="module")
def tiny_chat(smol, tmp_path_factory):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=smol.vocab_size, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
                              d_ff=64, max_position_embeddings=512, tie_word_embeddings=True, eos_token_id=2))
    return save_gguf(model, tmp_path_factory.mktemp("chat") / "tiny-chat.gguf", smol)


def test_message_reply_is_the_greedy_generation(tiny_chat, smol, capsys):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    assert main(["chat", str(tiny_chat), "--system", "Be brief.", "--message", "Hello!", "--temperature", "0",
                 "--max-new-tokens", "12", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    ids = smol.encode(smol.apply_chat_template(conv, add_generation_prompt=True), add_special_tokens=False)
    model = attnlab.from_pretrained(tiny_chat)
    with torch.no_grad():
        new = model.generate(torch.tensor([ids]), 12, temperature=0.0, eos_token_id=2)[0, len(ids):].tolist()
    assert out == smol.decode(new[:new.index(2)] if 2 in new else new) + "\n"
    assert len(out) > 1


def _prompts(err: str) -> list[str]:
    import re
    return re.findall(r"--- prompt \(\d+ tokens\) ---\n(.*?)\n---\n", err, flags=re.S)


def test_stdin_turns_keep_history_until_reset(tiny_chat, capsys, monkeypatch):
    args = ["chat", str(tiny_chat), "--temperature", "0", "--max-new-tokens", "6", "--dtype", "fp32", "--show-prompt"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\nHow are you?\n/reset\nHi\n/exit\nnever read\n"))
    assert main(args) == 0
    captured = capsys.readouterr()
    prompts = _prompts(captured.err)
    assert len(prompts) == 3 and "(conversation reset)" in captured.err
    first_reply = prompts[1][len(prompts[0]):].split("<|im_end|>")[0]
    assert prompts[1].startswith(prompts[0]) and captured.out.startswith(first_reply + "\n"), \
        "the second turn sees the first message and its reply"
    assert "How are you?" in prompts[1] and "How are you?" not in prompts[2]
    assert prompts[2] == prompts[0], "after /reset the conversation starts over"
    assert "never read" not in captured.err


def test_a_model_without_template_is_refused(tmp_path, capsys):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=1, d_ff=64,
                              max_position_embeddings=32))
    path = save_gguf(model, tmp_path / "plain.gguf")
    assert main(["chat", str(path), "--message", "hi"]) == 2
    assert "holds no tokenizer" in capsys.readouterr().err
