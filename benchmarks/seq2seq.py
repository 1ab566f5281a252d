"""Seq2seq training speed: attnlab's Transformer against torch.nn.Transformer.

One training step, timed as a whole, on the same batch for both contenders:
forward, label-smoothed cross-entropy (0.1, padding ignored), backward, gradient clipping
(global norm 1.0) and an AdamW step (then zero_grad(set_to_none=True)).

  attnlab       attnlab.models.Transformer, called as attnlab.tasks.translate.TranslationTask.loss
                calls it: model(src, tgt_in, src_key_padding_mask=src_mask),
                attnlab.train.label_smoothed_cross_entropy (sum); the gradients are then scaled by
                1 / target tokens as the Trainer does, and the optimizer is
                attnlab.train.build_optimizer's (what the Trainer uses).
  torch         embeddings * sqrt(d_model) + sinusoidal positions + dropout, torch.nn.Transformer
                (batch_first=True, causal float tgt_mask from generate_square_subsequent_mask and
                tgt_is_causal=True, src/memory key padding masks) and an output nn.Linear;
                F.cross_entropy(label_smoothing=0.1, ignore_index=pad) (mean);
                torch.optim.AdamW(model.parameters()) with its defaults (torch then picks its
                per-parameter for-loop implementation on CPU, foreach on CUDA).
                                                                              <- ratio 1.00
Default shape: d_model 512, 8 heads, 6 + 6 layers, d_ff 2048, dropout 0.1, batch 16,
source and target length 32, vocabulary 8000 on both sides, fp32. Embeddings and output
projection are not tied. torch.nn.Transformer always has a final LayerNorm after each
stack, so attnlab is built with final_norm=True: both models then compute the same function
with the same parameter count (asserted). Both are initialised alike: attnlab's
reset_parameters (xavier-uniform for every matrix, embeddings included) and the same
weights copied into the reference; before timing, the script checks that both give the
same logits, loss and gradients (dropout off). A N(0, 1) embedding init would make a
model artificially slow on CPU through denormals (huge logits from an N(0, 1) embedding
tied to the output make the backward pass fill with denormal floats).

Usage:
  python benchmarks/seq2seq.py                   # the default shape on CPU, 10 timed steps each
  python benchmarks/seq2seq.py --quick           # tiny shape, a few seconds (smoke test)
  python benchmarks/seq2seq.py --steps 5 --markdown

Reported: median seconds per step over the timed steps (after warm-up steps), target
tokens per second (real, non-padding target tokens of the batch / median step time), the
ratio to torch.nn.Transformer, and the median time of each phase of the step.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import environment, render_table, step_rows, sync, time_calls  # noqa: E402

from attnlab.models import Transformer  # noqa: E402
from attnlab.train import TrainConfig, build_optimizer, label_smoothed_cross_entropy, param_groups  # noqa: E402

PAD, BOS = 0, 1
REF = "torch nn.Transformer"
AA = " (A/A: again)"
ATTNLAB = "attnlab Transformer"
ATTNLAB_OLD = "attnlab Transformer, unfused AdamW"
TARGET = 1.10            # the issue: attnlab tokens/s >= 1.1 x torch.nn.Transformer's
PHASES = ("forward+loss", "backward", "grad scale+clip", "optimizer")


# --------------------------------------------------------------------------- the reference

def sinusoids(max_len: int, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...), as the paper writes it."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    div = torch.pow(10000.0, torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(pos / div)
    pe[:, 1::2] = torch.cos(pos / div)
    return pe.float()


class TorchSeq2Seq(nn.Module):
    """Embeddings + positions around torch.nn.Transformer, as the PyTorch tutorials build it."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, d_ff: int, dropout: float,
                 max_len: int = 512):
        super().__init__()
        self.d_model = d_model
        self.src_emb = nn.Embedding(vocab, d_model)
        self.tgt_emb = nn.Embedding(vocab, d_model)
        self.register_buffer("pe", sinusoids(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, d_ff, dropout, batch_first=True)
        self.out = nn.Linear(d_model, vocab)
        for p in self.parameters():          # xavier everywhere, as attnlab (and nn.Transformer itself)
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def embed(self, ids: Tensor, emb: nn.Embedding) -> Tensor:
        return self.dropout(emb(ids) * math.sqrt(self.d_model) + self.pe[: ids.size(1)])

    def forward(self, src: Tensor, tgt: Tensor, src_key_padding_mask: Tensor, tgt_mask: Tensor) -> Tensor:
        h = self.transformer(self.embed(src, self.src_emb), self.embed(tgt, self.tgt_emb), tgt_mask=tgt_mask,
                             src_key_padding_mask=src_key_padding_mask,
                             memory_key_padding_mask=src_key_padding_mask, tgt_is_causal=True)
        return self.out(h)


def copy_weights(al: Transformer, ref: TorchSeq2Seq) -> None:
    """Load attnlab's weights into the reference (q/k/v rows concatenated into in_proj)."""
    def lin(dst: nn.Linear, src: nn.Linear):
        dst.weight.copy_(src.weight)
        dst.bias.copy_(src.bias)

    def mha(dst: nn.MultiheadAttention, src):
        dst.in_proj_weight.copy_(torch.cat([src.q_proj.weight, src.k_proj.weight, src.v_proj.weight]))
        dst.in_proj_bias.copy_(torch.cat([src.q_proj.bias, src.k_proj.bias, src.v_proj.bias]))
        lin(dst.out_proj, src.out_proj)

    with torch.no_grad():
        ref.src_emb.weight.copy_(al.src_embedding.weight)
        ref.tgt_emb.weight.copy_(al.tgt_embedding.weight)
        lin(ref.out, al.output_projection)
        for d, s in zip(ref.transformer.encoder.layers, al.encoder_layers):
            mha(d.self_attn, s.self_attn)
            lin(d.linear1, s.ff.linear1)
            lin(d.linear2, s.ff.linear2)
            lin(d.norm1, s.self_attn_norm)
            lin(d.norm2, s.ff_norm)
        for d, s in zip(ref.transformer.decoder.layers, al.decoder_layers):
            mha(d.self_attn, s.self_attn)
            mha(d.multihead_attn, s.cross_attn)
            lin(d.linear1, s.ff.linear1)
            lin(d.linear2, s.ff.linear2)
            lin(d.norm1, s.self_attn_norm)
            lin(d.norm2, s.cross_attn_norm)
            lin(d.norm3, s.ff_norm)
        lin(ref.transformer.encoder.norm, al.encoder_norm)
        lin(ref.transformer.decoder.norm, al.decoder_norm)


# --------------------------------------------------------------------------- the data

def make_batch(B: int, S: int, T: int, vocab: int, seed: int = 0) -> dict:
    """Random ids with padding: source lengths in [3/4 S, S], target lengths in [7/8 T, T]."""
    g = torch.Generator().manual_seed(seed)
    src_len = torch.randint(max(1, (3 * S) // 4), S + 1, (B,), generator=g)
    tgt_len = torch.randint(max(1, (7 * T) // 8), T + 1, (B,), generator=g)
    src_len[0], tgt_len[0] = S, T                                     # the batch spans the full lengths
    src_mask = torch.arange(S)[None, :] < src_len[:, None]            # True = real token (attnlab)
    tgt_real = torch.arange(T)[None, :] < tgt_len[:, None]
    src = torch.randint(3, vocab, (B, S), generator=g).masked_fill(~src_mask, PAD)
    tgt_out = torch.randint(3, vocab, (B, T), generator=g).masked_fill(~tgt_real, PAD)
    tgt_in = torch.cat([torch.full((B, 1), BOS), tgt_out[:, :-1]], dim=1).masked_fill(~tgt_real, PAD)
    return dict(src=src, src_mask=src_mask, tgt_in=tgt_in, tgt_out=tgt_out, num_tokens=int(tgt_real.sum()))


# --------------------------------------------------------------------------- the steps

def attnlab_parts(model: Transformer, opt: torch.optim.Optimizer, batch: dict, clip: float):
    n = batch["num_tokens"]

    def loss():
        logits = model(batch["src"], batch["tgt_in"], src_key_padding_mask=batch["src_mask"])
        return label_smoothed_cross_entropy(logits, batch["tgt_out"], 0.1, PAD)

    def scale_clip():
        factor = 1.0 / n                               # Trainer.accumulate: world_size / tokens
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return loss, scale_clip


def torch_parts(model: TorchSeq2Seq, batch: dict, clip: float):
    kpm = ~batch["src_mask"]                                       # nn.Transformer: True = padding
    T = batch["tgt_in"].size(1)
    causal = nn.Transformer.generate_square_subsequent_mask(T, device=kpm.device)
    vocab = model.out.out_features

    def loss():
        logits = model(batch["src"], batch["tgt_in"], kpm, causal)
        return F.cross_entropy(logits.reshape(-1, vocab), batch["tgt_out"].reshape(-1), ignore_index=PAD,
                               label_smoothing=0.1)

    def clip_only():
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return loss, clip_only


def make_step(loss_fn: Callable[[], Tensor], after_backward: Callable[[], None], opt: torch.optim.Optimizer,
              phases: dict[str, list[float]], device) -> Callable[[], None]:
    """One training step; appends the duration of each phase to ``phases``."""
    def step():
        t0 = time.perf_counter()
        loss = loss_fn()
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        after_backward()
        sync(device)
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t4 = time.perf_counter()
        for name, dt in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            phases[name].append(dt)
    return step


def check_same(al: Transformer, ref: TorchSeq2Seq, batch: dict) -> str:
    """Same logits, loss and gradients in eval mode (dropout off); returns a one-line summary."""
    al.eval()
    ref.eval()
    al_loss, _ = attnlab_parts(al, None, batch, 1.0)
    ref_loss, _ = torch_parts(ref, batch, 1.0)
    la = al_loss() / batch["num_tokens"]
    lr = ref_loss()
    la.backward()
    lr.backward()
    torch.testing.assert_close(la, lr, atol=1e-4, rtol=1e-4)
    pairs = [("output projection", al.output_projection.weight, ref.out.weight),
             ("source embedding", al.src_embedding.weight, ref.src_emb.weight),
             ("first encoder FF", al.encoder_layers[0].ff.linear1.weight,
              ref.transformer.encoder.layers[0].linear1.weight),
             ("first decoder cross-attn out", al.decoder_layers[0].cross_attn.out_proj.weight,
              ref.transformer.decoder.layers[0].multihead_attn.out_proj.weight)]
    worst = 0.0
    for name, a, r in pairs:
        scale = r.grad.abs().max().clamp_min(1e-12)
        torch.testing.assert_close(a.grad / scale, r.grad / scale, atol=1e-4, rtol=1e-3,
                                   msg=lambda m: f"{name} gradient differs: {m}")
        worst = max(worst, float(((a.grad - r.grad).abs().max() / scale)))
    al.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    al.train()
    ref.train()
    return f"loss {float(lr.detach()):.4f} on both; largest gradient difference {worst:.1e} of the gradient's max"


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: python benchmarks/seq2seq.py --steps 5 --markdown")
    p.add_argument("--steps", type=int, default=10, help="timed steps per contender (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (default 2)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--src-len", type=int, default=32)
    p.add_argument("--tgt-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6, help="encoder layers = decoder layers (default 6)")
    p.add_argument("--d-ff", type=int, default=2048)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's default)")
    p.add_argument("--no-aa", action="store_true", help="skip the A/A control (the reference timed twice)")
    p.add_argument("--no-unfused-row", action="store_true",
                   help="skip the row of attnlab with torch's default, unfused AdamW (what build_optimizer made "
                        "before it chose the fused one)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, a few seconds (smoke test)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables (for benchmarks/README.md)")
    args = p.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.batch, args.src_len, args.tgt_len, args.vocab = 4, 12, 10, 50
        args.d_model, args.heads, args.layers, args.d_ff = 32, 4, 2, 64
        args.steps, args.warmup = min(args.steps, 3), 1
    device = torch.device(args.device)
    V, E, H, L, FF = args.vocab, args.d_model, args.heads, args.layers, args.d_ff

    torch.manual_seed(0)
    al = Transformer(V, V, E, H, L, L, FF, max_seq_len=max(args.src_len, args.tgt_len, 512),
                     dropout=args.dropout, final_norm=True)
    ref = TorchSeq2Seq(V, E, H, L, FF, args.dropout, max_len=max(args.src_len, args.tgt_len, 512))
    n_al, n_ref = (sum(q.numel() for q in m.parameters()) for m in (al, ref))
    assert n_al == n_ref, f"parameter counts differ: attnlab {n_al}, torch {n_ref}"
    copy_weights(al, ref)
    al.to(device)
    ref.to(device)
    batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in make_batch(args.batch, args.src_len,
                                                                                    args.tgt_len, V).items()}
    print(f"# seq2seq training benchmark, {datetime.date.today().isoformat()}: {environment(device, torch.float32)}")
    print(f"# load average at start (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# d_model {E}, heads {H}, layers {L}+{L}, d_ff {FF}, dropout {args.dropout}, vocab {V}, "
          f"batch {args.batch}, src/tgt len {args.src_len}/{args.tgt_len}; {n_al:,} parameters each (untied)")
    print(f"# source tokens {int(batch['src_mask'].sum())} of {batch['src'].numel()}, "
          f"target tokens {batch['num_tokens']} of {batch['tgt_out'].numel()} (the rest padding)")
    print(f"# same weights, dropout off: {check_same(al, ref, batch)}")

    train_cfg = TrainConfig(out_dir="unused", steps=1)            # the Trainer's defaults: lr, betas, eps, decay
    al_opt = build_optimizer(al, train_cfg)
    ref_opt = torch.optim.AdamW(ref.parameters())
    impl = "for-loop" if device.type == "cpu" else "foreach"       # torch's choice for foreach=None, fused=None
    print(f"# attnlab optimizer: build_optimizer -> AdamW(fused={al_opt.defaults.get('fused')}); reference: "
          f"AdamW defaults (fused=None, foreach=None: torch's {impl} implementation on {device.type})")
    names = [ATTNLAB, REF] + ([] if args.no_unfused_row else [ATTNLAB_OLD]) + ([] if args.no_aa else [REF + AA])
    phases = {name: {ph: [] for ph in PHASES} for name in names}
    steps = {ATTNLAB: make_step(*attnlab_parts(al, al_opt, batch, 1.0), al_opt, phases[ATTNLAB], device)}
    ref_loss, ref_after = torch_parts(ref, batch, 1.0)
    steps[REF] = make_step(ref_loss, ref_after, ref_opt, phases[REF], device)
    if not args.no_unfused_row:
        # the same model and step with the AdamW build_optimizer made before it asked for the fused one
        # (torch's default implementation): shows what the fused optimizer is worth
        al2 = Transformer(V, V, E, H, L, L, FF, max_seq_len=max(args.src_len, args.tgt_len, 512),
                          dropout=args.dropout, final_norm=True).to(device)
        al2.load_state_dict(al.state_dict())
        opt2 = torch.optim.AdamW(param_groups(al2, train_cfg.weight_decay), lr=train_cfg.lr, betas=train_cfg.betas,
                                 eps=train_cfg.eps)
        steps[ATTNLAB_OLD] = make_step(*attnlab_parts(al2, opt2, batch, 1.0), opt2, phases[ATTNLAB_OLD],
                                           device)
        al2.train()
    if not args.no_aa:
        steps[REF + AA] = make_step(ref_loss, ref_after, ref_opt, phases[REF + AA], device)
    steps = {name: steps[name] for name in names}
    al.train()
    ref.train()
    timings = time_calls(steps, device=device, warmup=args.warmup, repeats=args.steps, min_repeats=args.steps,
                         budget_s=0.0)
    for name in names:                      # keep only the timed steps' phases
        for ph in PHASES:
            phases[name][ph] = phases[name][ph][-timings[name].n:]
    print(f"# load average at end (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()

    tokens = batch["num_tokens"]
    ref_t = timings[REF].median
    ref_best = min(timings[REF].times)
    headers = ["implementation", "median ms/step", "min ms/step", "steps", "target tokens/s",
               "speed ratio", "min-time speed ratio"] + [f"{ph} ms" for ph in PHASES]
    rows = step_rows(names, timings, REF, tokens, phases, PHASES)
    title = f"Training step; speed ratio = tokens/s / tokens/s of {REF}"
    print(("**" + title + "**" if args.markdown else title) + "\n")
    print(render_table(headers, rows, args.markdown))
    ratio = ref_t / timings[ATTNLAB].median
    best_ratio = ref_best / min(timings[ATTNLAB].times)
    aa = (ref_t / timings[REF + AA].median) if not args.no_aa else None
    noise = abs(aa - 1.0) if aa is not None else 0.0
    status = ("met" if ratio >= TARGET else
              "within noise" if max(best_ratio, ratio + noise) >= TARGET else "MISSED")
    print()
    if args.quick:
        status = "not judged at the --quick shape"
    print(f"Target: attnlab >= {TARGET:.2f} x {REF} tokens/s: {status} (speed ratio {ratio:.2f}, "
          f"min-time speed ratio {best_ratio:.2f}" + (f", A/A control {aa:.2f})" if aa is not None else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
