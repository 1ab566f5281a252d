"""``attnlab generate RUN --prompt "..."``: continue a prompt with a causal LM, streaming the text."""
from __future__ import annotations

import argparse
import math
import sys

from . import kv_options

HELP = "continue a prompt with a language model (an LM run or a Hugging Face directory), streaming the text"
EXAMPLE = ('attnlab generate runs/lm --prompt "def fibonacci(n):" --max-new-tokens 200\n'
           '  attnlab generate model.gguf --prompt "Once upon a time" --kv-cache sliding --window 256')


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="an LM run directory (its best/, else latest checkpoint), an LM checkpoint "
                   "directory, a Hugging Face causal-LM directory (config.json, weights, tokenizer.json) or a GGUF file")
    p.add_argument("--prompt", default="", help="the text to continue (default: empty, i.e. a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="at most this many tokens, fewer if the "
                   "context fills up (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float, default=None, help="sample among the most likely tokens of mass p")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="CTRL's penalty, > 1 discourages repeats")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--draft", metavar="DRAFT_DIR", help="a smaller model with the same tokenizer for speculative "
                   "decoding (same output distribution, fewer passes of the model); prints the passes per token")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="draft tokens per round (default 4)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                   help="precision of the large Linear layers' products: bf16 computes them from a bf16 copy of "
                   "the weights (half the bytes to read per token; the activations stay fp32); auto = bf16 where "
                   "the CPU has AVX512-BF16 or AMX (or the GPU supports bf16), fp32 elsewhere (default auto)")
    p.add_argument("--quantize", choices=["none", "int8"], default="none",
                   help="int8: int8 weight-only quantisation of every Linear layer, the output head included "
                   "(and the draft's), after loading: Linear weights 4x smaller, faster decoding on CPU "
                   "(attnlab.quantize; default none)")
    kv_options.add_arguments(p)


def _check_options(args: argparse.Namespace) -> None:
    """Every option's range, before anything loads or prints: an error must not land after the
    echoed prompt, on the same line."""
    from . import UserError
    problems = [("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, "at least 1"),
                ("--temperature", args.temperature, math.isfinite(args.temperature) and args.temperature >= 0,
                 "a number >= 0"),
                ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, "at least 1"),
                ("--top-p", args.top_p, args.top_p is None or 0 < args.top_p <= 1, "in (0, 1]"),
                ("--repetition-penalty", args.repetition_penalty,
                 math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0, "a number > 0"),
                ("--num-draft-tokens", args.num_draft_tokens, args.num_draft_tokens >= 1, "at least 1")]
    for flag, value, ok, want in problems:
        if not ok:
            raise UserError(f"{flag}: must be {want}, got {value}")
    kv_options.options(args)


def run(args: argparse.Namespace) -> int:
    from . import open_model_path
    from ..tasks.lm import load_lm
    _check_options(args)
    open_model_path(args.checkpoint, "generate", ("causal-lm",))
    lm = load_lm(args.checkpoint, args.device, args.dtype)
    if args.draft:
        open_model_path(args.draft, "generate --draft", ("causal-lm",))
    draft = load_lm(args.draft, next(lm.model.parameters()).device, args.dtype) if args.draft else None

    if args.quantize == "int8":
        from ..quantize import model_bytes, quantize_int8
        for m in (lm, draft):
            if m is not None:
                before = model_bytes(m.model)
                quantize_int8(m.model)
                print(f"quantized {m.path} to int8: {before / 2**20:.1f} -> {model_bytes(m.model) / 2**20:.1f} MiB "
                      "of weights", file=sys.stderr)
    ids = lm.encode_prompt(args.prompt, draft)
    lm.warn_unknown(ids if args.prompt else [], "the prompt")
    if args.quantize == "none" and "bfloat16" in lm.precision:      # said only when it changes the arithmetic
        print(lm.precision, file=sys.stderr)

    def emit(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    emit(args.prompt)
    result = lm.complete(ids, args.max_new_tokens, draft, temperature=args.temperature, top_k=args.top_k,
                         top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed,
                         num_draft_tokens=args.num_draft_tokens, on_text=emit, **kv_options.options(args))
    emit("\n")
    if result.max_new_tokens < args.max_new_tokens and result.new_tokens == result.max_new_tokens:
        print(f"note: stopped after {result.new_tokens} new tokens: the context is full", file=sys.stderr)
    if draft is not None:
        s = result.stats
        print(f"speculative decoding: {s.target_passes_per_token:.2f} target forward passes per generated token "
              f"({s.target_passes} passes for {s.new_tokens} tokens; {s.accepted} of {s.drafted} draft tokens "
              f"accepted)", file=sys.stderr)
    return 0
