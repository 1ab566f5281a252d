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
    for flag, value, low in (("--window", args.window, 1), ("--sink-tokens", args.sink_tokens, 0),
                             ("--prefill-chunk", args.prefill_chunk, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag}: must be at least {low}, got {value}")
    if args.window is not None and args.kv_cache not in ("sliding", "sink"):
        raise UserError(f"--window: only with --kv-cache sliding or sink (not {args.kv_cache})")
    if args.sink_tokens is not None and args.kv_cache != "sink":
        raise UserError(f"--sink-tokens: only with --kv-cache sink (not {args.kv_cache})")
    if args.kv_cache == "sink" and args.window is None:
        raise UserError("--kv-cache sink: needs --window N, the recent slots kept beside the sinks")
    kind = None if args.kv_cache == "full" else KVCacheKind(args.kv_cache, args.window, args.sink_tokens)
    return {"kv_cache": kind, "prefill_chunk": args.prefill_chunk}
