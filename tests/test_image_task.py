"""`attnlab train image` end to end: the embedded digits, augmentation that suits the data and
resumes exactly, a DeiT student with a frozen teacher, `attnlab eval`'s per-class figures and
confusion PNG, and an exported run in transformers' image-classification pipeline giving the
probabilities of `attnlab classify` (fp32, 1e-5)."""
import json
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from attnlab.cli import main
from attnlab.data.digits import digit_images, digits_split
from attnlab.data.images import augment, random_resized_crop
from attnlab.tasks import get_task, open_run


def _cli(capsys, *args):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def _photos(root, per_class=8, seed=0, classes=("blue", "red")):
    """Colour images of mixed sizes, told apart by their dominant channel."""
    rng = np.random.default_rng(seed)
    for c, label in enumerate(classes):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            h, w = rng.integers(10, 28, 2)
            x = rng.integers(0, 90, (h, w, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / label / f"{i:02d}.png")
    return root


_TINY = ["--image-size", "16", "--patch-size", "4", "--d-model", "32", "--heads", "2", "--layers", "1",
         "--batch-size", "8", "--no-progress"]
# a model transformers can run (export): the class token, not a folder's default sequence pooling
_EXPORTABLE = ["--tokenizer", "patch", "--pooling", "cls"]


def _train(capsys, tmp_path, name, *flags, data=None):
    run = tmp_path / name
    code, out, err = _cli(capsys, "train", "image", *(["--data", data] if data else []), "--out", run, *flags)
    assert code == 0, err
    return run, out, err


# ----------------------------------------------------------------------------- the embedded digits
def test_the_digits_are_1797_real_images_with_fixed_validation_and_test_splits():
    from sklearn.datasets import load_digits
    images, labels = digit_images()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.uint8 and labels.shape == (1797,)
    raw = load_digits()
    assert torch.equal(images[:, 0], torch.from_numpy(raw.images * 255 / 16).round().to(torch.uint8))
    split, again = digits_split(), digits_split()
    (tx, ty), (vx, vy), (sx, sy) = split["train"], split["valid"], split["test"]
    assert len(ty) == 1497 and len(vy) == 100 and len(sy) == 200
    assert Counter(sy.tolist()) == {d: 20 for d in range(10)} and Counter(vy.tolist()) == {d: 10 for d in range(10)}
    assert all(torch.equal(a, b) for k in split for a, b in zip(split[k], again[k]))      # fixed, not per run
    # together the three parts are the whole set, each image once
    key = lambda x, y: [bytes(a.numpy().tobytes()) + bytes([int(b)]) for a, b in zip(x, y)]
    assert Counter(key(tx, ty)) + Counter(key(vx, vy)) + Counter(key(sx, sy)) == Counter(key(images, labels))


def test_the_checkpoint_is_chosen_on_the_validation_digits_and_scored_on_the_test_digits(tmp_path, capsys):
    """The accuracy reported is on 200 digits that chose nothing: the Trainer's evaluations (which
    pick the best checkpoint) see only the 100 validation digits."""
    task = get_task("image")
    setup = task.prepare(task.settings(d_model=16, heads=2, layers=1), None)
    split = digits_split()
    assert torch.equal(setup.task.valid_x[:, :1], split["valid"][0]) and torch.equal(setup.task.valid_y, split["valid"][1])
    test_x, test_y = setup.extra["test"]
    assert torch.equal(test_x[:, :1], split["test"][0]) and torch.equal(test_y, split["test"][1])
    run, out, err = _train(capsys, tmp_path, "digits", "--steps", "4", "--eval-every", "2", "--d-model", "16",
                           "--heads", "2", "--layers", "1")
    clf = task.load(open_run(run))
    pred = clf.probabilities(list(test_x.permute(0, 2, 3, 1).numpy())).argmax(-1)
    assert f"held-out test digits: 200 images\naccuracy {100 * float((pred == test_y).float().mean()):.2f}%" in out


def test_the_default_trains_on_the_digits_and_reports_the_held_out_accuracy(tmp_path, capsys):
    run, out, err = _train(capsys, tmp_path, "digits", "--steps", "3", "--no-progress")
    assert "the embedded 8x8 handwritten digits: 1,497 training images, 100 validation, 200 test; 10 classes" in err
    assert "images 8x8, 3 channel(s), patches of 2; augmentation: affine" in err
    assert "held-out test digits: 200 images" in out and "accuracy" in out
    info = open_run(run)
    assert info.task_options["labels"] == [str(d) for d in range(10)]
    assert info.config["id2label"] == {str(d): str(d) for d in range(10)} or \
        {int(k): v for k, v in info.config["id2label"].items()} == {d: str(d) for d in range(10)}
    # a grey PNG of a digit at another size is read as the digit itself: light on dark, averaged down
    task = get_task("image")
    clf = task.load(info)
    digit = digits_split()["test"][0][0][0].numpy()               # (8, 8) uint8
    png = tmp_path / "digit.png"
    Image.fromarray(digit).resize((40, 40), Image.NEAREST).save(png)
    assert torch.equal(clf.processor.resized(png), torch.from_numpy(np.repeat(digit[None], 3, 0)))
    code, out, err = _cli(capsys, "classify", run, png, "--top", "3")
    fields = out.strip().split("\t")
    assert code == 0 and len(fields) == 6 and fields[0] in info.task_options["labels"], err


# ----------------------------------------------------------------------------- augmentation
def _shifted(x, dy, dx):
    out = torch.zeros_like(x)
    H, W = x.shape[-2:]
    out[..., max(dy, 0):H + min(dy, 0), max(dx, 0):W + min(dx, 0)] = \
        x[..., max(-dy, 0):H + min(-dy, 0), max(-dx, 0):W + min(-dx, 0)]
    return out


def test_digit_augmentation_shifts_reproducibly_and_never_flips():
    images = digits_split()["train"][0][:64].expand(-1, 3, -1, -1).contiguous()
    a, b, c = augment(images, "shift", 7), augment(images, "shift", 7), augment(images, "shift", 8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    moves = Counter()
    for x, y in zip(images, a):
        found = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if torch.equal(_shifted(x, dy, dx), y)]
        assert found, "an augmented digit is not a shift of one pixel at most of the original"
        moves[found[0]] += 1
    assert len(moves) >= 5                                 # many different shifts, not one
    assert not any(torch.equal(y, x.flip(-1)) and not torch.equal(x, x.flip(-1)) for x, y in zip(images, a))
    assert torch.equal(augment(images, "none", 7), images)


def test_digit_affine_augmentation_turns_zooms_and_moves_a_little_reproducibly_never_flipping():
    from attnlab.data.images import random_affine
    images = digits_split()["train"][0][:200].expand(-1, 3, -1, -1).contiguous()
    a, b, c = augment(images, "affine", 7), augment(images, "affine", 7), augment(images, "affine", 8)
    assert torch.equal(a, b) and not torch.equal(a, c) and a.shape == images.shape and a.dtype == torch.uint8
    g = lambda: torch.Generator().manual_seed(0)
    # no turn, zoom or move: the very bytes (the grid lands on the pixel centres)
    assert torch.equal(random_affine(images, g(), degrees=0, translate=0, scale=(1, 1)), images)
    # a slight turn keeps a digit nearer itself than its mirror image (no flip), and the ink stays
    turned = random_affine(images, g(), degrees=10, translate=0, scale=(1, 1)).float()
    near = (turned - images.float()).abs().mean((1, 2, 3))
    mirror = (turned - images.flip(-1).float()).abs().mean((1, 2, 3))
    asym = (images.float() - images.flip(-1).float()).abs().mean((1, 2, 3)) > 30
    assert int(asym.sum()) > 100 and bool((near[asym] < mirror[asym]).all())
    assert 0.8 < float(a.float().sum() / images.float().sum()) < 1.2
    assert float((a != images).float().mean()) > 0.3              # most images do change


def test_an_affine_augmentation_moves_a_dot_where_its_turn_zoom_and_move_take_it():
    """A single lit pixel, augmented 64 times: the brightest pixel of each result is the one
    nearest to where the drawn motion (turn by the angle, zoom, then move; y pointing down) takes
    the dot's centre, recomputed here from the same draws."""
    import math
    from attnlab.data.images import random_affine
    x = torch.zeros(64, 1, 8, 8, dtype=torch.uint8)
    x[:, 0, 1, 5] = 240
    degrees, translate, scale = 60.0, 0.1, (0.8, 1.2)
    out = random_affine(x, torch.Generator().manual_seed(3), degrees, translate, scale)
    u = torch.rand(64, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    checked = 0
    for img, (a, z, tx, ty) in zip(out, u):
        angle, zoom = math.radians(degrees) * (2 * a - 1), scale[0] + (scale[1] - scale[0]) * z
        shift = (2 * translate * (2 * tx - 1), 2 * translate * (2 * ty - 1))
        px, py = (2 * 5 + 1) / 8 - 1, (2 * 1 + 1) / 8 - 1               # the dot's centre in [-1, 1]
        dx, dy = px - shift[0], py - shift[1]                              # output = zoom * R(-angle) (input - move)
        ox = zoom * (math.cos(angle) * dx + math.sin(angle) * dy)
        oy = zoom * (-math.sin(angle) * dx + math.cos(angle) * dy)
        col, row = ((ox + 1) * 8 - 1) / 2, ((oy + 1) * 8 - 1) / 2         # back to pixel indices
        if max(abs(col - round(col)), abs(row - round(row))) > 0.3:       # near a boundary: two pixels tie
            continue
        assert divmod(int(img[0].flatten().argmax()), 8) == (round(row), round(col))
        checked += 1
    assert checked >= 10


def test_photo_augmentation_crops_and_flips_half_the_images():
    x = torch.randint(0, 256, (200, 3, 12, 12), dtype=torch.uint8)
    whole = random_resized_crop(x, torch.Generator().manual_seed(0), scale=(1, 1), ratio=(1, 1))
    mirrored = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(whole, x)])
    assert all(torch.equal(o, i) or m for o, i, m in zip(whole, x, mirrored))
    assert 60 < int(mirrored.sum()) < 140
    crop = augment(x, "crop-flip", 3)
    assert torch.equal(crop, augment(x, "crop-flip", 3)) and crop.shape == x.shape and crop.dtype == torch.uint8
    assert not torch.equal(crop, augment(x, "crop-flip", 4))


def test_the_plan_gives_each_batch_its_augmentation_and_a_resumed_run_sees_the_same(tmp_path, capsys):
    data = _photos(tmp_path / "photos", per_class=10)
    flags = ["--data", data, "--schedule", "constant", "--warmup", "0", "--lr", "3e-3", "--eval-every", "0",
             *_TINY]
    task = get_task("image")
    setup = task.prepare(task.settings(data=str(data), out=str(tmp_path / "x"), image_size=16, patch_size=4), None)
    first, again = setup.task.plan(1, 0), setup.task.plan(1, 0)
    assert [(torch.equal(i, j), s == t) for (i, s), (j, t) in zip(first, again)] == [(True, True)] * len(first)
    assert len({s for _, s in first}) == len(first)
    assert torch.equal(setup.task.batch_bytes(first[0])[0], setup.task.batch_bytes(again[0])[0])
    # 6 steps at once, or 3 and then 3 more after --resume: the same weights, bit for bit
    whole, _, _ = _train(capsys, tmp_path, "whole", "--steps", "6", *flags)
    part, _, _ = _train(capsys, tmp_path, "part", "--steps", "3", *flags)
    code, _, err = _cli(capsys, "train", "image", "--out", part, "--resume", "--steps", "6", "--no-progress")
    assert code == 0, err
    from safetensors.torch import load_file
    a, b = (load_file(str(r / "step-0000006" / "model.safetensors")) for r in (whole, part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- distillation
@pytest.fixture
def teacher(tmp_path, capsys):
    data = _photos(tmp_path / "photos")
    run, _, _ = _train(capsys, tmp_path, "teacher", "--steps", "3", *_TINY, *_EXPORTABLE, data=data)
    return data, run


def test_a_teacher_is_refused_in_one_line_where_it_does_not_apply(teacher, tmp_path, capsys):
    data, run = teacher
    base = ["train", "image", "--data", data, "--steps", "1", "--out", tmp_path / "s", *_TINY]
    code, _, err = _cli(capsys, *base, "--teacher", run)
    assert code == 2 and "--teacher: distillation trains a DeiT student (--model deit), not --model vit" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, *base, "--model", "deit", "--distillation", "soft")
    assert code == 2 and "--distillation: needs --teacher RUN_OR_HF_DIR (and --model deit)" in err
    other = _photos(tmp_path / "other", classes=("ant", "bee"))
    code, _, err = _cli(capsys, "train", "image", "--data", other, "--steps", "1", "--out", tmp_path / "s2",
                        "--model", "deit", "--teacher", run, *_TINY)
    assert code == 2 and f"--teacher {run}: its labels (blue, red) are not the data's (ant, bee)" in err, err
    assert len(err.strip().splitlines()) == 2 and err.startswith("preparing data")
    code, _, err = _cli(capsys, *base, "--model", "deit", "--teacher", tmp_path / "nowhere")
    assert code == 2 and "nowhere: no such run or directory" in err
    code, _, err = _cli(capsys, "train", "image", "--valid", data, "--steps", "1", "--out", tmp_path / "s3")
    assert code == 2 and "--valid: give the training images too (--data DIR); the embedded digits have their own " \
        "held-out split" in err


@pytest.mark.parametrize("how", ["hard", "soft"])
def test_a_deit_student_learns_from_a_frozen_teacher(how, teacher, tmp_path, capsys):
    from attnlab.models.deit import hard_distillation_loss, soft_distillation_loss
    data, run = teacher
    # the teacher as a Hugging Face directory too: export it
    code, _, err = _cli(capsys, "export", run, tmp_path / "hf-teacher")
    assert code == 0, err
    extra = [] if how == "hard" else ["--distillation", "soft", "--distillation-tau", "2"]
    student, _, err = _train(capsys, tmp_path, "student", "--model", "deit", "--teacher", tmp_path / "hf-teacher",
                             "--steps", "3", *extra, *_TINY, data=data)
    assert f"teacher: VisionTransformer from {tmp_path / 'hf-teacher'}, frozen; {how} distillation" in err
    task = get_task("image")
    s = task.settings(data=str(data), out=str(tmp_path / "y"), model="deit", teacher=str(run), image_size=16,
                      patch_size=4, d_model=32, heads=2, layers=1, batch_size=8,
                      **({} if how == "hard" else {"distillation": "soft", "distillation_tau": 2.0}))
    t = task.prepare(s, None).task
    before = {k: v.clone() for k, v in t.teacher.model.state_dict().items()}
    batch = t.plan(0, 0)[0]
    t.model.train(False)
    loss, n, _ = t.loss(t.model, batch)
    images, y = t.batch_bytes(batch)
    cls_logits, dist_logits = t.model.heads(t.processor.finish(images))
    teacher_logits = t.teacher.model(t.teacher.processor.finish(images))
    want = (hard_distillation_loss(cls_logits, dist_logits, teacher_logits, y, reduction="sum") if how == "hard"
            else soft_distillation_loss(cls_logits, dist_logits, teacher_logits, y, 0.1, 2.0, reduction="sum"))
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    loss.backward()
    assert all(p.grad is None and not p.requires_grad for p in t.teacher.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in t.teacher.model.state_dict().items())
    assert n == len(y)


# ----------------------------------------------------------------------------- eval, export, classify
def test_eval_writes_the_confusion_png_and_per_class_figures_equal_to_a_hand_count(tmp_path, capsys):
    data = _photos(tmp_path / "photos", per_class=10)
    held = _photos(tmp_path / "held", per_class=6, seed=3)
    run, _, _ = _train(capsys, tmp_path, "run", "--steps", "4", "--augment", "none", *_TINY, data=data)
    files = sorted(held.rglob("*.png"))
    code, out, _ = _cli(capsys, "classify", run, *files)
    predicted = [line.split("\t")[0] for line in out.splitlines()]
    gold = [f.parent.name for f in files]
    code, out, err = _cli(capsys, "eval", run, "--data", held)
    assert code == 0, err
    assert (run / "confusion.png").is_file() and f"confusion matrix: {run / 'confusion.png'}" in out
    assert Image.open(run / "confusion.png").size[0] > 100
    right = sum(p == g for p, g in zip(predicted, gold))
    assert f"accuracy {100 * right / len(gold):.2f}%" in out
    for label in ("blue", "red"):
        tp = sum(p == g == label for p, g in zip(predicted, gold))
        said, real = predicted.count(label), gold.count(label)
        precision, recall = (100 * tp / said if said else 0.0), 100 * tp / real
        f1 = 2 * precision * recall / (precision + recall) if tp else 0.0
        row = next(line.split() for line in out.splitlines() if line.split()[:1] == [label])
        assert [float(v) for v in row[1:4]] == pytest.approx([precision, recall, f1], abs=0.006), out
        assert int(row[4]) == real
    code, out, _ = _cli(capsys, "eval", run, "--data", held, "--plot", tmp_path / "mine.png")
    assert code == 0 and (tmp_path / "mine.png").is_file()


@pytest.mark.parametrize("embedded", [False, True])
def test_an_exported_run_gives_the_pipeline_the_probabilities_of_classify(embedded, tmp_path, capsys):
    import transformers
    if embedded:                           # the digits: a box filter, and grey PNGs read as RGB by transformers
        run, _, _ = _train(capsys, tmp_path, "run", "--steps", "2")
        rng = np.random.default_rng(0)
        files = []
        for i, size in enumerate((8, 24, 37)):
            files.append(tmp_path / f"grey{i}.png")
            Image.fromarray(rng.integers(0, 256, (size, size + i), dtype=np.uint8)).save(files[-1])
    else:
        data = _photos(tmp_path / "photos", per_class=6)
        run, _, _ = _train(capsys, tmp_path, "run", "--steps", "3", *_TINY, *_EXPORTABLE, data=data)
        files = sorted(data.rglob("*.png"))[::3]
    code, _, err = _cli(capsys, "export", run, tmp_path / "hf")
    assert code == 0, err
    clf = get_task("image").load(open_run(run))
    ours = clf.probabilities(files)
    pipe = transformers.pipeline("image-classification", model=str(tmp_path / "hf"), device="cpu")
    for f, row in zip(files, ours):
        got = {r["label"]: r["score"] for r in pipe(str(f), top_k=len(clf.labels))}
        theirs = torch.tensor([got[label] for label in clf.labels])
        torch.testing.assert_close(theirs, row, rtol=0, atol=1e-5)
    code, out, _ = _cli(capsys, "classify", run, *files, "--top", str(len(clf.labels)))
    for line, row in zip(out.splitlines(), ours):
        fields = line.split("\t")
        printed = {fields[i]: float(fields[i + 1]) for i in range(0, len(fields), 2)}
        assert printed == pytest.approx({label: float(p) for label, p in zip(clf.labels, row)}, abs=1e-4)


def test_a_corrupt_or_non_image_file_in_the_folder_is_named_in_one_line(tmp_path, capsys):
    data = _photos(tmp_path / "photos")
    (data / "red" / "zz.png").write_bytes(b"this is not a png")
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--steps", "1", "--out", tmp_path / "r", *_TINY)
    assert code == 2 and f"{data / 'red' / 'zz.png'}: not an image file that Pillow can read" in err, err
    assert len(err.strip().splitlines()) == 2                     # "preparing data ..." and the error
    (data / "red" / "zz.png").unlink()
    good = (data / "blue" / "00.png").read_bytes()
    (data / "blue" / "zz.png").write_bytes(good[:len(good) // 2])      # truncated
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--steps", "1", "--out", tmp_path / "r", *_TINY)
    assert code == 2 and f"{data / 'blue' / 'zz.png'}: damaged or truncated image" in err, err


def test_exporting_a_grey_run_says_the_pipeline_cannot_run_it(tmp_path, capsys):
    data = _photos(tmp_path / "photos", per_class=4)
    run, _, _ = _train(capsys, tmp_path, "grey", "--steps", "1", "--channels", "1", *_TINY, *_EXPORTABLE, data=data)
    code, _, err = _cli(capsys, "export", run, tmp_path / "hf")
    assert code == 0 and "a grey (1-channel) model: transformers' image-classification pipeline makes every " \
        "image RGB and cannot run it" in err, err


# ----------------------------------------------------------------------------- the digits' defaults
def test_the_digits_train_a_fixed_number_of_steps_whatever_the_machine():
    from attnlab.tasks.image import DIGIT_STEPS
    task = get_task("image")
    s = task.settings(d_model=16, heads=2, layers=1)
    setup = task.prepare(s, None)
    t = task.train_config(s, setup)
    assert (t["steps"], t["warmup_steps"], t["budget_schedule"]) == (DIGIT_STEPS, DIGIT_STEPS // 10, False)
    assert setup.task.augmentation == "affine"


def test_dyt_starts_at_the_tasks_alpha_and_the_flag_is_refused_without_dyt(tmp_path, capsys):
    from attnlab.nn.norm import DyT
    from attnlab.tasks.image import _DYT_ALPHA
    task = get_task("image")
    # the digits: 4 in the first layer, halved in each after it, the final norm as the last layer;
    # a number given: every DyT; a list: one per layer, then the final norm
    cases = ((None, 3, [4.0, 4.0, 2.0, 2.0, 1.0, 1.0, 1.0], [4.0, 2.0, 1.0, 1.0]), ("2.5", 2, [2.5] * 5, 2.5),
             ("3,1,0.5", 2, [3.0, 3.0, 1.0, 1.0, 0.5], [3.0, 1.0, 0.5]))
    assert _DYT_ALPHA["digits"] == 4.0
    for given, layers, want, config in cases:
        s = task.settings(norm="dyt", d_model=16, heads=2, layers=layers,
                          **({} if given is None else {"dyt_alpha": given}))
        model = task.prepare(s, None).task.model
        dyts = [m for m in model.modules() if isinstance(m, DyT)]
        assert [m.alpha.item() for m in dyts] == want                                 # 2 per layer and the last
        assert model.config.dyt_alpha == config                   # the config's: the model was built with it
        assert all(torch.equal(m.weight, torch.ones(16)) and torch.equal(m.bias, torch.zeros(16)) for m in dyts)
    assert _DYT_ALPHA["folder"] == 0.5                                                 # the paper's, for photos
    run, _, _ = _train(capsys, tmp_path, "dyt", "--norm", "dyt", "--dyt-alpha", "3", "--steps", "1", "--d-model",
                       "16", "--heads", "2", "--layers", "1", "--lr", "1e-9", "--warmup", "0")
    reloaded = [m for m in task.load(open_run(run)).model.modules() if isinstance(m, DyT)]
    assert reloaded and all(abs(m.alpha.item() - 3) < 1e-6 for m in reloaded)       # saved with the weights
    assert open_run(run).config["dyt_alpha"] == 3.0                                   # and in the run's config
    code, _, err = _cli(capsys, "train", "image", "--dyt-alpha", "3", "--steps", "1", "--out", tmp_path / "x")
    assert code == 2 and "--dyt-alpha: only with --norm dyt (it sets DyT's initial alpha)" in err, err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _cli(capsys, "train", "image", "--norm", "dyt", "--dyt-alpha", "3,1", "--steps", "1", "--out",
                        tmp_path / "y")
    assert code == 2 and "--dyt-alpha: 2 numbers; give one, or 5 (one per layer of --layers" in err, err


def test_dyt_alphas_train_at_the_tasks_multiple_of_the_lr_and_such_a_run_resumes_bit_identically(tmp_path, capsys):
    from safetensors.torch import load_file
    from attnlab.nn.norm import DyT
    from attnlab.tasks.image import _DYT_ALPHA_LR
    task = get_task("image")
    assert _DYT_ALPHA_LR == {"digits": 1.0, "folder": 1.0}
    for given, want in ((None, 1.0), (3.0, 3.0)):
        s = task.settings(norm="dyt", d_model=16, heads=2, layers=2, **({} if given is None else {"dyt_alpha_lr": given}))
        setup = task.prepare(s, None)
        dyts = [m for m in setup.task.model.modules() if isinstance(m, DyT)]
        assert len(dyts) == 5 and all(m.alpha_lr_scale == want for m in dyts)
    # the run's optimizer: the alphas in a group of their own at 10x the lr (the schedule scales both alike)
    flags = ["--norm", "dyt", "--dyt-alpha-lr", "10", "--d-model", "16", "--heads", "2", "--layers", "1", "--schedule", "constant",
             "--warmup", "0", "--eval-every", "0", "--no-progress"]
    whole, _, _ = _train(capsys, tmp_path, "whole", "--steps", "6", *flags)
    part, _, _ = _train(capsys, tmp_path, "part", "--steps", "3", *flags)
    groups = json.loads((part / "step-0000003" / "trainer_state.json").read_text())["optimizer"]["param_groups"]
    code, _, err = _cli(capsys, "train", "image", "--out", part, "--resume", "--steps", "6", "--no-progress")
    assert code == 0, err
    assert [g.get("lr_scale") for g in groups] == [None, None, 10.0] and len(groups[2]["params"]) == 3
    assert groups[2]["initial_lr"] == pytest.approx(10 * groups[0]["initial_lr"])
    for name in ("model.safetensors", "training_weights.safetensors", "optimizer.safetensors"):
        a, b = (load_file(str(r / "step-0000006" / name)) for r in (whole, part))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    code, _, err = _cli(capsys, "train", "image", "--dyt-alpha-lr", "3", "--steps", "1", "--out", tmp_path / "x")
    assert code == 2 and "--dyt-alpha-lr: only with --norm dyt (it sets how fast DyT's alpha trains)" in err, err
    assert len(err.strip().splitlines()) == 1


def test_label_smoothing_reaches_the_loss_and_is_refused_with_a_teacher(teacher, tmp_path, capsys):
    data, run = teacher
    task = get_task("image")
    kw = dict(data=str(data), out=str(tmp_path / "y"), image_size=16, patch_size=4, d_model=32, heads=2, layers=1,
              batch_size=8)
    t = task.prepare(task.settings(**kw, label_smoothing=0.2), None).task
    batch = t.plan(0, 0)[0]
    t.model.train(False)
    loss, n, _ = t.loss(t.model, batch)
    images, y = t.batch_bytes(batch)
    logits = t.model(t.processor.finish(images)).float()
    # smoothing 0.2 over C classes: the target is 0.8 on the label plus 0.2 / C everywhere
    target = torch.full_like(logits, 0.2 / logits.size(-1)).scatter_add_(
        1, y[:, None], torch.full((len(y), 1), 0.8))
    want = -(target * logits.log_softmax(-1)).sum()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=0)
    assert not torch.allclose(loss, torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
    code, _, err = _cli(capsys, "train", "image", "--data", data, "--steps", "1", "--out", tmp_path / "s",
                        "--model", "deit", "--teacher", run, "--label-smoothing", "0.1", *_TINY)
    assert code == 2 and "--label-smoothing: not with --teacher" in err and len(err.strip().splitlines()) == 1, err


def test_ema_evaluates_and_saves_the_average_of_the_weights(tmp_path, capsys):
    """--ema DECAY: the run's checkpoint holds the average (what classify, eval and export read) and
    the training weights beside it; --ema 0 is off (not the default of some other value)."""
    from safetensors.torch import load_file
    from attnlab.train.ema import TRAINING_WEIGHTS_FILE
    task = get_task("image")
    tiny = ["--steps", "3", "--d-model", "16", "--heads", "2", "--layers", "1", "--warmup", "0", "--no-progress"]
    assert task.train_config(s := task.settings(ema=0.9), task.prepare(s, None))["ema_decay"] == 0.9
    assert task.train_config(s := task.settings(), task.prepare(s, None))["ema_decay"] == 0.999     # the digits' default
    assert task.train_config(s := task.settings(ema=0.0), task.prepare(s, None))["ema_decay"] is None
    run, _, _ = _train(capsys, tmp_path, "ema", *tiny, "--ema", "0.5")
    ckpt = open_run(run).path
    average, raw = load_file(ckpt / "model.safetensors"), load_file(ckpt / TRAINING_WEIGHTS_FILE)
    assert average.keys() == raw.keys() and any(not torch.equal(average[k], raw[k]) for k in raw)
    loaded = task.load(open_run(run)).model.state_dict()
    assert all(torch.equal(loaded[k], average[k]) for k in average)
    code, _, err = _cli(capsys, "train", "image", "--ema", "1", "--out", tmp_path / "x")
    assert code == 2 and "--ema" in err and len(err.strip().splitlines()) == 1, err


def test_resume_refuses_an_image_folder_that_changed_since_the_run_started(tmp_path, capsys):
    """A --data folder is fingerprinted like a data file: a photo added, removed or edited after the
    run started makes --resume stop with one line (the run's classes and data order belong to the old
    folder); the folder as it was resumes."""
    data = _photos(tmp_path / "photos", per_class=6)
    run, _, _ = _train(capsys, tmp_path, "run", "--data", data, "--steps", "2", "--eval-every", "0", *_TINY)
    Image.new("RGB", (12, 12), (0, 0, 250)).save(data / "blue" / "new.png")
    code, _, err = _cli(capsys, "train", "image", "--out", run, "--resume", "--steps", "3", "--no-progress")
    assert code == 2 and f"--data {data} has changed since the run started" in err, err
    assert "its files, their sizes or contents differ" in err and len(err.strip().splitlines()) == 1
    (data / "blue" / "new.png").unlink()                   # as it was: resumes
    code, _, err = _cli(capsys, "train", "image", "--out", run, "--resume", "--steps", "3", "--no-progress")
    assert code == 0, err
    x = np.asarray(Image.open(data / "red" / "00.png")).copy()   # one pixel of one photo edited: refused again
    x[0, 0, 0] ^= 1
    Image.fromarray(x).save(data / "red" / "00.png")
    code, _, err = _cli(capsys, "train", "image", "--out", run, "--resume", "--steps", "4", "--no-progress")
    assert code == 2 and "has changed since the run started" in err, err
