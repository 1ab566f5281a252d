"""The KV-cache flags that ``attnlab generate``, ``chat`` and ``eval`` share: which cache the
attention layers keep (:mod:`attnlab.nn.kv_cache`) and how a long prompt is fed."""
from __future__ import annotations

import argparse

KINDS = ("full", "sliding", "sink", "int8", "int4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("KV cache (attention models)")
    g.add_argument("--kv-cache", choices=KINDS, default="full",
                   help="what each attention layer keeps: full (every key and value), sliding (the last --window "
                   "slots, constant memory; without --window each layer's own window), sink (StreamingLLM: the "
                   "first --sink-tokens slots and the last --window, positions inside the cache, so it reads past "
                   "the model's context), int8 / int4 (KIVI: keys per channel, values per token, the recent tokens in "
                   "full precision) (default full)")
    g.add_argument("--window", type=int, default=None, help="slots a query sees with --kv-cache sliding or sink")
    g.add_argument("--sink-tokens", type=int, default=None, help="first slots a sink cache keeps (default 4)")
    g.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="feed a long prompt N tokens at a time: the same logits, the activations of N tokens at "
                   "once instead of the whole prompt's")


def options(args: argparse.Namespace) -> dict:
    """``{"kv_cache": KVCacheKind or None, "prefill_chunk": int or None}`` from the flags, each
    mistake refused in one line naming the flag."""
    from . import UserError
    from ..nn.kv_cache import KVCacheKind
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UserError(f"--prefill-chunk: must be at least 1, got {args.prefill_chunk}")
    problem = KVCacheKind.problem(args.kv_cache, args.window, args.sink_tokens,
                                  {"kind": "--kv-cache", "window": "--window", "sink_tokens": "--sink-tokens"})
    if problem is not None:
        raise UserError(problem)
    kind = None if args.kv_cache == "full" else KVCacheKind(args.kv_cache, args.window, args.sink_tokens)
    return {"kv_cache": kind, "prefill_chunk": args.prefill_chunk}
