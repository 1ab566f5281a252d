"""`attnlab train classify --init DIR --head native` fine-tunes the family's own classifier, and
`attnlab export` writes runs as Hugging Face directories that transformers loads and computes
identically (fp32, 1e-5 relative to the logits' scale)."""
import json

import pytest
import torch
import transformers

from attnlab.cli import main
from attnlab.tasks import open_run
from attnlab.tasks.classify import load_classifier
from _toy_encoder import REVIEWS, pretrained_dir


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _reviews(tmp_path):
    data = tmp_path / "reviews.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in REVIEWS * 4))
    return data


def _native_run(tmp_path, capsys, model_type, base):
    encoder = pretrained_dir(tmp_path / "encoder", model_type, base)
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "classify", "--init", encoder, "--head", "native", "--data",
                        _reviews(tmp_path), "--out", out, "--steps", "3", "--lr", "1e-3", "--no-progress")
    assert code == 0, err
    return out, err


@pytest.mark.parametrize("model_type, base, classifier", [
    ("bert", "BertModel", "BertForSequenceClassification"),
    ("electra", "ElectraModel", "ElectraForSequenceClassification"),
    ("albert", "AlbertModel", "AlbertForSequenceClassification"),
    ("deberta-v2", "DebertaV2Model", "DebertaV2ForSequenceClassification"),
])
def test_a_native_classifier_run_exports_to_transformers(model_type, base, classifier, tmp_path, capsys):
    run, err = _native_run(tmp_path, capsys, model_type, base)
    assert f"model: {classifier} from" in err
    assert open_run(run).architecture == classifier
    clf = load_classifier(run)
    texts = ["a great film", "so dull", "great acting truly"]

    hf_dir = tmp_path / "hf"
    code, _, err = _cli(capsys, "export", run, hf_dir)
    assert code == 0, err
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in hf_dir.iterdir()}
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == [classifier] and config["id2label"] == {"0": "neg", "1": "pos"}

    ref = getattr(transformers, classifier).from_pretrained(hf_dir).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    batch = hf_tok(texts, padding=True, return_tensors="pt")
    ids = [clf.tokenizer.encode(t) for t in texts]
    assert [row[:len(i)] for row, i in zip(batch["input_ids"].tolist(), ids)] == ids
    with torch.no_grad():
        want = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = clf.model(batch["input_ids"], attention_mask=batch["attention_mask"])
    scale = want.abs().max()
    assert float((got - want).abs().max() / scale) < 1e-5
    assert [ref.config.id2label[int(i)] for i in want.argmax(-1)] == \
        [clf.labels[int(i)] for i in clf.probabilities(texts).argmax(-1)]


def test_the_pipeline_reads_an_exported_run(tmp_path, capsys):
    run, _ = _native_run(tmp_path, capsys, "bert", "BertModel")
    assert _cli(capsys, "export", run, tmp_path / "hf")[0] == 0
    pipe = transformers.pipeline("text-classification", model=str(tmp_path / "hf"), device="cpu")
    clf = load_classifier(run)
    for text in ("a great film", "so dull"):
        p = clf.probabilities([text])[0]
        got = pipe(text)[0]
        assert got["label"] == clf.labels[int(p.argmax())]
        assert abs(got["score"] - float(p.max())) < 1e-5


def test_export_refuses_what_has_no_transformers_class(tmp_path, capsys):
    encoder = pretrained_dir(tmp_path / "encoder", "bert", "BertModel")
    run = tmp_path / "pooled"
    assert _cli(capsys, "train", "classify", "--init", encoder, "--data", _reviews(tmp_path), "--out", run,
                "--steps", "1", "--no-progress")[0] == 0
    code, _, err = _cli(capsys, "export", run, tmp_path / "out")
    assert code == 2 and "EncoderClassifier, which has no Hugging Face counterpart" in err and "--head native" in err
    assert not (tmp_path / "out").exists()
    code, _, err = _cli(capsys, "export", encoder, tmp_path / "out")
    assert code == 2 and "attnlab run" in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    (tmp_path / "n").mkdir()
    run2, _ = _native_run(tmp_path / "n", capsys, "bert", "BertModel")
    code, _, err = _cli(capsys, "export", run2, busy)
    assert code == 2 and "not an empty directory" in err and (busy / "notes.txt").read_text() == "mine"


def test_head_native_errors_are_one_line(tmp_path, capsys):
    data = _reviews(tmp_path)
    code, _, err = _cli(capsys, "train", "classify", "--head", "native", "--data", data, "--out", tmp_path / "a")
    assert code == 2 and "--head native" in err and "--init" in err
    encoder = pretrained_dir(tmp_path / "encoder", "bert", "BertModel")
    code, _, err = _cli(capsys, "train", "classify", "--init", encoder, "--head", "native", "--pooling", "cls",
                        "--data", data, "--out", tmp_path / "b")
    assert code == 2 and "--pooling" in err
    gpt = pretrained_dir(tmp_path / "gpt", "gpt2", "GPT2Model")
    code, _, err = _cli(capsys, "train", "classify", "--init", gpt, "--head", "native", "--data", data,
                        "--out", tmp_path / "c", "--steps", "1", "--no-progress")
    assert code == 2 and "gpt2 family has no sequence-classification model" in err


def test_an_lm_run_exports_with_its_bpe_tokenizer(tmp_path, capsys):
    run = tmp_path / "lm"
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat. the dog sat on the log.\n" * 40)
    code, _, err = _cli(capsys, "train", "lm", "--data", text, "--out", run, "--steps", "2", "--d-model", "32",
                        "--heads", "2", "--layers", "1", "--context", "16", "--tokenizer", "bpe", "--vocab-size",
                        "64", "--no-progress")
    assert code == 0, err
    hf_dir = tmp_path / "hf"
    assert _cli(capsys, "export", run, hf_dir)[0] == 0
    from attnlab.tasks.run import load_tokenizers
    tok = load_tokenizers(open_run(run))["text"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tok("the cat sat")["input_ids"] == tok.encode("the cat sat")
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    import attnlab
    ours = attnlab.from_pretrained(hf_dir)
    ids = torch.tensor([tok.encode("the dog sat on the mat")])
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
