"""``attnlab serve MODEL``: an OpenAI-compatible HTTP server (docs/serving.md)."""
from __future__ import annotations

import argparse
import os
import sys

HELP = "serve a language model over HTTP with OpenAI's API (chat and text completions, streaming)"
EXAMPLE = ("attnlab serve SmolLM2/ --port 8000 --api-key secret\n"
           "  curl -H 'Authorization: Bearer secret' localhost:8000/v1/chat/completions "
           "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}'")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="an LM run (a LoRA run's adapters are merged) or a Hugging Face causal-LM "
                   "directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route (default: "
                   "$ATTNLAB_API_KEY if set, else no key)")
    p.add_argument("--name", default=None, help="the model's name in /v1/models (default: the directory's name)")
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for a place; more get "
                   "429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask for "
                   "(default 1024)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="the largest request body in bytes (default 1 MiB)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default 600)")
    p.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto", help="as 'attnlab generate'")


def run(args: argparse.Namespace) -> int:
    from . import UserError, open_model_path
    for flag, value in (("--max-batch", args.max_batch), ("--max-tokens", args.max_tokens),
                        ("--max-body", args.max_body), ("--port", args.port + 1)):
        if value < 1:
            raise UserError(f"{flag}: must be at least 1, got {value}")
    if args.max_waiting < 0 or not args.timeout > 0:
        raise UserError("--max-waiting must be >= 0 and --timeout > 0")
    try:
        from ..serve.app import Server, ServeSettings
    except ImportError as e:
        raise UserError(f"attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]' ({e.name} is "
                        "missing)") from None
    from ..adapters import lora_layers, merge_lora
    from ..data.chats import ChatTemplate
    from ..tasks.lm import load_lm
    from pathlib import Path
    info, _ = open_model_path(args.checkpoint, "serve", ("causal-lm",))
    lm = load_lm(args.checkpoint, args.device, args.dtype)
    if lora_layers(lm.model):                 # one product per layer again: the same outputs, faster
        merge_lora(lm.model)
    source = info.run.task_options.get("chat_template") if info.kind == "run" else None
    template = ChatTemplate(source) if source else ChatTemplate.for_model(
        None if info.kind == "run" else args.checkpoint, lm.tokenizer)
    key = args.api_key if args.api_key is not None else os.environ.get("ATTNLAB_API_KEY") or None
    settings = ServeSettings(model_name=args.name or Path(args.checkpoint).resolve().name, api_key=key,
                             max_tokens=args.max_tokens, default_max_tokens=min(256, args.max_tokens),
                             max_body_bytes=args.max_body, timeout=args.timeout)
    server = Server(lm, settings, template, args.host, args.port, args.max_batch, args.max_waiting, "info")
    print(f"attnlab serve: {settings.model_name} on http://{args.host}:{args.port}/v1 "
          f"({'API key required' if key else 'no API key'}; batches of up to {args.max_batch})", file=sys.stderr)
    server.run()
    return 0
