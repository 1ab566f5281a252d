"""`attnlab train mlm`: BERT-style pre-training through the command line, on the embedded
documents and on a user's file, then `attnlab eval` on a documents file."""
import json

import pytest
import torch

from attnlab.data.masking import IGNORE_INDEX
from attnlab.models.bert import BertForPreTraining
from attnlab.tasks import get_task, open_run
from attnlab.tasks.mlm import read_documents

from test_cli import run_cli  # noqa: E402

SMALL = ["--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--batch-size", "16",
         "--corpus-size", "200", "--no-progress"]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlm") / "run"
    r = run_cli("train", "mlm", "--steps", "100", "--eval-every", "50", "--lr", "3e-3", "--out", str(out), *SMALL)
    assert r.returncode == 0, r.stderr
    return out, r.stdout + r.stderr


def test_embedded_pretraining_learns_the_masked_words(mlm_run):
    out, stdout = mlm_run
    assert "objective: masked LM + NSP" in stdout and "BertForPreTraining" in stdout
    evals = [m for m in _metrics(out) if m.get("kind") == "eval"]
    assert len(evals) >= 2
    vocab = open_run(out).config["vocab_size"]
    # chance is ln(V) nats; the grammar's words are predictable from their context
    assert evals[-1]["val_loss"] < 0.8 * torch.log(torch.tensor(float(vocab))).item(), evals
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert 0.0 <= evals[-1]["val_nsp_acc"] <= 1.0
    assert "[model's guess|original]" in stdout


def test_the_run_loads_as_bert_for_pretraining_with_its_wordpiece_tokenizer(mlm_run):
    out, _ = mlm_run
    run = open_run(out)
    assert run.task == "mlm" and run.architecture == "BertForPreTraining"
    loaded = get_task("mlm").load(run)
    assert isinstance(loaded.model, BertForPreTraining)
    ids = loaded.tokenizer.encode("the dog sees the cat")
    assert loaded.tokenizer.tokens(ids)[0] == "[CLS]" and loaded.tokenizer.tokens(ids)[-1] == "[SEP]"
    with torch.no_grad():
        token_logits, pair_logits = loaded.model(torch.tensor([ids]))
    assert token_logits.shape == (1, len(ids), loaded.tokenizer.vocab_size) and pair_logits.shape == (1, 2)


def test_eval_scores_a_documents_file_the_same_way_twice(mlm_run, tmp_path):
    out, _ = mlm_run
    docs = tmp_path / "docs.txt"
    docs.write_text("the dog sees the cat\nthe dog sleeps\nthe dog runs\n\nthe women wait\nthe women run\n")
    first = run_cli("eval", str(out), "--data", str(docs))
    assert first.returncode == 0, first.stderr
    assert "masked-LM loss" in first.stdout and "NSP accuracy" in first.stdout
    assert run_cli("eval", str(out), "--data", str(docs)).stdout == first.stdout


def test_a_documents_file_trains_albert_style_sop_without_nsp_head_confusion(tmp_path):
    lines = []
    for d in range(30):
        lines += [f"story {d} begins with the dog", f"story {d} goes on with the cat", f"story {d} ends", ""]
    data = tmp_path / "docs.txt"
    data.write_text("\n".join(lines))
    out = tmp_path / "run"
    r = run_cli("train", "mlm", "--data", str(data), "--objective", "sop", "--steps", "4", "--vocab-size", "60",
                "--out", str(out), *SMALL[:-3], "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "masked LM + SOP" in r.stdout + r.stderr
    assert open_run(out).task_options["objective"] == "sop"


def test_read_documents_splits_on_blank_lines_and_rejects_an_empty_file(tmp_path):
    f = tmp_path / "d.txt"
    f.write_text("a b\nc d\n\n\n e f \n")
    assert read_documents(f) == [["a b", "c d"], ["e f"]]
    f.write_text("\n \n")
    r = run_cli("train", "mlm", "--data", str(f), "--steps", "1", "--out", str(tmp_path / "x"))
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and len(errors) == 1 and "d.txt, line 1: no sentences" in errors[0], r.stderr


def test_a_family_without_a_pretraining_head_is_refused_in_one_line(tmp_path):
    r = run_cli("train", "mlm", "--model", "gpt2", "--steps", "1", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "has no pretraining architecture" in r.stderr


def test_training_batches_mask_only_real_ordinary_tokens(mlm_run):
    out, _ = mlm_run
    from attnlab.tasks.mlm import MaskedLMTask
    loaded = get_task("mlm").load(open_run(out))
    docs = [[loaded.tokenizer.encode(s, add_special_tokens=False) for s in ("the dog runs", "the dog sleeps",
                                                                          "the dog waits")]] * 4
    task = MaskedLMTask(loaded.model, loaded.tokenizer, docs, docs, objective="nsp", context=16, batch_size=4)
    batch = task.plan(0, 0)[0]
    picked = batch["labels"] != IGNORE_INDEX
    specials = torch.tensor([loaded.tokenizer.token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]")])
    assert not (picked & ~batch["attention_mask"]).any()
    assert not torch.isin(batch["labels"][picked], specials).any()
    assert all(torch.equal(a, b) for a, b in zip(task.plan(3, 1)[0].values(), task.plan(3, 1)[0].values()))
