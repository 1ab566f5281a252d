"""MAE pre-training on the embedded digits and fine-tuning on a few of their labels: ``attnlab
train mae`` without ``--data`` reads the image task's digits at its sizes, and ``attnlab train image
--label-fraction F`` trains on a seeded, class-stratified F of the training images."""
from __future__ import annotations

import pytest
import torch

from attnlab.data.digits import VALIDATION, digits_split

TINY_MAE = ["--d-model", "16", "--heads", "2", "--layers", "1", "--decoder-d-model", "16", "--decoder-heads", "2",
            "--decoder-layers", "1", "--batch-size", "16", "--no-progress"]


def _cli(capsys, *args):
    from attnlab.cli import main
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _settings(task_name: str, **given) -> tuple[object, dict]:
    from attnlab.tasks import get_task
    task = get_task(task_name)
    s = task.settings(**given)
    task.check(s)
    return task, s


def test_mae_without_data_reads_the_image_tasks_digits_at_its_sizes():
    from attnlab.tasks.mae import mae_images
    mae, s = _settings("mae")
    image, t = _settings("image")
    assert (s["image_size"], s["patch_size"], s["channels"]) == (t["image_size"], t["patch_size"], t["channels"]) \
        == (8, 2, 3)
    processor = image._processor(t)
    assert processor.to_dict() == image._processor(s).to_dict() and processor.to_dict()["resample"] == 4  # box
    train, valid, root = mae_images(s, processor)
    data = image._data(t, processor, None)
    assert torch.equal(train, data["train"][0]) and torch.equal(valid, data["valid"][0])
    assert train.shape == (1497, 3, 8, 8) and valid.shape == (100, 3, 8, 8) and "digits" in root
    # the digits' own bytes, grey in every channel: the image task's validation split, none of them in training
    # (the test digits, on which a fine-tuned classifier is scored, are never seen)
    held = digits_split()["valid"][0]
    assert torch.equal(valid[:, :1], held) and torch.equal(valid[:, 2:], held)


def test_label_subset_is_stratified_and_reproducible_from_the_seed():
    from attnlab.tasks.image import label_subset
    y = digits_split()["train"][1]
    keep = label_subset(y, 0.1, seed=0)
    counts, kept = torch.bincount(y, minlength=10), torch.bincount(y[keep], minlength=10)
    assert kept.tolist() == [max(1, round(0.1 * int(n))) for n in counts] and 140 <= len(keep) <= 160
    assert len(set(keep.tolist())) == len(keep)
    assert torch.equal(keep, label_subset(y, 0.1, seed=0))
    assert not torch.equal(keep, label_subset(y, 0.1, seed=1))
    assert torch.equal(label_subset(y, 1.0, seed=5), torch.arange(len(y)))
    assert torch.bincount(y[label_subset(y, 0.001, seed=0)], minlength=10).tolist() == [1] * 10


def test_a_label_fraction_trains_on_the_subset_and_holds_out_the_same_images():
    from attnlab.tasks.image import label_subset
    image, s = _settings("image", label_fraction=0.1, seed=7, d_model=16, heads=2, layers=1)
    few = image.prepare(s, None).task
    image, s = _settings("image", seed=7, d_model=16, heads=2, layers=1)
    full = image.prepare(s, None).task
    keep = label_subset(full.train_y, 0.1, 7)
    assert torch.equal(few.train_x, full.train_x[keep]) and torch.equal(few.train_y, full.train_y[keep])
    assert torch.equal(few.valid_x, full.valid_x) and torch.equal(few.valid_y, full.valid_y)
    assert len(few.valid_y) == 10 * VALIDATION


def test_train_mae_on_the_digits_then_fine_tune_on_a_tenth_of_the_labels(tmp_path, capsys):
    from attnlab.tasks import open_run
    from attnlab.tasks.run import load_processors
    code, _, err = _cli(capsys, "train", "mae", "--out", tmp_path / "mae", "--steps", "2", *TINY_MAE)
    assert code == 0, err
    assert "the embedded 8x8 handwritten digits: 1,497 training images, 100 validation (labels not read)" in err
    assert "images 8x8, 3 channel(s), 16 patches of 2" in err
    run = open_run(tmp_path / "mae")
    assert run.config["image_size"] == 8 and run.config["patch_size"] == 2
    code, _, err = _cli(capsys, "train", "image", "--out", tmp_path / "clf", "--steps", "1", "--init",
                        tmp_path / "mae", "--label-fraction", "0.1", "--no-progress")
    assert code == 0, err
    assert "149 training images (--label-fraction 0.1, stratified), 100 validation, 200 test" in err
    clf = open_run(tmp_path / "clf")
    assert "label_fraction: 0.1" in (tmp_path / "clf" / "config.yaml").read_text()
    assert clf.config["d_model"] == 16 and clf.config["image_size"] == 8
    # the classifier reads the digits through the very processor the encoder was pre-trained with
    assert load_processors(clf)["image"].to_dict() == load_processors(run)["image"].to_dict()


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1"])
def test_a_label_fraction_outside_zero_to_one_is_refused_in_one_line(value, tmp_path, capsys):
    code, _, err = _cli(capsys, "train", "image", "--label-fraction", value, "--out", tmp_path / "r")
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        f"--label-fraction: must be in (0, 1], got {float(value)}"), err


def test_train_mae_refuses_a_validation_folder_without_training_images(tmp_path, capsys):
    (tmp_path / "val" / "a").mkdir(parents=True)
    code, _, err = _cli(capsys, "train", "mae", "--valid", tmp_path / "val", "--out", tmp_path / "r", *TINY_MAE)
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "--valid: give the training images too (--data DIR); the embedded digits have their own held-out split"), err
