"""``attnlab eval FILE.gguf --data TEXT``: perplexity with strided windows, equal to transformers'.

The windows (attnlab.tasks.lm.text_perplexity): the text's ids are cut into windows of the model's
context T starting every ``stride`` tokens; each window scores only the tokens no earlier window
scored, so every token but the first is predicted exactly once, with at least T - stride tokens
of left context after the first window. The reference here computes the same windows with
transformers' model reading the same GGUF file and its own cross-entropy, then exp(mean NLL):
equal within 1e-4 relative (the summed fp32 losses of a few hundred tokens).

A small random LLaMA with a 32-token context and SmolLM2's tokenizer makes a short text need
many windows; the real SmolLM2's perplexity on a short text is checked in test_gguf.py.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attnlab
from attnlab.cli import main
from attnlab.gguf import save_gguf
from attnlab.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402

TEXT = ("Attention lets every position of a sequence look at every other position and take what it needs. "
        "A query is compared with all keys; the softmax of the scores weighs the values. Multi-head attention "
        "does this several times in parallel with different projections, and a Transformer stacks such layers "
        "with feed-forward blocks, residual connections and normalisation in between.\n")


def reference_perplexity(logits_of, ids: list[int], context: int, stride: int) -> float:
    """transformers' strided-window recipe, each token scored once: window [b, min(b + T, n)) scores
    the targets after the previous window's end."""
    nll, scored_to, n = 0.0, 1, len(ids)
    for b in range(0, n, stride):
        e = min(b + context, n)
        window = torch.tensor([ids[b:e]])
        logits = logits_of(window)[0]
        targets = window[0, scored_to - b:]
        nll += float(F.cross_entropy(logits[scored_to - b - 1:e - b - 1], targets, reduction="sum"))
        scored_to = e
        if e == n:
            break
    return float(torch.tensor(nll / (n - 1), dtype=torch.float64).exp())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = attnlab.load_tokenizer(GGUF)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
                              d_ff=64, max_position_embeddings=32, tie_word_embeddings=True))
    d = tmp_path_factory.mktemp("eval")
    (d / "text.txt").write_text(TEXT, encoding="utf-8")
    return save_gguf(model, d / "tiny.gguf", tok), d / "text.txt", tok


@pytest.mark.parametrize("stride", [8, 31])
def test_eval_perplexity_equals_transformers(tiny, stride, capsys):
    from transformers import AutoModelForCausalLM
    path, text, tok = tiny
    assert main(["eval", str(path), "--data", str(text), "--dtype", "fp32", "--stride", str(stride)]) == 0
    out = capsys.readouterr().out
    got = float(re.search(r"perplexity ([0-9.]+)", out).group(1))
    windows = int(re.search(r"in (\d+) windows of up to 32 tokens", out).group(1))
    ids = tok.encode(TEXT)
    assert len(ids) > 70 and windows == -(-(len(ids) - 32) // stride) + 1
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference_perplexity(lambda x: hf(x).logits, ids, 32, stride)
    assert abs(got - want) <= 1e-4 * want, (got, want)
