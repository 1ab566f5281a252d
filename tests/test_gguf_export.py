"""Writing GGUF files (attnlab.gguf.save_gguf) that transformers reads back.

A small random LLaMA (grouped-query attention, so that the k rows are permuted with the kv-head
count; tied and untied head) is written as F32, F16 and Q8_0 and read by transformers'
``from_pretrained(dir, gguf_file=...)`` and by attnlab:

- both readers hold the same dequantised weights: their logits agree to 1e-5 of scale (FP32);
- F32 gives the model's own logits (1e-5 of scale); F16 rounds each weight to 11 bits, measured
  4e-4 of scale, held to 2e-3; Q8_0 (int8 per block of 32 with an fp16 scale) measured 1e-2 of
  scale, held to 3e-2;
- the SmolLM2 tokenizer written beside a model reads back in transformers with the same ids,
  special tokens and chat template.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.gguf import read_metadata, save_gguf
from attnlab.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402

# rtol of the written file's logits against the model's own, per stored type
AGAINST_MODEL = {"F32": FP32, "F16": 2e-3, "Q8_0": 3e-2}


def _model(tied: bool, vocab: int = 300) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=vocab, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=128,
                             max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=tied)).eval()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_transformers_reads_our_export(tmp_path, qtype, tied):
    from transformers import AutoModelForCausalLM
    model = _model(tied)
    path = save_gguf(model, tmp_path / f"tiny-{qtype}.gguf", qtype=qtype)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    back = attnlab.from_pretrained(path)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, theirs, ours = model(ids), hf(ids).logits, back(ids)
    assert_close_scaled(ours, theirs, FP32, f"attnlab vs transformers reading the {qtype} file")
    assert_close_scaled(ours, want, AGAINST_MODEL[qtype], f"the {qtype} file vs the model")
    assert hf.config.tie_word_embeddings == tied
    if qtype != "F32":
        assert not torch.equal(ours, want), "the stored type must round the weights"


def test_tokenizer_and_chat_template_round_trip(tmp_path):
    from transformers import AutoTokenizer
    tok = attnlab.load_tokenizer(GGUF)
    path = save_gguf(_model(True, vocab=tok.vocab_size), tmp_path / "tok.gguf", tok, qtype="Q8_0")
    meta = read_metadata(path)
    assert meta["tokenizer.ggml.tokens"] == read_metadata(GGUF)["tokenizer.ggml.tokens"]
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = attnlab.load_tokenizer(path)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for text in ["naïve café — 東京 🚀 12345", "<|im_start|>user\nHi<|im_end|>\n", "don't  stop\n\n"]:
        assert ours.encode(text) == theirs(text)["input_ids"] == tok.encode(text), text
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 2)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="qtype must be one of F32, F16, Q8_0, Q4_0, Q4_1"):
        save_gguf(_model(False), tmp_path / "x.gguf", qtype="Q5_K")


def test_export_command_between_gguf_and_directories(tmp_path, capsys):
    """``attnlab export`` dequantises a GGUF file into a Hugging Face directory and writes a
    directory back as GGUF; the logits survive both (F32: exactly the same weights)."""
    from attnlab.cli import main
    model = _model(False)
    src = save_gguf(model, tmp_path / "src.gguf", qtype="F32")
    assert main(["export", str(src), str(tmp_path / "hf")]) == 0
    assert main(["export", str(tmp_path / "hf"), str(tmp_path / "back.gguf")]) == 0
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        for path in (tmp_path / "hf", tmp_path / "back.gguf"):
            assert_close_scaled(attnlab.from_pretrained(path)(ids), want, FP32, str(path))
    assert main(["export", str(src), str(tmp_path / "back.gguf")]) == 2
    assert "exists; give a new file name" in capsys.readouterr().err
