"""``attnlab chat MODEL``: a conversation with a chat model in the terminal, the reply streamed.

Each turn, the whole conversation so far (the system prompt, every user message and reply) is
written out by the model's own chat template (:mod:`attnlab.chat_template`, as transformers'
``apply_chat_template`` writes it) with the header of the assistant's turn at the end, and the
model continues it until its end-of-turn token. The reply joins the history.

Interactive: type a message and Enter; ``/reset`` forgets the conversation (the system prompt
stays), ``/exit`` (or Ctrl-D) ends it. For scripts: ``--message TEXT`` answers one message and
exits; with stdin not a terminal, every line of stdin is one user message (``/reset`` and
``/exit`` work there too) and every reply is printed as it streams, followed by a newline.
When the conversation outgrows the model's context, the oldest turns are dropped (said on stderr).
"""
from __future__ import annotations

import argparse
import math
import sys

from . import kv_options

HELP = "talk to a chat model (a GGUF file or Hugging Face directory with a chat template), replies streamed"
EXAMPLE = ("attnlab chat SmolLM2-135M-Instruct.Q4_1.gguf --system \"Answer in one sentence.\"\n"
           "  attnlab chat model.gguf --message \"What is attention?\" --temperature 0\n"
           "  printf 'Hi\\n/reset\\nWho are you?\\n' | attnlab chat model.gguf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a GGUF file or a Hugging Face causal-LM directory whose tokenizer has a chat "
                   "template (tokenizer_config.json's chat_template or chat_template.jinja)")
    p.add_argument("--system", default=None, help="a system prompt for the whole conversation (default: the "
                   "template's own, if it has one)")
    p.add_argument("--message", default=None, help="answer this one message and exit (non-interactive)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="at most this many tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens of mass p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty, > 1 discourages repeats")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--show-prompt", action="store_true", help="print each templated prompt to stderr")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="precision of the large Linear layers' products, as for 'attnlab generate' (default auto)")
    kv_options.add_arguments(p)


def _check_options(args: argparse.Namespace) -> None:
    from . import UserError
    for flag, value, ok, want in [
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "at least 1"),
            ("--temperature", args.temperature, math.isfinite(args.temperature) and args.temperature >= 0, ">= 0"),
            ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, "at least 1"),
            ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
            ("--repetition-penalty", args.repetition_penalty,
             math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0, "> 0")]:
        if not ok:
            raise UserError(f"{flag}: must be {want}, got {value}")
    kv_options.options(args)


class Conversation:
    """The history and one turn of it: template, fit into the context, generate, remember."""

    def __init__(self, lm, args: argparse.Namespace):
        self.lm, self.args = lm, args
        self.system = [{"role": "system", "content": args.system}] if args.system else []
        self.history: list[dict] = []
        self.turns = 0

    def reset(self) -> None:
        self.history = []

    def _prompt_ids(self, message: str) -> list[int]:
        tok, context = self.lm.tokenizer, self.lm.context
        while True:
            turn = self.system + self.history + [{"role": "user", "content": message}]
            prompt = tok.apply_chat_template(turn, add_generation_prompt=True)
            ids = tok.encode(prompt, add_special_tokens=False)      # the template wrote the special tokens
            if context is None or len(ids) < context or not self.history:
                break
            self.history = self.history[2:]                       # the oldest user message and its reply
            print("(the conversation outgrew the context: the oldest turn is dropped)", file=sys.stderr)
        if self.args.show_prompt:
            print(f"--- prompt ({len(ids)} tokens) ---\n{prompt}\n---", file=sys.stderr)
        return ids

    def reply(self, message: str, emit) -> str:
        a = self.args
        ids = self._prompt_ids(message)
        if self.lm.context is not None and len(ids) >= self.lm.context:
            raise ValueError(f"the message is {len(ids)} tokens with its template, but the model's context is "
                             f"{self.lm.context} tokens")
        result = self.lm.complete(ids, a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                                  repetition_penalty=a.repetition_penalty, seed=a.seed + self.turns, on_text=emit,
                                  **kv_options.options(a))
        self.turns += 1
        self.history += [{"role": "user", "content": message}, {"role": "assistant", "content": result.text}]
        return result.text


def _emit(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _lines(interactive: bool):
    """User messages: typed at a "> " prompt, or stdin's lines."""
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and not line:
            return
        yield line.rstrip("\n")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    from ..tasks.lm import load_lm
    _check_options(args)
    open_model_path(args.checkpoint, "chat", ("causal-lm",))
    lm = load_lm(args.checkpoint, args.device, args.dtype)
    if not getattr(lm.tokenizer, "chat_template", None):
        raise UserError(f"{args.checkpoint}: its tokenizer has no chat template; continue text with 'attnlab generate'")
    chat = Conversation(lm, args)
    if args.message is not None:
        chat.reply(args.message, _emit)
        _emit("\n")
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.checkpoint}: /reset forgets the conversation, /exit (or Ctrl-D) ends it",
              file=sys.stderr)
    for line in _lines(interactive):
        command = line.strip()
        if command == "/exit":
            break
        if command == "/reset":
            chat.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if not command:
            continue
        chat.reply(line, _emit)
        _emit("\n")
    return 0
