"""Language-model speed: attnlab's GPT against transformers' GPT2LMHeadModel, with the same weights.

The reference is built first (``GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")``,
its own N(0, 0.02) initialisation with GPT-2's scaled residual projections, which keeps its CPU
backward free of denormals), written
with ``save_pretrained`` to a temporary directory and loaded by ``attnlab.from_pretrained``: both
models hold the same numbers, which the script checks (same loss and gradients, same logits)
before timing. All contenders of a table are timed in one process, round-robin (a, b, c, a, ...),
and compared by the ratio of their median times; the reference is timed twice (A/A) for the noise.

Sections (``--sections train,gen,int8``, default all):

  train  Training tokens/s, fp32: forward, cross-entropy (mean), backward, AdamW step,
         zero_grad(set_to_none=True). attnlab: the optimizer of attnlab.train.build_optimizer
         (what the Trainer uses); transformers: torch.optim.AdamW(model.parameters()) with its
         defaults (use_cache=False in its forward). An extra row runs attnlab with that same
         default AdamW, to split the optimizer's share from the model's.
         config 1: 6 layers, 6 heads, d_model 384, context 256, batch 8, vocabulary 96, dropout 0.
         config 2: GPT-2 small: 12 layers, 12 heads, 768, context 512, vocabulary 50304, batch 2.
  gen    Generation tokens/s, fp32, GPT-2 small shape (vocabulary 50257, random N(0, 0.02) weights),
         batch 1 and 8, 16-token prompts, 128 new tokens, greedy: attnlab model.generate(prompt,
         128) against transformers' model.generate(do_sample=False, max_new_tokens=128,
         min_new_tokens=128) (no EOS id in the config: neither stops early). attnlab's model goes
         through attnlab.nn.optimize_for_inference first, as in `attnlab generate` (its Linear
         layers run oneDNN's matmul when no gradient is needed); an extra row generates with the
         plain nn.Linear layers (--no-plain-row skips it). tokens/s = batch x 128
         / median seconds per generate call (prefill included). Bound: the memory-bandwidth limit
         of a decoding step, batch x bandwidth / bytes read per step (every weight but the
         embedding tables, plus the KV cache at its average length); the bandwidth is measured
         here by summing a 1 GiB fp32 tensor.
  int8   attnlab after attnlab.quantize.quantize_int8 (generate --quantize int8) at batch 1
         against transformers fp32 (added to the batch-1 generation table), and the perplexity
         change: a small GPT (4 layers, d_model 128, context 128, characters) is trained here for
         --ppl-steps steps on the Python standard library's source (attnlab's embedded LM corpus)
         and evaluated on its held-out files in fp32 and with each int8 kernel.

Usage:
  python benchmarks/lm.py --markdown                  # everything (about 15 minutes on 2 cores)
  python benchmarks/lm.py --quick                     # tiny shapes, seconds (smoke test)
  python benchmarks/lm.py --sections gen,int8 --threads 2
"""
from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, fmt_ms, render_table, step_rows, time_calls  # noqa: E402

import attnlab  # noqa: E402
from attnlab.nn import set_inference_dtype  # noqa: E402
from attnlab.nn.precision import native_bf16  # noqa: E402
from attnlab.quantize import model_bytes, quantize_int8  # noqa: E402
from attnlab.train import TrainConfig, build_optimizer  # noqa: E402

REF = "transformers GPT2LMHeadModel"
AA = " (A/A: again)"
AL = "attnlab GPT"
AL_UNFUSED = "attnlab GPT, default AdamW"
AL_ERF = "attnlab GPT, erf GELU (nanoGPT's activation)"
NANO = "nanoGPT-style GPT (erf GELU, nn.Linear, default AdamW)"
AL_PLAIN = "attnlab GPT, plain nn.Linear (InferenceLinear taken out)"
AL_BF16 = "attnlab GPT bf16 (from_pretrained(dtype=bfloat16))"
AL_COPY = "attnlab GPT, fp32 + bf16 weight copies (attnlab generate --dtype auto)"
REF_BF16 = "transformers GPT2LMHeadModel bf16"
AL_AMP = "attnlab GPT, bf16 autocast"
REF_AMP = "transformers GPT2LMHeadModel, bf16 autocast"
AL_INT8 = "attnlab GPT int8"
AL_FBGEMM = "attnlab GPT int8 (kernel=fbgemm, W8A8)"
PHASES = ("forward+loss", "backward", "optimizer")
TARGETS = {("train", 1): 1.25, ("train", 2): 1.10, ("gen", 1): 1.25, ("gen", 8): 1.50, ("int8", 1): 2.00,
           ("bf16", 1): 1.25, ("bf16", 8): 1.50, ("amp", 1): 1.30, ("amp", 2): 1.30}


@dataclass
class Shape:
    layers: int
    heads: int
    d_model: int
    context: int
    vocab: int
    batch: int


TRAIN_SHAPES = {1: Shape(6, 6, 384, 256, 96, 8), 2: Shape(12, 12, 768, 512, 50304, 2)}
QUICK_TRAIN_SHAPES = {1: Shape(2, 2, 64, 32, 96, 4), 2: Shape(2, 4, 128, 64, 512, 2)}


# --------------------------------------------------------------------------- the two models
def build_pair(shape: Shape, n_positions: int, dropout: float, tmp: str):
    """(attnlab GPT, transformers GPT2LMHeadModel) with the same weights, both in train mode."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    config = transformers.GPT2Config(vocab_size=shape.vocab, n_positions=n_positions, n_embd=shape.d_model,
                                      n_layer=shape.layers, n_head=shape.heads, resid_pdrop=dropout,
                                      embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=None, eos_token_id=None)
    hf = transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    hf.save_pretrained(tmp)
    al = attnlab.from_pretrained(tmp)
    assert sum(p.numel() for p in al.parameters()) == sum(p.numel() for p in hf.parameters())
    return al.train(), hf.train()


class NanoStyleGPT(nn.Module):
    """The model nanoGPT trains, written here from its description (not its code): GPT-2's layout
    with nn.Linear layers, a fused SDPA with is_causal, LayerNorm with bias, the head tied to the
    token embedding, and nn.GELU() with erf where GPT-2 (and transformers, and attnlab's GPT) use
    the tanh approximation. ``approximate="tanh"`` makes it GPT-2 exactly (the parity check)."""

    def __init__(self, hf, approximate: str = "none"):
        super().__init__()
        c, t = hf.config, hf.transformer
        self.heads = c.n_head
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.n_positions, c.n_embd)
        self.wte.weight.data.copy_(t.wte.weight)
        self.wpe.weight.data.copy_(t.wpe.weight)

        def linear(conv1d) -> nn.Linear:                 # transformers' Conv1D stores (in, out)
            lin = nn.Linear(*conv1d.weight.shape)
            lin.weight.data.copy_(conv1d.weight.T)
            lin.bias.data.copy_(conv1d.bias)
            return lin

        def norm(ln) -> nn.LayerNorm:
            out = nn.LayerNorm(c.n_embd, eps=c.layer_norm_epsilon)
            out.load_state_dict(ln.state_dict())
            return out

        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=norm(b.ln_1), c_attn=linear(b.attn.c_attn), attn_proj=linear(b.attn.c_proj), ln_2=norm(b.ln_2),
            c_fc=linear(b.mlp.c_fc), gelu=nn.GELU(approximate=approximate), mlp_proj=linear(b.mlp.c_proj)))
            for b in t.h)
        self.ln_f = norm(t.ln_f)
        self.lm_head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: Tensor) -> Tensor:
        B, T = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(T, device=ids.device))
        for b in self.blocks:
            q, k, v = b.c_attn(b.ln_1(x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(B, T, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b.attn_proj(y.transpose(1, 2).reshape(B, T, -1))
            x = x + b.mlp_proj(b.gelu(b.c_fc(b.ln_2(x))))
        return self.lm_head(self.ln_f(x))


def build_nano_style(hf, x: Tensor, y: Tensor) -> NanoStyleGPT:
    """NanoStyleGPT with transformers' weights: checked equal to it with tanh GELU, returned with erf."""
    nano = NanoStyleGPT(hf, approximate="tanh")
    with torch.no_grad():
        ln = F.cross_entropy(nano(x).flatten(0, 1), y.flatten())
        lh = F.cross_entropy(hf_logits(hf.eval(), x).flatten(0, 1), y.flatten())
    hf.train()
    torch.testing.assert_close(ln, lh, atol=1e-4, rtol=1e-4)
    for b in nano.blocks:
        b.gelu.approximate = "none"
    return nano.train()


def hf_logits(hf, x: Tensor) -> Tensor:
    return hf(input_ids=x, use_cache=False).logits


def check_train_parity(al, hf, x: Tensor, y: Tensor) -> str:
    """Same loss and gradients with dropout off; returns a one-line summary."""
    al.eval()
    hf.eval()
    la = F.cross_entropy(al(x).flatten(0, 1), y.flatten())
    lh = F.cross_entropy(hf_logits(hf, x).flatten(0, 1), y.flatten())
    la.backward()
    lh.backward()
    torch.testing.assert_close(la, lh, atol=1e-4, rtol=1e-4)
    pairs = [("tied embedding/head", al.token_embedding.weight.grad, hf.transformer.wte.weight.grad),
             ("first qkv", al.layers[0].self_attn.qkv_proj.weight.grad, hf.transformer.h[0].attn.c_attn.weight.grad.T),
             ("last MLP out", al.layers[-1].ff.linear2.weight.grad, hf.transformer.h[-1].mlp.c_proj.weight.grad.T)]
    worst = 0.0
    for name, a, r in pairs:
        scale = r.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(a / scale, r / scale, atol=1e-4, rtol=1e-3,
                                   msg=lambda m: f"{name} gradient differs: {m}")
        worst = max(worst, float((a - r).abs().max() / scale))
    al.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    al.train()
    hf.train()
    return f"loss {float(lh.detach()):.4f} on both; largest gradient difference {worst:.1e} of the gradient's max"


def make_train_step(forward, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, phases: dict, autocast: bool = False):
    """One training step; ``autocast``: forward and loss under torch.autocast("cpu", bfloat16), as the
    Trainer runs them with --precision bf16 (fp32 weights, gradients and optimizer)."""
    def step():
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(forward(x).flatten(0, 1).float(), y.flatten())
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            phases[name].append(dt)
    return step


# --------------------------------------------------------------------------- reporting
def judge(ratio: float, best_ratio: float, aa: float | None, target: float) -> str:
    noise = abs(aa - 1.0) if aa is not None else 0.0
    return "met" if ratio >= target else "within noise" if max(best_ratio, ratio + noise) >= target else "MISSED"


def print_table(title: str, headers, rows, markdown: bool) -> None:
    print(("**" + title + "**" if markdown else title) + "\n")
    print(render_table(headers, rows, markdown))
    print()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# --------------------------------------------------------------------------- train
def train_setup(args, s: Shape, cfg: int):
    """(timed steps, attnlab model, transformers model with the same weights, inputs, targets) for config ``cfg``."""
    steps = args.steps if cfg == 1 else max(3, args.steps // 2)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        al, hf = build_pair(s, s.context, args.dropout, tmp)
    g = torch.Generator().manual_seed(cfg)
    w = torch.randint(0, s.vocab, (s.batch, s.context + 1), generator=g)
    return steps, al, hf, w[:, :-1].contiguous(), w[:, 1:].contiguous()


def run_train(args, shapes: dict[int, Shape], verdicts: list[str]) -> None:
    for cfg in args.configs:
        s = shapes[cfg]
        steps, al, hf, x, y = train_setup(args, s, cfg)
        n_params = sum(p.numel() for p in al.parameters())
        print(f"## train, config {cfg}: {s.layers} layers, {s.heads} heads, d_model {s.d_model}, context {s.context}, "
              f"vocabulary {s.vocab}, batch {s.batch}, dropout {args.dropout}; {n_params:,} parameters (head tied)")
        print(f"# same weights, dropout off: {check_train_parity(al, hf, x, y)}")
        al_opt = build_optimizer(al, TrainConfig(out_dir="unused", steps=1))
        hf_opt = torch.optim.AdamW(hf.parameters())
        print(f"# attnlab optimizer: build_optimizer -> AdamW(fused={al_opt.defaults.get('fused')}); reference: "
              "AdamW defaults (torch's per-parameter for-loop on CPU)")
        nano_rows = cfg == 1 and not args.no_nanogpt_rows
        names = ([AL, REF] + ([] if args.no_unfused_row else [AL_UNFUSED]) + ([AL_ERF, NANO] if nano_rows else [])
                 + ([] if args.no_aa else [REF + AA]))
        phases = {n: {p: [] for p in PHASES} for n in names}
        fns = {AL: make_train_step(al, al_opt, x, y, phases[AL]),
               REF: make_train_step(lambda t: hf_logits(hf, t), hf_opt, x, y, phases[REF])}
        if not args.no_unfused_row:
            al2 = copy.deepcopy(al)
            opt2 = torch.optim.AdamW(al2.parameters())
            fns[AL_UNFUSED] = make_train_step(al2, opt2, x, y, phases[AL_UNFUSED])
        if nano_rows:
            al_erf = copy.deepcopy(al)
            for layer in al_erf.layers:
                layer.ff.act = nn.GELU()
            fns[AL_ERF] = make_train_step(al_erf, build_optimizer(al_erf, TrainConfig(out_dir="unused", steps=1)),
                                          x, y, phases[AL_ERF])
            nano = build_nano_style(hf, x, y)
            fns[NANO] = make_train_step(nano, torch.optim.AdamW(nano.parameters()), x, y, phases[NANO])
            print("# nanoGPT-style model: same weights as transformers' (loss equal to 1e-4 with tanh GELU), timed "
                  "with erf GELU and torch's default AdamW (nanoGPT fuses AdamW only on CUDA)")
        if not args.no_aa:
            fns[REF + AA] = make_train_step(lambda t: hf_logits(hf, t), hf_opt, x, y, phases[REF + AA])
        fns = {n: fns[n] for n in names}
        timings = time_calls(fns, warmup=args.warmup, repeats=steps, min_repeats=steps, budget_s=0.0)
        for n in names:
            for p in PHASES:
                phases[n][p] = phases[n][p][-timings[n].n:]
        rows = step_rows(names, timings, REF, s.batch * s.context, phases, PHASES)
        ref_t, ref_best = timings[REF].median, min(timings[REF].times)
        print(f"# load average now: {load()}\n")
        print_table(f"Training step, config {cfg}; speed ratio = tokens/s / tokens/s of {REF}",
                    ["implementation", "median ms/step", "min ms/step", "steps", "tokens/s", "speed ratio",
                     "min-time speed ratio"] + [f"{p} ms" for p in PHASES], rows, args.markdown)
        aa = None if args.no_aa else ref_t / timings[REF + AA].median
        ratio, best = ref_t / timings[AL].median, ref_best / min(timings[AL].times)
        verdicts.append(f"train config {cfg}: attnlab >= {TARGETS[('train', cfg)]:.2f} x transformers tokens/s: "
                        f"{judge(ratio, best, aa, TARGETS[('train', cfg)])} (speed ratio {ratio:.2f}, min-time "
                        f"{best:.2f}" + (f", A/A {aa:.2f})" if aa is not None else ")"))


def run_train_amp(args, shapes: dict[int, Shape], verdicts: list[str]) -> None:
    """Training under bf16 autocast, attnlab against transformers under the same autocast."""
    for cfg in args.configs:
        s = shapes[cfg]
        steps, al, hf, x, y = train_setup(args, s, cfg)
        print(f"## train under bf16 autocast (torch.autocast('cpu', bfloat16) around forward and loss, fp32 weights "
              f"and AdamW on both sides), config {cfg}: {s.layers} layers, {s.heads} heads, d_model {s.d_model}, "
              f"context {s.context}, vocabulary {s.vocab}, batch {s.batch}; {native_bf16('cpu')[1]}")
        names = [AL_AMP, REF_AMP] + ([] if args.no_aa else [REF_AMP + AA])
        phases = {n: {p: [] for p in PHASES} for n in names}
        al_opt = build_optimizer(al, TrainConfig(out_dir="unused", steps=1))
        hf_opt = torch.optim.AdamW(hf.parameters())
        fns = {AL_AMP: make_train_step(al, al_opt, x, y, phases[AL_AMP], autocast=True),
               REF_AMP: make_train_step(lambda t: hf_logits(hf, t), hf_opt, x, y, phases[REF_AMP], autocast=True)}
        if not args.no_aa:
            fns[REF_AMP + AA] = make_train_step(lambda t: hf_logits(hf, t), hf_opt, x, y, phases[REF_AMP + AA],
                                                autocast=True)
        timings = time_calls(fns, warmup=args.warmup, repeats=steps, min_repeats=steps, budget_s=0.0)
        for n in names:
            for p in PHASES:
                phases[n][p] = phases[n][p][-timings[n].n:]
        rows = step_rows(names, timings, REF_AMP, s.batch * s.context, phases, PHASES)
        print(f"# load average now: {load()}\n")
        print_table(f"Training step, config {cfg}, bf16 autocast; speed ratio = tokens/s / tokens/s of {REF_AMP}",
                    ["implementation", "median ms/step", "min ms/step", "steps", "tokens/s", "speed ratio",
                     "min-time speed ratio"] + [f"{p} ms" for p in PHASES], rows, args.markdown)
        aa = None if args.no_aa else timings[REF_AMP].median / timings[REF_AMP + AA].median
        ratio = timings[REF_AMP].median / timings[AL_AMP].median
        best = min(timings[REF_AMP].times) / min(timings[AL_AMP].times)
        target = TARGETS[("amp", cfg)]
        verdicts.append(f"train config {cfg}, bf16 autocast: attnlab >= {target:.2f} x transformers (same autocast): "
                        f"{judge(ratio, best, aa, target)} (speed ratio {ratio:.2f}, min-time {best:.2f}"
                        + (f", A/A {aa:.2f})" if aa is not None else ")"))


# --------------------------------------------------------------------------- gen and int8
def measure_bandwidth(nbytes: int) -> float:
    """Bytes per second read by summing an fp32 tensor of ``nbytes`` (median of 5)."""
    x = torch.ones(nbytes // 4)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def bytes_per_step(model, batch: int, kv_positions: float) -> float:
    """Bytes a decoding step reads: every parameter and buffer except the embedding tables (a token
    reads one row; a head tied to the table is counted, through the head), plus the KV cache. A
    Linear layer computing from a bf16 weight copy (set_inference_dtype) reads the copy instead."""
    from attnlab.nn import InferenceLinear
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    copies = {id(m.weight): m.compute_dtype.itemsize for m in model.modules()
              if isinstance(m, InferenceLinear) and m.compute_dtype is not None}
    tables = {id(model.token_embedding.weight), id(model.position_embedding.weight)} - linear
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen and id(t) not in tables:
            seen.add(id(t))
            total += t.numel() * copies.get(id(t), t.element_size())
    c = model.config
    act = next(model.parameters()).element_size()            # the KV cache holds the activations' dtype
    kv = batch * kv_positions * c.num_layers * 2 * c.d_model * act
    return total + kv


def run_gen(args, sections: set[str], verdicts: list[str]) -> None:
    """Greedy generation: the plain from_pretrained + generate path, fp32 and bf16, against transformers
    in the same dtype (and int8 at batch 1)."""
    import transformers
    s = args.gen_shape
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        al, hf = build_pair(s, s.context, 0.0, tmp)          # al = attnlab.from_pretrained(tmp): nothing else
        bf16 = "gen" in sections and not args.no_bf16
        if bf16:
            al16 = attnlab.from_pretrained(tmp, dtype=torch.bfloat16)
            hf16 = transformers.GPT2LMHeadModel.from_pretrained(tmp, dtype=torch.bfloat16,
                                                                attn_implementation="sdpa").eval()
    al.eval()
    hf.eval()
    plain = None
    if not args.no_plain_row:                               # the same weights in plain nn.Linear layers
        plain = type(al)(al.config).eval()
        plain.load_state_dict(al.state_dict())
    copies = set_inference_dtype(copy.deepcopy(al), torch.bfloat16) if bf16 else None
    bw = measure_bandwidth(args.bandwidth_bytes)
    P, N = args.prompt, args.new_tokens
    print(f"## generation: {s.layers} layers, {s.heads} heads, d_model {s.d_model}, vocabulary {s.vocab}, random "
          f"N(0, 0.02) weights, prompt {P}, {N} new tokens, greedy; attnlab: attnlab.from_pretrained(dir) + "
          f"model.generate (no other call); int8 rows: quantize_int8; {native_bf16('cpu')[1]}")
    print(f"# memory bandwidth (sum of a {args.bandwidth_bytes / 2**30:.2f} GiB fp32 tensor, "
          f"{torch.get_num_threads()} threads): {bw / 1e9:.1f} GB/s")
    int8 = quantize_int8(copy.deepcopy(al)) if "int8" in sections else None
    fbgemm = quantize_int8(copy.deepcopy(al), kernel="fbgemm") if "int8" in sections and not args.no_fbgemm else None
    if int8 is not None:
        print(f"# weights: fp32 {model_bytes(al) / 2**20:.0f} MiB, int8 {model_bytes(int8) / 2**20:.0f} MiB "
              f"(-{1 - model_bytes(int8) / model_bytes(al):.0%}; the fp32 token embedding stays, the tied head gets "
              "an int8 copy; kernel=fbgemm adds its own packed copy, about +1.4 bytes per quantised weight)")
    batches = args.batches if "gen" in sections else [1]
    for B in batches:
        g = torch.Generator().manual_seed(B)
        prompt = torch.randint(0, s.vocab, (B, P), generator=g)
        mask = torch.ones_like(prompt)
        outs = {}

        def gen(model, key):
            def call():
                outs[key] = model.generate(prompt, N)
            return call

        def hf_gen(model, key):
            @torch.no_grad()
            def call():
                outs[key] = model.generate(prompt, attention_mask=mask, do_sample=False, max_new_tokens=N,
                                           min_new_tokens=N, pad_token_id=0)
            return call

        with torch.no_grad():                                # same logits at the prompt's last position
            torch.testing.assert_close(al(prompt)[:, -1], hf(prompt).logits[:, -1], atol=1e-3, rtol=1e-3)
        tables = [("fp32", REF, {AL: gen(al, AL), REF: hf_gen(hf, REF)})]
        if plain is not None:
            tables[0][2][AL_PLAIN] = gen(plain, AL_PLAIN)
        if B == 1 and int8 is not None:
            tables[0][2][AL_INT8] = gen(int8, AL_INT8)
            if fbgemm is not None:
                tables[0][2][AL_FBGEMM] = gen(fbgemm, AL_FBGEMM)
        if bf16:
            tables.append(("bf16", REF_BF16, {AL_BF16: gen(al16, AL_BF16), AL_COPY: gen(copies, AL_COPY),
                                              REF_BF16: hf_gen(hf16, REF_BF16)}))
        for dtype, ref, fns in tables:
            if not args.no_aa:
                fns[ref + AA] = hf_gen(hf if dtype == "fp32" else hf16, ref + AA)
            models = {AL: al, AL_PLAIN: plain, AL_INT8: int8, AL_FBGEMM: fbgemm, AL_COPY: copies}
            if bf16:
                models.update({AL_BF16: al16, REF_BF16: al16})
            gen_table(args, sections, verdicts, B, dtype, ref, fns, outs, models, bw)


def gen_table(args, sections: set[str], verdicts: list[str], B: int, dtype: str, ref: str, fns: dict, outs: dict,
              models: dict, bw: float) -> None:
    """Time one generation table round-robin, print it and add its verdicts (``models``: each row's
    model, for the bytes a step reads; transformers' rows read what attnlab's of the same dtype do)."""
    P, N = args.prompt, args.new_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        timings = time_calls(fns, warmup=1, repeats=args.gen_repeats, min_repeats=min(3, args.gen_repeats),
                             budget_s=args.gen_budget)
    for key in fns:
        assert outs[key].shape == (B, P + N), (key, tuple(outs[key].shape))
    kv_avg = P + N / 2
    ref_t, ref_best = timings[ref].median, min(timings[ref].times)
    rows = []
    for name, t in timings.items():
        model = models.get(name.removesuffix(AA), models[AL])
        bound = B * bw / bytes_per_step(model, B, kv_avg)
        tps = B * N / t.median
        agree = f"{float((outs[name][:, P:] == outs[AL][:, P:]).float().mean()):.2f}"
        rows.append([name, fmt_ms(t.median), fmt_ms(min(t.times)), t.n, f"{tps:.1f}", f"{ref_t / t.median:.2f}",
                     f"{ref_best / min(t.times):.2f}", f"{bound:.1f}", f"{tps / bound:.0%}", agree])
    same = float((outs[AL if dtype == "fp32" else AL_BF16][:, P:] == outs[ref][:, P:]).float().mean())
    print(f"# batch {B}, {dtype}: greedy tokens identical to transformers' ({dtype}) in {same:.1%} of the "
          f"{B * N} positions; load average now: {load()}\n")
    print_table(f"Generation, batch {B}, {dtype}; speed ratio = tokens/s / tokens/s of {ref}",
                ["implementation", "median ms/call", "min ms/call", "calls", "tokens/s", "speed ratio",
                 "min-time speed ratio", "bound tokens/s", "share of bound", "same tokens as attnlab fp32"],
                rows, args.markdown)
    aa = None if args.no_aa else ref_t / timings[ref + AA].median
    judged = ([(AL, ("gen", B))] if dtype == "fp32" and "gen" in sections else []) + \
        ([(AL_INT8, ("int8", B))] if dtype == "fp32" else []) + \
        ([(AL_BF16, ("bf16", B)), (AL_COPY, ("bf16", B))] if dtype == "bf16" else [])
    for name, key in judged:
        if name in timings and key in TARGETS:
            ratio, best = ref_t / timings[name].median, ref_best / min(timings[name].times)
            verdicts.append(f"{key[0]} batch {B}: {name} >= {TARGETS[key]:.2f} x {ref} tokens/s: "
                            f"{judge(ratio, best, aa, TARGETS[key])} (speed ratio {ratio:.2f}, min-time "
                            f"{best:.2f}" + (f", A/A {aa:.2f})" if aa is not None else ")"))


def run_perplexity(args) -> None:
    """Train a small character-level GPT on the stdlib corpus; held-out perplexity fp32 vs int8."""
    from attnlab.data.text import encode_documents, stdlib_corpus
    from attnlab.tasks.lm import LanguageModelTask
    from attnlab.models import GPT, GPTConfig
    from attnlab.tokenizer import CharTokenizer

    corpus = stdlib_corpus(args.ppl_corpus_bytes)
    tok = CharTokenizer.train(corpus.train, 128)
    train_ids = encode_documents(tok, corpus.train, corpus.eos_between)
    valid_ids = encode_documents(tok, corpus.valid, corpus.eos_between)
    torch.manual_seed(0)
    ctx, d = args.ppl_context, args.ppl_d_model
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_positions=ctx, d_model=d, num_heads=4,
                          num_layers=args.ppl_layers, dropout=0.0))
    task = LanguageModelTask(model, tok, train_ids, valid_ids, context=ctx, batch_size=16, eval_windows=64)
    opt = build_optimizer(model, TrainConfig(out_dir="unused", steps=args.ppl_steps, lr=2e-3))
    plan = task.plan(0, 0)
    t0 = time.perf_counter()
    model.train()
    for i in range(args.ppl_steps):
        loss, n, _ = task.loss(model, plan[i % len(plan)])
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    train_s = time.perf_counter() - t0
    ppl = task.evaluate(model)["val_ppl"]
    starts = task.eval_starts()[:8]
    P = min(16, ctx // 4)
    new = min(32, ctx - P)
    prompts = task.windows(task.valid_ids, starts)[0][:, :P]
    ref_gen = model.generate(prompts, new)
    rows = [["fp32", f"{ppl:.4f}", "", "1.00"]]
    for label, kernel in (("int8, kernel=auto (teacher-forced windows: the exact dequant path)", "auto"),
                          ("int8, kernel=int8pack (bf16 activations)", "int8pack"),
                          ("int8, kernel=fbgemm (W8A8, 7-bit activations)", "fbgemm")):
        if kernel == "fbgemm" and args.no_fbgemm:
            continue
        q = quantize_int8(copy.deepcopy(model), kernel=kernel)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ppl_q = task.evaluate(q)["val_ppl"]
            same = float((q.generate(prompts, new)[:, P:] == ref_gen[:, P:]).float().mean())
        rows.append([label, f"{ppl_q:.4f}", f"{(ppl_q / ppl - 1) * 100:+.2f} %", f"{same:.2f}"])
    print(f"## int8 perplexity: GPT {args.ppl_layers} layers, d_model {d}, context {ctx}, {tok.vocab_size} characters, "
          f"trained {args.ppl_steps} steps ({train_s:.0f} s) on {len(train_ids):,} characters of the stdlib corpus; "
          f"held out: {len(valid_ids):,} characters, {len(task.eval_starts())} windows of {ctx}\n")
    print_table("Held-out perplexity, fp32 vs int8 weights (same trained model)",
                ["weights", "perplexity", "change", f"greedy tokens as fp32 (8 prompts x {new})"], rows, args.markdown)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python benchmarks/lm.py --sections gen --markdown")
    p.add_argument("--sections", default="train,amp,gen,int8",
                   help="comma-separated: train, amp (training under bf16 autocast), gen, int8 (default all)")
    p.add_argument("--configs", default="1,2", help="training configs to run (default 1,2)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps per contender, config 1 "
                   "(config 2: half, at least 3; default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps per contender first (default 2)")
    p.add_argument("--dropout", type=float, default=0.0, help="training dropout on both sides (default 0.0)")
    p.add_argument("--gen-repeats", type=int, default=5, help="timed generate calls per contender at most (default 5)")
    p.add_argument("--gen-budget", type=float, default=40.0,
                   help="seconds of timed calls per contender that set their number (default 40)")
    p.add_argument("--batches", default="1,8", help="generation batch sizes (default 1,8)")
    p.add_argument("--ppl-steps", type=int, default=400, help="training steps of the perplexity model (default 400)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--no-aa", action="store_true", help="skip the A/A control (the reference timed twice)")
    p.add_argument("--no-unfused-row", action="store_true", help="skip attnlab with the default AdamW")
    p.add_argument("--no-nanogpt-rows", action="store_true", help="skip config 1's nanoGPT-style model and "
                   "attnlab with erf GELU")
    p.add_argument("--no-plain-row", action="store_true", help="skip attnlab generating with plain nn.Linear layers "
                   "(what from_pretrained gave before it applied attnlab.nn.optimize_for_inference)")
    p.add_argument("--no-fbgemm", action="store_true", help="skip the int8 kernel=fbgemm rows")
    p.add_argument("--no-bf16", action="store_true", help="skip the bf16 generation tables")
    p.add_argument("--quick", action="store_true", help="tiny shapes, seconds (smoke test)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for benchmarks/README.md)")
    args = p.parse_args(argv)

    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections or sections - {"train", "amp", "gen", "int8"}:
        p.error(f"--sections: choose among train, amp, gen, int8, got {args.sections!r}")
    try:
        args.configs = [int(c) for c in args.configs.split(",")]
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        p.error("--configs and --batches take comma-separated integers")
    if set(args.configs) - {1, 2} or any(b < 1 for b in args.batches):
        p.error("--configs: 1 and/or 2; --batches: positive integers")
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = TRAIN_SHAPES
    args.gen_shape, args.prompt, args.new_tokens = Shape(12, 12, 768, 1024, 50257, 1), 16, 128
    args.bandwidth_bytes = 1 << 30
    args.ppl_corpus_bytes, args.ppl_context, args.ppl_d_model, args.ppl_layers = 1_000_000, 128, 128, 4
    if args.quick:
        shapes = QUICK_TRAIN_SHAPES
        args.steps, args.warmup = min(args.steps, 3), 1
        args.gen_shape, args.prompt, args.new_tokens = Shape(2, 4, 128, 64, 512, 1), 8, 16
        args.batches = [1, 2]
        args.gen_repeats, args.gen_budget = 3, 0.5
        args.bandwidth_bytes = 1 << 25
        args.ppl_steps, args.ppl_corpus_bytes, args.ppl_context, args.ppl_d_model, args.ppl_layers = \
            20, 60_000, 32, 64, 1

    print(f"# language-model benchmark, {datetime.date.today().isoformat()}: {environment('cpu', torch.float32)}; "
          f"transformers {__import__('transformers').__version__}")
    print(f"# load average at start (1/5/15 min): {load()}")
    verdicts: list[str] = []
    if "train" in sections:
        run_train(args, shapes, verdicts)
    native, why = native_bf16("cpu")
    if "amp" in sections and not native:     # torch's bf16 kernels are missing below AVX-512
        print(f"# amp section skipped: {why}")
    elif "amp" in sections:
        run_train_amp(args, shapes, verdicts)
    if not native:
        args.no_bf16 = True
    if sections & {"gen", "int8"}:
        run_gen(args, sections, verdicts)
    if "int8" in sections:
        run_perplexity(args)
    print(f"# load average at end (1/5/15 min): {load()}\n")
    print("Targets (judged on the median speed ratio; \"within noise\": missed by the median but met by the "
          "min-time ratio or by less than the A/A control differs from 1.00):")
    for v in verdicts:
        print(f"- {v}" + (" [not judged at the --quick shape]" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
