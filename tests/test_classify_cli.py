"""`attnlab train classify`, `attnlab classify` and `attnlab eval` on classify runs: the embedded data
set is learned in seconds, labels are inferred from the training file and saved with the run, the
three file formats read alike, resume continues the run, and `--init` fine-tunes any registered
base encoder (here a family registered in this file alone, with a Hugging Face tokenizer.json)."""
import io
import json
import sys

import pytest
import torch

from attnlab.cli import main
from attnlab.data.labelled import read_labelled, sort_labels
from attnlab.tasks import open_run
from attnlab.tasks.classify import load_classifier
from attnlab.train.metrics import classification_scores
from _toy_encoder import REVIEWS, pretrained_dir, toy_encoder_dir  # noqa: E402  (tests/ is on sys.path under pytest)

TINY = ["--d-model", "32", "--heads", "2", "--layers", "1", "--no-progress"]


def _cli(capsys, *args, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    """The embedded sentiment set, a short run (about 3 s): 150 steps of the default classifier."""
    run = tmp_path_factory.mktemp("classify") / "run"
    assert main(["train", "classify", "--out", str(run), "--steps", "150", "--eval-every", "75", "--lr", "5e-3",
                 "--no-progress"]) == 0
    return run


def test_a_short_run_on_the_embedded_set_learns(embedded_run):
    evals = [json.loads(x) for x in (embedded_run / "metrics.jsonl").read_text().splitlines() if '"eval"' in x]
    assert len(evals) == 2 and evals[-1]["accuracy"] > 80.0          # two balanced classes: chance is 50 %
    run = open_run(embedded_run)
    assert run.task == "classify" and run.architecture == "TextClassifier"
    assert run.task_options["labels"] == ["negative", "positive"] and run.config["num_classes"] == 2
    assert (embedded_run / "config.yaml").is_file()


def test_classify_prints_one_line_per_text(embedded_run, capsys, monkeypatch):
    code, out, _ = _cli(capsys, "classify", embedded_run, "the movie was really wonderful", "the plot was boring")
    lines = out.splitlines()
    assert code == 0 and [x.split("\t")[0] for x in lines] == ["positive", "negative"]
    assert all(0.5 < float(x.split("\t")[1]) <= 1.0 for x in lines)
    code, out, _ = _cli(capsys, "classify", embedded_run, "--top", "2", stdin="the cast was superb\n\nso dull\n",
                        monkeypatch=monkeypatch)
    lines = out.split("\n")
    assert code == 0 and len(lines) == 4 and lines[1] == "" and lines[3] == ""
    label, p, other, q = lines[0].split("\t")
    assert (label, other) == ("positive", "negative") and abs(float(p) + float(q) - 1) < 1e-3


def test_eval_reports_accuracy_f1_per_class_and_a_confusion_plot(embedded_run, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text("\n".join(json.dumps({"text": t, "label": y}) for t, y in [
        ("the movie was great", "positive"), ("the plot was dull", "negative"), ("the music was lovely", "positive"),
        ("the cast was awful", "negative")]) + "\n")
    code, out, _ = _cli(capsys, "eval", embedded_run, "--data", data, "--plot", tmp_path / "cm.png")
    assert code == 0 and "4 texts" in out and "accuracy 100.00%  macro-F1 100.00" in out
    assert "negative" in out and "precision" in out and (tmp_path / "cm.png").stat().st_size > 1000


def test_classification_scores_match_a_hand_computed_example():
    gold = [0, 0, 1, 1, 2, 2, 2]
    pred = [0, 1, 1, 1, 2, 0, 2]         # confusion rows (true): [1 1 0] [0 2 0] [1 0 2]
    s = classification_scores(gold, pred, 3)
    assert s["confusion"].tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 2]]
    assert s["accuracy"] == pytest.approx(500 / 7)
    assert s["precision"] == pytest.approx([50.0, 200 / 3, 100.0])
    assert s["recall"] == pytest.approx([50.0, 100.0, 200 / 3])
    assert s["f1"] == pytest.approx([50.0, 80.0, 80.0])
    assert s["macro_f1"] == pytest.approx(70.0) and s["support"] == [2, 2, 3]
    never = classification_scores([0, 0], [0, 0], 2)         # a class never present nor predicted: 0, no NaN
    assert never["precision"] == [100.0, 0.0] and never["macro_f1"] == pytest.approx(50.0)


def test_labels_are_inferred_sorted_and_the_formats_read_alike(tmp_path):
    rows = [("one", "10"), ("two", "2"), ("three, with a comma", "1")]
    (tmp_path / "a.tsv").write_text("id\tsentence\tlabel\n" + "".join(f"{i}\t{t}\t{y}\n" for i, (t, y) in
                                                                       enumerate(rows)))
    (tmp_path / "a.csv").write_text("label,text\n" + "".join(f'{y},"{t}"\n' for t, y in rows))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t, "label": int(y)}) + "\n" for t, y in rows))
    for name in ("a.tsv", "a.csv", "a.jsonl"):
        ex = read_labelled(tmp_path / name)
        assert list(zip(ex.texts, ex.labels)) == rows, name
    assert sort_labels(["10", "2", "1", "2"]) == ["1", "2", "10"]             # integers numerically
    assert sort_labels(["pos", "neg", "neutral"]) == ["neg", "neutral", "pos"]
    custom = tmp_path / "c.tsv"
    custom.write_text("body\tstars\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    ex = read_labelled(custom, text_column="body", label_column="stars")
    assert ex.labels == ["10", "2", "1"] and ex.lines == [2, 3, 4]


def test_a_file_run_saves_its_labels_and_resumes(tmp_path, capsys):
    data = tmp_path / "reviews.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in REVIEWS * 5))
    out = tmp_path / "run"
    args = ["train", "classify", "--data", data, "--valid", data, "--out", out, *TINY]
    code, _, err = _cli(capsys, *args, "--steps", "4", "--eval-every", "2")
    assert code == 0 and "labels: neg, pos" in err and "lr 0.001" in err
    code, _, err = _cli(capsys, *args, "--steps", "6", "--eval-every", "2", "--resume")
    assert code == 0 and "from the checkpoint" in err
    latest = out / (out / "latest").read_text().strip()
    assert json.loads((latest / "trainer_state.json").read_text())["step"] == 6
    assert load_classifier(out).labels == ["neg", "pos"]


# ----------------------------------------------------------------------------- --init: any base encoder
def test_init_fine_tunes_any_registered_base_encoder(tmp_path, capsys):
    encoder = toy_encoder_dir(tmp_path / "encoder")
    data = tmp_path / "reviews.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in REVIEWS * 10))
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "classify", "--init", encoder, "--data", data, "--valid", data, "--out", out,
                        "--steps", "30", "--lr", "1e-2", "--eval-every", "30", "--no-progress")
    assert code == 0, err
    assert "model: ToyEncoder from" in err and "lr 0.01" in err
    run = open_run(out)
    assert run.architecture == "EncoderClassifier" and run.config["base_model_type"] == "toy-encoder"
    assert run.tokenizers == {"text": "tokenizer.json"}
    clf = load_classifier(out)
    assert clf.tokenizer.encode("great film")[0] == 2 and clf.labels == ["neg", "pos"]
    code, out_text, _ = _cli(capsys, "classify", out, "truly great", "so dull")
    assert code == 0 and [x.split("\t")[0] for x in out_text.splitlines()] == ["pos", "neg"]
    # the default schedule of a fine-tuning run: BERT's small learning rate
    code, _, err = _cli(capsys, "train", "classify", "--init", encoder, "--data", data, "--out", tmp_path / "r2",
                        "--steps", "2", "--no-progress")
    assert code == 0 and "lr 5e-05" in err


@pytest.mark.parametrize("model_type, architecture, base", [
    ("albert", "AlbertForMaskedLM", "AlbertModel"),          # a checkpoint with a head: its base, under a prefix
    ("bert", "BertModel", "BertModel"),
])
def test_init_fine_tunes_a_registered_hugging_face_encoder(model_type, architecture, base, tmp_path, capsys):
    """A tiny random directory of a registered Hugging Face family: its base under a new head,
    saved and reloaded through the registry."""
    encoder = pretrained_dir(tmp_path / "encoder", model_type, architecture)
    data = tmp_path / "reviews.tsv"
    data.write_text("sentence\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in REVIEWS * 4))
    out = tmp_path / "run"
    code, _, err = _cli(capsys, "train", "classify", "--init", encoder, "--data", data, "--valid", data, "--out", out,
                        "--steps", "3", "--no-progress")
    assert code == 0 and f"model: {base} from" in err, err
    run = open_run(out)
    assert run.config["base_model_type"] == model_type and run.config["base_architecture"] == base
    assert load_classifier(out).probabilities(["a great film"]).shape == (1, 2)


def test_the_sst2_recipe_is_what_a_file_of_its_size_gets_by_default():
    from attnlab.recipes import load_recipe
    from attnlab.tasks.classify import FILE_SIZES
    recipe = load_recipe("sst2")
    sizes = next(v for most, v in FILE_SIZES if 60_614 <= most)
    assert recipe.task == "classify" and recipe.requires_data
    assert {k: recipe.settings[k] for k in sizes if k != "steps"} == {k: v for k, v in sizes.items() if k != "steps"}
