"""The reference curve for the Tiny Shakespeare run: nanoGPT's recipe with transformers' GPT-2.

`attnlab train lm` trains attnlab's GPT on Tiny Shakespeare with nanoGPT's `train_shakespeare_char`
settings (README, "Tiny Shakespeare"). On this 2-core CPU a step of that configuration (batch 64 x
256 characters) takes ~10 s, so neither side gets near nanoGPT's 5000 steps; to judge "no worse
than the nanoGPT curve at the same steps and batch" this script trains the *reference* model,
transformers' GPT2LMHeadModel of the same shape, with nanoGPT's own training loop written out here
(AdamW with decay on matrices only, betas (0.9, 0.99), linear warmup then cosine to 1e-4 over 5000
iterations as in nanoGPT's get_lr, clipping at 1.0, dropout 0.2) on the *same* batches and the same
validation windows as the attnlab run (both come from attnlab.tasks.lm's task: the last 10 % of the
text validates, 1,003,854 training characters exactly as nanoGPT's split).

    python benchmarks/shakespeare_reference.py --data ../shared/data/tinyshakespeare.txt \
        --steps 150 --eval-every 50 --out runs/shakespeare_reference.json
    python benchmarks/shakespeare_reference.py --compare runs/shakespeare/metrics.jsonl \
        runs/shakespeare_reference.json

The second form prints the table of both curves (validation loss at each evaluated step).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def nanogpt_lr(it: int, lr: float = 1e-3, warmup: int = 100, decay_iters: int = 5000, min_lr: float = 1e-4) -> float:
    """nanoGPT's get_lr: linear warmup, cosine down to min_lr at decay_iters, then constant."""
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_lr
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


class _Logits(nn.Module):
    """transformers' model behind attnlab's task interface: model(x) -> logits."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, x):
        return self.hf(input_ids=x, use_cache=False).logits


def nanogpt_param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """nanoGPT's AdamW groups: every matrix decayed (the tied embedding/head and the position table
    included), biases and LayerNorm gains not; ``decay_embeddings=False`` exempts the embeddings
    as well, which is what attnlab's optimizer does (decaying them pulls
    them towards zero for no gain)."""
    exempt = set() if decay_embeddings else \
        {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in exempt]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or id(p) in exempt]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(args) -> None:
    import transformers

    from attnlab.tasks.lm import LM
    T, E, H, L = (32, 32, 2, 1) if args.tiny else (256, 384, 6, 6)
    settings = LM.settings(data=args.data, seed=args.seed, tokenizer="char", model="gpt2", context=T,
                           batch_size=args.batch_size, d_model=E, heads=H, layers=L, dropout=0.2,
                           eval_windows=args.eval_windows)
    task = LM.prepare(settings, None).task
    torch.manual_seed(args.seed)
    V = task.tokenizer.vocab_size
    config = transformers.GPT2Config(vocab_size=V, n_positions=T, n_embd=E, n_layer=L, n_head=H,
                                     resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2, bos_token_id=None,
                                     eos_token_id=None)
    model = _Logits(transformers.GPT2LMHeadModel._from_config(config, attn_implementation="sdpa"))
    opt = torch.optim.AdamW(nanogpt_param_groups(model, 0.1, decay_embeddings=not args.no_decay_embeddings),
                            lr=1e-3, betas=(0.9, 0.99))
    print(f"reference: transformers GPT2LMHeadModel, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M "
          f"parameters, vocab {V}, batch {args.batch_size} x {T}", file=sys.stderr)
    curve, t0, step, epoch = [], time.perf_counter(), 0, 0

    def evaluate():
        model.eval()
        val = task.evaluate(model)["val_loss"]
        model.train()
        curve.append({"step": step, "val_loss": val, "seconds": time.perf_counter() - t0})
        print(f"step {step}: val loss {val:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    model.train()
    while step < args.steps:
        for batch in task.plan(epoch, args.seed):
            if step >= args.steps:
                break
            for group in opt.param_groups:
                group["lr"] = nanogpt_lr(step)
            x, y = task.windows(task.train_ids, batch["start"])
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % args.eval_every == 0 or step == args.steps:
                evaluate()
        epoch += 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"recipe": "nanoGPT train_shakespeare_char, transformers GPT2LMHeadModel"
                       + (", embeddings not decayed" if args.no_decay_embeddings else ""),
                       "batch_size": args.batch_size, "curve": curve}, f, indent=1)


def _curve(path: str) -> tuple[str, dict[int, float]]:
    """(column title, {step: validation loss}) of an attnlab metrics.jsonl or a reference JSON."""
    if path.endswith(".jsonl"):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return f"attnlab `{Path(path).parent.name}`", {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    data = json.load(open(path))
    title = "reference" + (" (no embedding decay)" if "embeddings not decayed" in data.get("recipe", "") else "")
    return f"{title} `{Path(path).stem}`", {r["step"]: r["val_loss"] for r in data["curve"]}


def compare(paths: list[str]) -> None:
    """One markdown table: the validation loss of each run (attnlab metrics.jsonl files, reference
    JSON files) at the steps they share, and each attnlab run's difference from its reference: the
    i-th reference when there are as many references as attnlab runs (one per seed), else the first."""
    runs = [_curve(p) for p in paths]
    ours = [r for p, r in zip(paths, runs) if p.endswith(".jsonl")]
    refs = [r for p, r in zip(paths, runs) if not p.endswith(".jsonl")]
    if not ours or not refs:
        raise SystemExit("--compare needs at least one attnlab metrics.jsonl and one reference .json")
    pairs = list(zip(ours, refs if len(refs) == len(ours) else [refs[0]] * len(ours)))
    steps = sorted(set.intersection(*(set(c) for _, c in runs)))
    print("| step | " + " | ".join([t for t, _ in runs] + [f"{a} - {b}" for (a, _), (b, _) in pairs]) + " |")
    print("|---:|" + "---:|" * (len(runs) + len(pairs)))
    for step in steps:
        cells = [f"{c[step]:.4f}" for _, c in runs] + [f"{a[step] - b[step]:+.4f}" for (_, a), (_, b) in pairs]
        print(f"| {step} | " + " | ".join(cells) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/tinyshakespeare.txt")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the curve as JSON here")
    p.add_argument("--tiny", action="store_true", help="1 layer, d_model 32, context 32 (smoke test)")
    p.add_argument("--no-decay-embeddings", action="store_true", help="exempt the token and position embeddings "
                   "(and so the tied head) from weight decay, as attnlab's optimizer does, instead of nanoGPT's "
                   "decay of every matrix")
    p.add_argument("--compare", nargs="+", metavar="RUN",
                   help="print a table of the curves instead of training: attnlab metrics.jsonl files and reference "
                   ".json files (each attnlab run's difference from the reference of the same position when the counts "
                   "match, one per seed, else from the first reference)")
    args = p.parse_args(argv)
    if args.compare:
        compare(args.compare)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
