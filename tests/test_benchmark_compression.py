"""benchmarks/compression.py keeps running (--quick, a tiny LLaMA with SmolLM2's tokenizer), and
its fp32 perplexity is transformers' on the same GGUF file and the same held-out windows (1e-4
relative: summed fp32 losses of a few dozen tokens)."""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import attnlab
from attnlab.gguf import save_gguf
from attnlab.models.llama import Llama, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402

TEXT = ("Shall I compare thee to a summer's day? Thou art more lovely and more temperate: rough winds do shake "
        "the darling buds of May, and summer's lease hath all too short a date. ")


def test_compression_benchmark_quick_runs(tmp_path, capsys):
    tok = attnlab.load_tokenizer(GGUF)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
                              d_ff=64, max_position_embeddings=64, tie_word_embeddings=True))
    path = save_gguf(model, tmp_path / "tiny.gguf", tok)
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 60, encoding="utf-8")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compression
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert compression.main(["--model", str(path), "--text", str(text), "--quick"]) == 0
    out = capsys.readouterr().out
    for row in ("fp32", "int8 per channel, RTN", "int4 Q4_1 group 32, GPTQ", "int4 Q4_1 group 32, HQQ",
                "50 % Wanda (per row)", "2:4 magnitude", "decoding, batch 1"):
        assert row in out, row
    assert "measured on a loaded machine" in out
    got = float(re.search(r"^fp32\s+(\S+)", out, re.MULTILINE).group(1))     # the perplexity table's first row
    assert re.search(r"2:4 Wanda\s+\S+\s+\S+\s+\S+\s+50\.0%", out)

    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    _, held = compression.token_slices(tok, text, 64, 64)
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(held) - 1, 32):
            chunk = torch.tensor([held[i:i + 32]])
            if chunk.size(1) > 1:
                nll += float(F.cross_entropy(hf(chunk).logits[0, :-1], chunk[0, 1:], reduction="sum"))
                count += chunk.size(1) - 1
    want = math.exp(nll / count)
    assert abs(got - want) <= max(1e-4 * want, 1e-3), (got, want)      # the table prints 3 decimals
