"""benchmarks/lm.py must keep running: a smoke test on its --quick shapes (all sections; the bf16
ones only where torch runs bf16 natively on this CPU, as the benchmark itself decides)."""
import os
import re
import subprocess
import sys
from pathlib import Path

from attnlab.nn.precision import native_bf16

ROOT = Path(__file__).resolve().parents[1]


def test_lm_benchmark_quick_runs():
    pytest_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lm.py"), "--quick", "--threads", "1"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=pytest_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("same weights, dropout off: loss") == 2                  # both training configs checked
    assert "memory bandwidth" in out and "GB/s" in out
    bf16 = native_bf16("cpu")[0]
    titles = ["Training step, config 1", "Training step, config 2", "Generation, batch 1, fp32",
              "Generation, batch 2, fp32", "Held-out perplexity"]
    names = ["attnlab GPT", "transformers GPT2LMHeadModel", "A/A", "attnlab GPT int8", "default AdamW",
             "nanoGPT-style GPT", "erf GELU (nanoGPT's activation)", "plain nn.Linear"]
    if bf16:
        titles += ["Training step, config 1, bf16 autocast", "Generation, batch 1, bf16", "Generation, batch 2, bf16"]
        names += ["attnlab GPT, bf16 autocast", "attnlab GPT bf16 (from_pretrained(dtype=bfloat16))",
                  "bf16 weight copies", "transformers GPT2LMHeadModel bf16"]
    else:
        assert "# amp section skipped" in out
    for title in titles:
        assert title in out, f"{title!r} missing"
    for name in names:
        assert name in out, f"{name!r} missing from the tables"
    tables = [block for block in out.split("\n\n") if block.startswith("implementation ")]
    # train (and bf16 autocast) x 2 configs, generation 2 batches x fp32 (and bf16)
    assert len(tables) == (8 if bf16 else 4), out
    for table in tables:
        header, rule, *rows = table.splitlines()
        cols = re.split(r"\s{2,}", header.strip())
        ratio = cols.index("speed ratio")
        ref = next(r for r in rows if r.startswith("transformers GPT2LMHeadModel") and "A/A" not in r)
        assert re.split(r"\s{2,}", ref.strip())[ratio] == "1.00"              # the reference's own ratio
        for row in rows:
            assert float(re.split(r"\s{2,}", row.strip())[ratio]) > 0
    assert re.search(r"int8, kernel=auto .* [+-]\d+\.\d\d %", out)            # the perplexity change
    assert "train config 1: attnlab >= 1.25" in out and "int8 batch 1: attnlab GPT int8 >= 2.00" in out
    assert not bf16 or "bf16 autocast: attnlab >= 1.30" in out and "bf16 batch 1: attnlab GPT bf16" in out
