"""Encoder speed: attnlab's BERT against transformers' BERT (sdpa attention), same weights, one process.

Two measurements, each in fp32 and in bf16, each on a full batch and on a padded one:

  forward   Inference on a BERT-base-shaped encoder (12 layers, d_model 768, 12 heads, d_ff 3072,
            vocabulary 30522), batch 8 x 128 tokens, under torch.inference_mode(). Full: an
            attention mask of ones. Padded: the rows' real lengths drawn uniformly from 16..128
            (seeded; the first row 128 long), the rest padding, as a dynamically padded batch of
            varied texts is: attnlab runs the layers on the real tokens alone (attnlab.nn.packing),
            transformers on every position. attnlab: ``attnlab.from_pretrained(dir)`` (what a user gets:
            its InferenceLinear layers); transformers: ``BertModel.from_pretrained(dir,
            attn_implementation="sdpa")``. bf16: both models' weights in bf16 (``dtype=torch.bfloat16``).
  finetune  One fine-tuning step of ``BertForSequenceClassification`` (2 labels), batch 8 x 128:
            forward, cross-entropy, backward, AdamW step, zero_grad. Both sides use torch's fused
            AdamW (transformers' Trainer default for torch >= 2.8; attnlab's build_optimizer).
            bf16: fp32 weights, forward and loss under torch.autocast("cpu", bfloat16) on both sides.

Before timing, the script checks that both sides give the same outputs on the real tokens (fp32:
relative to scale, 1e-4; bf16: 5e-2) and, for fine-tuning, the same loss. Each table times the contenders round-robin
and repeats the reference as "A/A: again", whose ratio shows the run's noise. Ratio = reference
time / contender time (above 1: attnlab faster); tokens/s counts the real tokens. Targets: >= 1.2x
in each table.

    python benchmarks/encoders.py --markdown            # the README tables (~10 minutes on 2 cores)
    python benchmarks/encoders.py --quick               # a tiny shape, seconds (the smoke test)
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")       # transformers' save/load bars

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from _util import environment, fmt_ms, render_table, time_calls  # noqa: E402

import attnlab  # noqa: E402
from attnlab.train import TrainConfig, build_optimizer  # noqa: E402

TARGET = 1.2
BASE = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
            max_position_embeddings=512, type_vocab_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
QUICK = dict(BASE, vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64)
AL, REF, AA = "attnlab BertModel (from_pretrained)", "transformers BertModel (sdpa)", "transformers (A/A: again)"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def _models(cls_name: str, shape: dict, directory: Path, dtype: torch.dtype):
    import transformers
    transformers.utils.logging.disable_progress_bar()
    config = transformers.BertConfig(**shape, num_labels=2, architectures=[cls_name])
    torch.manual_seed(0)
    ref = getattr(transformers, cls_name)(config)
    ref.save_pretrained(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = getattr(transformers, cls_name).from_pretrained(directory, attn_implementation="sdpa", dtype=dtype)
    ours = attnlab.from_pretrained(directory, dtype=dtype)
    return ours, ref


def _timed_rows(fns: dict, tokens: int, args) -> tuple[list, float]:
    """Time ``fns`` (attnlab first, the reference second, its A/A repeat third) round-robin: the
    table's rows (ratios against the reference) and attnlab's median speed ratio."""
    names = list(fns)
    t = time_calls(fns, warmup=args.warmup, repeats=args.repeats, budget_s=args.budget)
    ref = t[names[1]]
    rows = [[n, fmt_ms(t[n].median), fmt_ms(min(t[n].times)), t[n].n, f"{tokens / t[n].median:.0f}",
             f"{ref.median / t[n].median:.2f}", f"{min(ref.times) / min(t[n].times):.2f}"] for n in names]
    return rows, ref.median / t[names[0]].median


def _batch(shape: dict, batch: int, seq: int, padded: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of ``batch`` rows of ``seq`` positions: all real, or (padded) real lengths drawn
    uniformly from seq // 8..seq (16..128), the first row full; padding is id 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, shape["vocab_size"], (batch, seq), generator=g)
    lengths = torch.full((batch,), seq)
    if padded:
        lengths = torch.randint(max(1, seq // 8), seq + 1, (batch,), generator=g)
        lengths[0] = seq
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


def forward_table(shape: dict, batch: int, seq: int, dtype: torch.dtype, padded: bool,
                  args) -> tuple[tuple[list, float], float]:
    with tempfile.TemporaryDirectory() as d:
        ours, ref = _models("BertModel", shape, Path(d), dtype)
    ours.eval(), ref.eval()
    ids, mask = _batch(shape, batch, seq, padded, seed=1)
    real = mask.bool()
    with torch.inference_mode():
        diff = _rel(ours(ids, attention_mask=mask)[real], ref(input_ids=ids, attention_mask=mask).last_hidden_state[real])
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if diff > tol:
        raise SystemExit(f"forward {dtype}: attnlab and transformers differ by {diff:.2e} (relative), over {tol}")

    def run(model, hf):
        def call():
            with torch.inference_mode():
                return model(input_ids=ids, attention_mask=mask) if hf else model(ids, attention_mask=mask)
        return call

    fns = {AL: run(ours, False), REF: run(ref, True), AA: run(ref, True)}
    return _timed_rows(fns, int(mask.sum()), args), diff


def finetune_table(shape: dict, batch: int, seq: int, autocast: bool, padded: bool,
                   args) -> tuple[tuple[list, float], float]:
    with tempfile.TemporaryDirectory() as d:
        ours, ref = _models("BertForSequenceClassification", shape, Path(d), torch.float32)
    ours.train(), ref.train()
    ids, mask = _batch(shape, batch, seq, padded, seed=2)
    labels = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a, b = ours(ids, attention_mask=mask), ref(input_ids=ids, attention_mask=mask).logits
        diff = _rel(F.cross_entropy(a.float(), labels), F.cross_entropy(b.float(), labels))
    tol = 1e-4 if not autocast else 5e-2
    if diff > tol:
        raise SystemExit(f"fine-tuning loss (autocast={autocast}): attnlab and transformers differ by {diff:.2e}")
    ours_opt = build_optimizer(ours, TrainConfig(out_dir="unused", steps=1, lr=2e-5))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=2e-5, fused=True)
    ref_opt2 = torch.optim.AdamW(ref.parameters(), lr=2e-5, fused=True)

    def step(model, opt, hf):
        def call():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = model(input_ids=ids, attention_mask=mask).logits if hf else model(ids, attention_mask=mask)
                loss = F.cross_entropy(logits.float(), labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return call

    fns = {AL.replace("BertModel", "BertForSequenceClassification"): step(ours, ours_opt, False),
           REF.replace("BertModel", "BertForSequenceClassification"): step(ref, ref_opt, True),
           AA: step(ref, ref_opt2, True)}
    return _timed_rows(fns, int(mask.sum()), args), diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="example: python benchmarks/encoders.py --markdown")
    p.add_argument("--sections", default="forward,finetune", help="comma-separated: forward, finetune")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    p.add_argument("--batches", default="full,padded", help="comma-separated: full, padded")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=10, help="timed calls per contender at most")
    p.add_argument("--budget", type=float, default=20.0, help="seconds of timed calls per contender")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a tiny shape (smoke test)")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = QUICK if args.quick else BASE
    batch, seq = (2, 16) if args.quick else (args.batch, args.seq)
    if args.quick:
        args.repeats, args.budget, args.warmup = 3, 0.5, 1
    from attnlab.nn.precision import native_bf16
    dtypes = [x.strip() for x in args.dtypes.split(",") if x.strip()]
    bf16_ok, why = native_bf16("cpu")
    print(f"# encoder benchmark: {environment('cpu', torch.float32)}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; bf16: {why}")
    print(f"# shape: {shape['num_hidden_layers']} layers, d_model {shape['hidden_size']}, "
          f"{shape['num_attention_heads']} heads, d_ff {shape['intermediate_size']}, vocabulary {shape['vocab_size']}; "
          f"batch {batch} x {seq} tokens")
    headers = ["implementation", "median ms", "min ms", "calls", "tokens/s", "speed ratio", "min-time ratio"]
    targets = []
    kinds = [x.strip() for x in args.batches.split(",") if x.strip()]
    if not set(kinds) <= {"full", "padded"}:
        raise SystemExit(f"--batches: expected full and/or padded, got {args.batches!r}")
    for section in [s.strip() for s in args.sections.split(",") if s.strip()]:
        for dt in dtypes:
            if dt == "bf16" and not bf16_ok and not args.quick:
                print(f"\n(skipping {section} bf16: {why})")
                continue
            for kind in kinds:
                padded = kind == "padded"
                if section == "forward":
                    dtype = torch.float32 if dt == "fp32" else torch.bfloat16
                    (rows, ratio), diff = forward_table(shape, batch, seq, dtype, padded, args)
                    title = f"Forward (inference), {dt} weights"
                elif section == "finetune":
                    (rows, ratio), diff = finetune_table(shape, batch, seq, dt == "bf16", padded, args)
                    title = f"Fine-tuning step, {'fp32' if dt == 'fp32' else 'bf16 autocast (fp32 weights)'}"
                else:
                    raise SystemExit(f"--sections: unknown section {section!r}")
                fill = _batch(shape, batch, seq, padded, seed=1 if section == "forward" else 2)[1].float().mean()
                title += f", {kind} batch ({fill:.0%} real tokens)"
                print(f"\n**{title}; ratio = transformers time / this time (outputs agree to {diff:.1e} "
                      f"relative)**\n")
                print(render_table(headers, rows, args.markdown))
                targets.append((title, ratio))
    print("\nTargets (attnlab >= {:.1f}x transformers, median):".format(TARGET))
    for title, ratio in targets:
        print(f"- {title}: {ratio:.2f}x {'met' if ratio >= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
