"""`attnlab train translate --model t5` on the embedded corpus, then `attnlab translate` and
`attnlab eval` and `attnlab viz` on the run (tiny sizes: a few seconds)."""
import json

import torch

from attnlab.generate import greedy_decode
from attnlab.models.t5 import T5ForConditionalGeneration
from attnlab.tasks.translate import load_translator
from test_cli import run_cli

TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--max-tokens", "512",
        "--corpus-size", "300", "--eval-size", "20", "--no-progress"]


def test_train_translate_and_eval_a_t5(tmp_path):
    out = tmp_path / "run"
    r = run_cli("train", "translate", "--model", "t5", "--steps", "6", "--eval-every", "3", "--out", str(out), *TINY)
    assert r.returncode == 0, r.stderr
    shown = r.stdout + r.stderr
    assert "family t5" in shown and "Norm layers" not in shown        # T5 is Pre-Norm by construction
    assert "BLEU" in shown and (out / "best" / "run.json").exists()
    meta = json.loads((out / "best" / "run.json").read_text())
    assert (meta["model_type"], meta["architecture"]) == ("t5", "T5ForConditionalGeneration")
    # one vocabulary, and the tokenizer's special ids: decoding starts at its BOS as training did
    assert meta["processors"]["source"] == meta["processors"]["target"]
    assert (meta["config"]["pad_token_id"], meta["config"]["eos_token_id"], meta["config"]["decoder_start_token_id"]) \
        == (0, 2, 1)
    assert (meta["config"]["feed_forward_proj"], meta["config"]["tie_word_embeddings"]) == ("gated-gelu", False)

    texts = ["a man likes twenty-one men", "the cat sees a dog"]
    r = run_cli("translate", str(out), *texts, "--beam", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    model, src_tok, tgt_tok = load_translator(out)           # the same translations through the library
    assert isinstance(model, T5ForConditionalGeneration)
    for text, line in zip(texts, lines):
        src = torch.tensor([src_tok.encode(text)])
        ids = greedy_decode(model, src, max_len=2 * src.size(1) + 10, bos_id=tgt_tok.bos_id, eos_id=tgt_tok.eos_id,
                            pad_id=tgt_tok.pad_id)[0].tolist()
        ids = ids[:ids.index(tgt_tok.eos_id)] if tgt_tok.eos_id in ids else ids
        assert tgt_tok.decode([i for i in ids if i != tgt_tok.pad_id]) == line

    png = tmp_path / "align.png"              # the cross-attention plot: T5 has no position limit to read
    r = run_cli("viz", str(out), texts[0], "--out", str(png))
    assert r.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG", r.stderr

    data = tmp_path / "pairs.tsv"
    data.write_text("a man likes twenty-one men\tein Mann mag einundzwanzig Männer\nthe cat sees a dog\tdie Katze "
                    "sieht einen Hund\n")
    r = run_cli("eval", str(out), "--data", str(data), "--beam", "2")
    assert r.returncode == 0 and "BLEU" in r.stdout and "2 pairs" in r.stdout, r.stderr


def test_t5_refuses_two_vocabularies(tmp_path):
    r = run_cli("train", "translate", "--model", "t5", "--separate-vocab", "--steps", "2", "--out",
                str(tmp_path / "r"), *TINY)
    assert r.returncode == 2 and "one vocabulary serves source and target" in r.stderr
    assert "Traceback" not in r.stderr
