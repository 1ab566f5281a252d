"""Generation speed of attnlab's recurrent language models: tokens/s against transformers'
``generate`` with the same weights, and the time per generated token against the context length.

Part 1, ``tokens/s``: attnlab's Mamba, Mamba-2 and RWKV-4 against transformers'
MambaForCausalLM, Mamba2ForCausalLM and RwkvForCausalLM (their pure-PyTorch paths, with their
own caches). Each transformers model is built with its own initialisation, written with
``save_pretrained`` and loaded by ``attnlab.from_pretrained``, so both hold the same numbers.
Greedy, no EOS (every row runs to ``--new`` tokens), a random prompt of ``--prompt`` tokens, at
batch 1 and ``--batch``; the script asserts that both produce the same tokens before it times
them. tokens/s counts the generated tokens of all rows over the whole call (prefill included).

Part 2, ``ms per token against the context``: for attnlab's Mamba, Mamba-2, Mamba-3, RWKV-4 and
RWKV-7, and attnlab's GPT (SDPA attention, a KV cache) of the same width and depth, the time
between consecutive tokens of one ``generate`` call (stamped by its ``streamer``) after a prompt
of each ``--contexts`` length, batch 1: the median over ``--steps`` tokens, prefill excluded, the
best of ``--repeats`` such calls. A recurrent model's step reads a fixed-size state, so its time
should not move with the context; the GPT's step attends over a cache that grows by one row per
token.

Times are CPU seconds of one thread (``torch.set_num_threads(1)``, ``time.process_time``), the
contenders alternating in one process, best of ``--repeats`` calls: on a shared machine wall time
measures the other jobs. Sizes: d_model 256, 4 layers, vocabulary 96 (Mamba: state 16, expand 2;
Mamba-2: 8 heads of 64 channels, state 128; RWKV-4: d_ff 1024; RWKV-7 and Mamba-3: heads of 64;
GPT: 4 heads, d_ff 1024).

Usage:
  python benchmarks/ssm_generate.py --markdown
  python benchmarks/ssm_generate.py --markdown --parts context --contexts 128,4096
  python benchmarks/ssm_generate.py --quick          # tiny shapes, seconds (smoke test)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import render_table  # noqa: E402

import attnlab  # noqa: E402
from attnlab.models import GPT, GPTConfig  # noqa: E402
from attnlab.models.mamba3 import Mamba3, Mamba3Config  # noqa: E402
from attnlab.models.rwkv7 import RWKV7  # noqa: E402

VOCAB = 96


def _from_transformers(hf):
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return attnlab.from_pretrained(d).eval()


def hf_pairs(d_model: int, layers: int, quick: bool) -> dict:
    """family -> (attnlab model, transformers model) with the same weights."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    heads = 2 if quick else max(1, 2 * d_model // 64)
    configs = {
        "Mamba": (transformers.MambaForCausalLM, transformers.MambaConfig(
            vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers, state_size=16, expand=2, conv_kernel=4)),
        "Mamba-2": (transformers.Mamba2ForCausalLM, transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers, state_size=16 if quick else 128,
            expand=2, conv_kernel=4, head_dim=2 * d_model // heads, num_heads=heads, n_groups=1)),
        "RWKV-4": (transformers.RwkvForCausalLM, transformers.RwkvConfig(
            vocab_size=VOCAB, hidden_size=d_model, num_hidden_layers=layers, rescale_every=0)),
    }
    out = {}
    for name, (cls, config) in configs.items():
        hf = cls(config).eval()
        # no EOS: every row runs to max_new_tokens in both libraries
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        out[name] = (_from_transformers(hf), hf)
    return out


def context_models(d_model: int, layers: int, longest: int, pairs: dict) -> dict:
    """name -> attnlab model for part 2: the recurrent families and a GPT of the same size."""
    torch.manual_seed(0)
    heads = max(1, d_model // 64)
    return {
        "attnlab Mamba": pairs["Mamba"][0],
        "attnlab Mamba-2": pairs["Mamba-2"][0],
        "attnlab Mamba-3": Mamba3(Mamba3Config(vocab_size=VOCAB, d_model=d_model, num_layers=layers,
                                               headdim=min(64, 2 * d_model // heads))).eval(),
        "attnlab RWKV-4": pairs["RWKV-4"][0],
        "attnlab RWKV-7": RWKV7.for_kind("causal-lm").build(RWKV7.build_config(
            vocab_size=VOCAB, context=longest, d_model=d_model, num_heads=heads, num_layers=layers)).eval(),
        "attnlab GPT (SDPA, KV cache)": GPT(GPTConfig(vocab_size=VOCAB, n_positions=longest, d_model=d_model,
                                                      num_heads=4, num_layers=layers, dropout=0.0)).eval(),
    }


def cpu_best(fns: dict, repeats: int) -> dict:
    """name -> the least CPU seconds of ``repeats`` calls, the callables alternating (a, b, a, b)."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - t0)
    return best


def _hf_generate(hf, ids, new: int, rows_alone: bool = False):
    """transformers' greedy ``generate``; ``rows_alone``: one call per row, concatenated."""
    if rows_alone:
        return torch.cat([_hf_generate(hf, row[None], new) for row in ids])
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, num_beams=1)


@torch.no_grad()
def tokens_per_second(pairs: dict, prompt: int, new: int, batches: list[int], repeats: int) -> list[list]:
    """Part 1's rows: family, batch, attnlab and transformers tokens/s, and their ratio."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for family, (ours, hf) in pairs.items():
        for batch in batches:
            ids = torch.randint(0, VOCAB, (batch, prompt), generator=g)
            # transformers' RWKV step mixes the (b, C) token-shift state into (b, 1, C) inputs, which
            # broadcasts to (b, b, C) and gives wrong tokens at batch > 1: its rows run one at a time
            alone = family == "RWKV-4" and batch > 1
            a, b = ours.generate(ids, new), _hf_generate(hf, ids, new, alone)
            if not torch.equal(a, b):
                first = int((a != b).any(0).nonzero()[0]) - prompt
                raise SystemExit(f"{family}, batch {batch}: attnlab and transformers differ from new token {first}")
            t = cpu_best({"attnlab": lambda: ours.generate(ids, new), "transformers": lambda: _hf_generate(hf, ids, new, alone)},
                         repeats)
            rows.append([family, batch if not alone else f"{batch} (transformers row by row)", new, f"{batch * new / t['attnlab']:.0f}",
                         f"{batch * new / t['transformers']:.0f}", f"{t['transformers'] / t['attnlab']:.1f}"])
            print(f"# tokens/s {family} batch {batch}", file=sys.stderr, flush=True)
    return rows


def ms_per_token(model, ids, steps: int) -> float:
    """Median CPU ms between consecutive tokens of one greedy ``generate`` call (prefill excluded)."""
    stamps = []
    model.generate(ids, steps + 1, streamer=lambda column: stamps.append(time.process_time()))
    return 1e3 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


@torch.no_grad()
def per_context(models: dict, contexts: list[int], steps: int, repeats: int) -> dict:
    """name -> {context: best-of-``repeats`` median ms per token}. Each repeat visits every context
    and model in turn, so that a change in the machine's load spreads over all of them."""
    g = torch.Generator().manual_seed(1)
    prompts = {context: torch.randint(0, VOCAB, (1, context), generator=g) for context in contexts}
    out = {name: {} for name in models}
    for repeat in range(repeats):
        for context, ids in prompts.items():
            for name, model in models.items():
                ms = ms_per_token(model, ids, steps)
                out[name][context] = min(out[name].get(context, ms), ms)
        print(f"# ms per token: repeat {repeat + 1} of {repeats}", file=sys.stderr, flush=True)
    return out


def context_rows(times: dict, contexts: list[int]) -> list[list]:
    return [[name] + [f"{times[name][c]:.2f}" for c in contexts] + [f"{times[name][contexts[-1]] / times[name][contexts[0]]:.2f}"]
            for name in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__[__doc__.index("Usage"):])
    p.add_argument("--parts", default="tokens,context", help="tokens, context or both (default both)")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens in part 1 (default 16)")
    p.add_argument("--new", type=int, default=64, help="generated tokens per row in part 1 (default 64)")
    p.add_argument("--batch", type=int, default=4, help="the larger batch of part 1, beside batch 1 (default 4)")
    p.add_argument("--contexts", default="128,512,1024,2048,4096", help="prompt lengths of part 2")
    p.add_argument("--steps", type=int, default=64, help="tokens timed after each prompt in part 2 (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="calls per measurement, the best kept (default 3)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="tiny shapes and one call each (a smoke test)")
    p.add_argument("--markdown", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.d_model, a.layers, a.new, a.contexts, a.steps, a.repeats = 32, 2, 8, "16,64", 4, 1
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    contexts = [int(c) for c in a.contexts.split(",")]
    print(f"torch {torch.__version__}; CPU, 1 thread; fp32; CPU time of the one thread")
    pairs = hf_pairs(a.d_model, a.layers, a.quick)
    if "tokens" in a.parts:
        rows = tokens_per_second(pairs, a.prompt, a.new, sorted({1, a.batch}), a.repeats)
        print("\nsame tokens asserted; greedy; prompt", a.prompt)
        print(render_table(["family", "batch", "new tokens", "attnlab tokens/s", "transformers tokens/s",
                            "speed vs transformers"], rows, markdown=a.markdown))
    if "context" in a.parts:
        models = context_models(a.d_model, a.layers, max(contexts) + a.steps + 1, pairs)
        times = per_context(models, contexts, a.steps, a.repeats)
        print(f"\nms per generated token after a prompt of n tokens (batch 1, median of {a.steps} steps)")
        print(render_table(["model"] + [f"n={c}" for c in contexts] + [f"{contexts[-1]} / {contexts[0]}"],
                           context_rows(times, contexts), markdown=a.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
