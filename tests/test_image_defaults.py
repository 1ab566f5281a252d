"""`attnlab train image` on a user's folder: defaults that follow what the folder holds (image
size, grey or colour, images, classes) and the time budget, each printed and saved with the run,
each overridden by its flag; the embedded digits' defaults as they were."""
import numpy as np
import pytest
import yaml
from PIL import Image

from attnlab.cli import main
from attnlab.data.images import FolderSurvey, read_image_folder, survey_images
from attnlab.tasks import get_task
from attnlab.tasks.image import folder_defaults

VIT_OPTIONS = {"norm", "pooling", "tokenizer"}


def _folder(root, size=(28, 28), mode="L", per_class=6, classes=("a", "b")):
    rng = np.random.default_rng(0)
    for c, label in enumerate(classes):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            shape = (size[1], size[0]) if mode == "L" else (size[1], size[0], 3)
            x = rng.integers(0, 120, shape) + 100 * c
            Image.fromarray(x.astype(np.uint8), mode).save(root / label / f"{i:02d}.png")
    return root


def test_the_defaults_follow_the_data_and_the_budget():
    grey = folder_defaults(FolderSurvey(6000, 10, 28, True), 5, VIT_OPTIONS)
    assert grey == dict(image_size=28, channels=1, patch_size=4, augment="affine", label_smoothing=0.1, dropout=0.0,
                        ema=0.0, heads=4, layers=4, d_model=64, tokenizer="patch", pooling="seq")
    assert folder_defaults(FolderSurvey(6000, 10, 28, True), 10, VIT_OPTIONS)["d_model"] == 128
    assert folder_defaults(FolderSurvey(4000, 10, 28, True), 10, VIT_OPTIONS)["d_model"] == 64
    photos = folder_defaults(FolderSurvey(244, 2, 240, False), None, VIT_OPTIONS)
    assert {k: photos[k] for k in ("image_size", "channels", "augment", "dropout", "tokenizer", "pooling")} == dict(
        image_size=32, channels=3, augment="crop-flip", dropout=0.1, tokenizer="patch", pooling="seq")
    # a family without a tokeniser or pooling choice gets neither, and patches that divide the size
    other = folder_defaults(FolderSurvey(500, 3, 29, False), 3, {"norm"})
    assert "tokenizer" not in other and "pooling" not in other
    assert (other["image_size"], other["patch_size"]) == (28, 4)
    assert folder_defaults(FolderSurvey(500, 3, 9, True), 3, VIT_OPTIONS)["patch_size"] == 2        # 8 px


def test_the_survey_reads_sizes_and_whether_the_images_are_grey(tmp_path):
    assert survey_images(read_image_folder(_folder(tmp_path / "g", (28, 30)))) == FolderSurvey(12, 2, 28, True)
    colour = survey_images(read_image_folder(_folder(tmp_path / "c", (64, 40), mode="RGB")))
    assert (colour.side, colour.grey) == (40, False)
    # RGB files whose three channels are equal are grey scans saved as colour
    root = tmp_path / "rgb-grey"
    _folder(root, (20, 20))
    for f in root.rglob("*.png"):
        Image.open(f).convert("RGB").save(f)
    assert survey_images(read_image_folder(root)).grey


def test_a_folder_trains_with_its_defaults_printed_and_saved(tmp_path, capsys):
    data = _folder(tmp_path / "scans", (28, 28))
    out = tmp_path / "run"
    code = main(["train", "image", "--data", str(data), "--out", str(out), "--steps", "1", "--d-model", "16",
                 "--heads", "2", "--layers", "1", "--batch-size", "4", "--no-progress"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    line = next(x for x in printed.err.splitlines() if x.startswith("for 11 images of 2 classes, 28 px"))
    for flag in ("--image-size 28", "--channels 1", "--patch-size 4", "--augment affine", "--label-smoothing 0.1",
                 "--dropout 0", "--tokenizer patch", "--pooling seq", "--d-model 16"):
        assert flag in line, line
    saved = yaml.safe_load((out / "config.yaml").read_text())["settings"]
    assert {k: saved[k] for k in ("image_size", "channels", "patch_size", "augment", "label_smoothing", "dropout",
                                  "tokenizer", "pooling", "d_model")} == dict(
        image_size=28, channels=1, patch_size=4, augment="affine", label_smoothing=0.1, dropout=0.0,
        tokenizer="patch", pooling="seq", d_model=16)


def test_every_flag_overrides_its_default(tmp_path):
    task = get_task("image")
    data = str(_folder(tmp_path / "scans", (28, 28)))
    given = dict(image_size=16, channels=3, patch_size=2, augment="none", label_smoothing=0.0, dropout=0.2, ema=0.5,
                 heads=2, layers=3, d_model=32, tokenizer="conv", pooling="mean")
    s = task.settings(data=data, **given)
    task.check(s)
    assert {k: s[k] for k in given} == given
    assert set(given) == set(folder_defaults(FolderSurvey(10, 2, 28, True), None, VIT_OPTIONS))     # all of them
    # without the flags: what the folder chose
    s = task.settings(data=data)
    task.check(s)
    assert (s.image_size, s.channels, s.tokenizer, s.pooling) == (28, 1, "patch", "seq")


def test_the_digits_defaults_are_unchanged():
    task = get_task("image")
    s = task.settings()
    task.check(s)
    task.family_sizes(s)
    assert {k: s[k] for k in ("image_size", "patch_size", "channels", "d_model", "heads", "layers", "dropout",
                              "augment", "ema", "label_smoothing", "tokenizer", "pooling")} == dict(
        image_size=8, patch_size=2, channels=3, d_model=64, heads=4, layers=4, dropout=0.0, augment="affine",
        ema=0.999, label_smoothing=0.0, tokenizer="patch", pooling="cls")


@pytest.mark.parametrize("flag", ["--tokenizer", "--pooling"])
def test_a_family_option_of_the_vit_is_refused_with_another_family(tmp_path, capsys, flag):
    data = _folder(tmp_path / "scans", (16, 16))
    value = "conv" if flag == "--tokenizer" else "seq"
    code = main(["train", "image", "--data", str(data), "--model", "deit", flag, value, "--steps", "1",
                 "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} applies to --model vit" in err, err


def test_a_teacher_keeps_the_earlier_sizes_and_no_label_smoothing(tmp_path):
    """With --teacher the student must take the teacher's kind of images, and DeiT's losses take no
    label smoothing: the folder's own choices are not made."""
    task = get_task("image")
    s = task.settings(data=str(_folder(tmp_path / "scans", (28, 28))), model="deit", teacher=str(tmp_path / "t"))
    task.check(s)
    assert (s.image_size, s.channels, s.augment, s.label_smoothing) == (32, 3, "crop-flip", 0.0)
