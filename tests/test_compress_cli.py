"""``attnlab quantize``, ``attnlab prune`` and ``attnlab export --qtype Q4_0|Q4_1`` on a tiny LLaMA
with SmolLM2's tokenizer, written as GGUF.

What a command writes is what the library gives for the same model and the same calibration
tokens (built here from the tokenizer, independently of the command's helpers): the quantised
GGUF file byte for byte equal to :func:`save_quantized_gguf`'s, the pruned weights equal to
:func:`prune_model`'s; transformers reads the Q4 exports with attnlab's logits (1e-5 of scale).
Bad input is one line on stderr and exit status 2, before any model is read.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.compress import calibration_stats, prune_model, quantize_model, save_quantized_gguf, sparsity_of
from attnlab.gguf import save_gguf
from attnlab.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(Path(__file__).parent))
from _smollm import GGUF  # noqa: E402
from _tolerance import FP32, assert_close_scaled  # noqa: E402

TEXT = ("Attention lets every position of a sequence look at every other position and take what it needs. "
        "A query is compared with all keys; the softmax of the scores weighs the values. Multi-head attention "
        "does this several times in parallel with different projections, and a Transformer stacks such layers "
        "with feed-forward blocks, residual connections and normalisation in between. Pruning removes weights; "
        "quantisation stores the rest in fewer bits, with a scale for every group of thirty-two of them.\n")
CONTEXT = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tok = attnlab.load_tokenizer(GGUF)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=tok.vocab_size, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2,
                              d_ff=64, max_position_embeddings=CONTEXT, tie_word_embeddings=True))
    d = tmp_path_factory.mktemp("compress")
    (d / "text.txt").write_text(TEXT, encoding="utf-8")
    return save_gguf(model, d / "tiny.gguf", tok), d / "text.txt", tok


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """No tokenizer and a 300-token vocabulary: for what reads no calibration text (fast)."""
    torch.manual_seed(1)
    model = Llama(LlamaConfig(vocab_size=300, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_ff=128,
                              max_position_embeddings=CONTEXT, tie_word_embeddings=False))
    return save_gguf(model, tmp_path_factory.mktemp("small") / "small.gguf")


def _batches(tok, tokens):
    """The calibration the commands should read: the first ``tokens`` ids in sequences of the context."""
    ids = tok.encode(TEXT)[:tokens]
    assert len(ids) >= 2 * CONTEXT
    return [torch.tensor([ids[i:i + CONTEXT]]) for i in range(0, len(ids) - CONTEXT + 1, CONTEXT)]


@pytest.mark.parametrize("method,bits,extra", [("gptq", 4, ["--symmetric"]), ("hqq", 4, []), ("rtn", 8, [])])
def test_quantize_writes_what_the_library_gives(tiny, small, tmp_path, capsys, method, bits, extra):
    src, text, tok = tiny if method == "gptq" else (small, None, None)
    out = tmp_path / "cli" / "q.gguf"
    out.parent.mkdir()
    args = ["quantize", str(src), str(out), "--bits", str(bits), "--method", method, *extra]
    if method == "gptq":
        args += ["--calibration", str(text), "--calibration-tokens", "80"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"{out}: Llama as GGUF" in err
    # 80 tokens read, 64 of them in whole sequences, for 64-input layers: GPTQ says that is thin
    assert ("note: GPTQ on 64 calibration tokens for layers of up to 64 inputs" in err) == (method == "gptq"), err
    model = attnlab.from_pretrained(src)
    stats = calibration_stats(model, _batches(tok, 80)) if method == "gptq" else None
    quantize_model(model, bits, 32, method, symmetric=True if extra else None, calibration=stats)
    want = save_quantized_gguf(model, tmp_path / "q.gguf", tok)
    assert out.read_bytes() == want.read_bytes()


@pytest.mark.parametrize("method,args", [("wanda", ["--pattern", "2:4"]), ("magnitude", ["--sparsity", "0.25"])])
def test_prune_writes_what_the_library_gives(tiny, small, tmp_path, capsys, method, args):
    src, text, tok = tiny if method == "wanda" else (small, None, None)
    out = tmp_path / ("p" if method == "wanda" else "p.gguf")
    cal = ["--calibration", str(text), "--calibration-tokens", "80"] if method == "wanda" else []
    assert main(["prune", str(src), str(out), "--method", method, *args, *cal]) == 0
    assert f"{out}: Llama, " in capsys.readouterr().err
    model = attnlab.from_pretrained(src)
    stats = calibration_stats(model, _batches(tok, 80)) if method == "wanda" else None
    pattern = tuple(int(x) for x in args[1].split(":")) if args[0] == "--pattern" else None
    sparsity = float(args[1]) if pattern is None else 0.0
    prune_model(model, sparsity, method, pattern=pattern, calibration=stats)
    back = attnlab.from_pretrained(out).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k
    want = 1 - pattern[0] / pattern[1] if pattern else sparsity
    assert abs(sparsity_of(attnlab.from_pretrained(out)) - want) < 1e-6
    if tok is not None:
        assert attnlab.load_tokenizer(out).encode(TEXT) == tok.encode(TEXT)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_export_q4_read_by_transformers(small, tmp_path, capsys, qtype):
    import gguf
    from transformers import AutoModelForCausalLM
    src = small
    out = tmp_path / f"tiny-{qtype}.gguf"
    assert main(["export", str(src), str(out), "--qtype", qtype]) == 0
    capsys.readouterr()
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert kinds["blk.0.ffn_down.weight"] == kinds["blk.1.attn_q.weight"] == qtype
    ids = torch.tensor([[1, 250, 42, 7, 99, 3]])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32).eval()
    ours, fp = attnlab.from_pretrained(out).eval(), attnlab.from_pretrained(src).eval()
    with torch.no_grad():
        got, theirs, dense = ours(ids), hf(ids).logits, fp(ids)
    assert_close_scaled(got, theirs, FP32, f"attnlab vs transformers reading the {qtype} export")
    assert not torch.equal(got, dense)


@pytest.mark.parametrize("args,message", [
    (["quantize", "{src}", "{out}.gguf", "--bits", "5"], "--bits 5: must be 4"),
    (["quantize", "{src}", "{out}.gguf", "--method", "gptq"], "--method gptq needs a calibration text"),
    (["quantize", "{src}", "{out}.gguf", "--group-size", "128"], "--group-size 128: a GGUF block holds 32"),
    (["quantize", "{src}", "{out}", "--bits", "8"], "give OUT ending in .gguf"),
    (["quantize", "{src}", "{out}.gguf", "--method", "hqq", "--bits", "8"], "--method hqq searches"),
    (["quantize", "{src}", "{out}.gguf", "--method", "gptq", "--calibration", "{out}.txt"], "no such file"),
    (["prune", "{src}", "{out}", "--sparsity", "1.5"], "--sparsity 1.5: must be in [0, 1)"),
    (["prune", "{src}", "{out}", "--method", "wanda"], "--method wanda needs a calibration text"),
    (["prune", "{src}", "{out}", "--calibration", "{src}"], "--method magnitude reads no calibration text"),
    (["prune", "{src}", "{out}", "--pattern", "2-4"], "--pattern '2-4': expected N:M"),
    (["prune", "{src}", "{out}", "--pattern", "4:4"], "--pattern 4:4: needs 0 < N < M"),
    (["prune", "{src}", "{out}", "--pattern", "2:4", "--sparsity", "0.7"], "contradicts --pattern 2:4"),
    (["prune", "{src}", "{out}", "--pattern", "3:5"], "--pattern 3:5: layers.0.self_attn.q_proj's input width"),
])
def test_bad_input_is_one_line(small, tmp_path, capsys, args, message):
    src = small
    argv = [a.format(src=src, out=tmp_path / "o") for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not any(tmp_path.iterdir())
