"""Distilling a language model (`attnlab train lm --teacher ...`): the loss against its formula,
alpha = 0 against plain training, exact resume, and the refusals (another vocabulary, another
teacher on --resume, --kd-* without a teacher)."""
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attnlab.cli import main
from attnlab.train.losses import distillation_loss
from _signals import sigint_during_step  # noqa: E402  (tests/ is on sys.path under pytest)
from _tolerance import FP32_OP, assert_close_scaled  # noqa: E402

TINY = ["--d-model", "16", "--heads", "2", "--layers", "1", "--context", "16", "--batch-size", "4",
        "--sample-tokens", "0", "--no-progress", "--eval-every", "0"]
TEXT = "the quick brown fox jumps over the lazy dog. " * 60


# ----------------------------------------------------------------------------- the loss
def _reference(student, teacher, target, T, alpha):
    """Hinton et al.'s loss from torch.nn.functional in float64, over the real positions only:
    alpha T^2 sum_i KL(softmax(t_i / T) || softmax(s_i / T)) + (1 - alpha) sum_i CE(s_i, y_i)."""
    real = target != -100
    s, t, y = student[real].double(), teacher[real].double(), target[real]
    kl = F.kl_div(F.log_softmax(s / T, -1), F.log_softmax(t / T, -1), log_target=True, reduction="sum")
    ce = F.cross_entropy(s, y, reduction="sum")
    return alpha * T * T * kl + (1 - alpha) * ce, int(real.sum())


@pytest.mark.parametrize("T", [1.0, 2.5])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_the_loss_is_its_formula_and_padding_counts_in_neither_term(T, alpha):
    g = torch.Generator().manual_seed(0)
    B, L, V = 3, 7, 11
    student = torch.randn(B, L, V, generator=g) * 3
    teacher = torch.randn(B, L, V, generator=g) * 3
    target = torch.randint(0, V, (B, L), generator=g)
    target[0, 5:] = -100                                    # padding at the end of two rows
    target[2, 3:] = -100
    want, n = _reference(student, teacher, target, T, alpha)
    assert_close_scaled(distillation_loss(student, teacher, target, T, alpha).double(), want, FP32_OP, "sum")
    assert_close_scaled(distillation_loss(student, teacher, target, T, alpha, reduction="mean").double(),
                        want / n, FP32_OP,
                        "mean over the real positions")
    # whatever the logits at padded positions, the loss is the same and their gradient is zero
    s = student.clone().requires_grad_(True)
    noisy_t = torch.where((target == -100)[..., None], torch.randn(B, L, V, generator=g) * 50, teacher)
    loss = distillation_loss(s, noisy_t, target, T, alpha)
    assert_close_scaled(loss.double(), want, FP32_OP, "padded teacher logits ignored")
    loss.backward()
    assert s.grad[target == -100].abs().max() == 0 and s.grad[target != -100].abs().max() > 0
    if alpha == 0.0:                                        # exactly the plain cross-entropy, not just close
        plain = F.cross_entropy(student.flatten(0, 1), target.flatten(), reduction="sum")
        assert torch.equal(distillation_loss(student, teacher, target, T, alpha), plain)


def test_the_loss_refuses_bad_arguments():
    x, y = torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature must be positive"):
        distillation_loss(x, x, y, 0.0)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        distillation_loss(x, x, y, 1.0, 1.5)
    with pytest.raises(ValueError, match="do not match"):
        distillation_loss(x, torch.zeros(2, 3, 6), y)


# ----------------------------------------------------------------------------- the command
def _train(*args) -> int:
    return main(["train", "lm", *map(str, args), *TINY])


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """Two teachers of the same char vocabulary (other seeds and widths) and one of another."""
    d = tmp_path_factory.mktemp("distill")
    (d / "text.txt").write_text(TEXT)
    (d / "other.txt").write_text("PACK MY BOX WITH FIVE DOZEN LIQUOR JUGS 0123456789! " * 60)
    for name, data, seed in (("teacher", "text.txt", 1), ("teacher2", "text.txt", 2), ("foreign", "other.txt", 1)):
        assert main(["train", "lm", "--data", str(d / data), "--out", str(d / name), "--steps", "6", "--seed",
                     str(seed), "--d-model", "32", "--heads", "2", "--layers", "1", "--context", "16",
                     "--batch-size", "4", "--sample-tokens", "0", "--no-progress", "--eval-every", "0"]) == 0
    return d


def _weights(run, step):
    return load_file(run / f"step-{step:07d}" / "model.safetensors")


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_alpha_zero_trains_exactly_as_plain_next_token_training(teachers, tmp_path):
    d = teachers
    assert _train("--data", d / "text.txt", "--out", tmp_path / "plain", "--steps", "3") == 0
    assert _train("--data", d / "text.txt", "--out", tmp_path / "kd0", "--steps", "3", "--teacher", d / "teacher",
                  "--kd-alpha", "0", "--kd-temperature", "3") == 0
    assert _equal(_weights(tmp_path / "plain", 3), _weights(tmp_path / "kd0", 3))
    assert _train("--data", d / "text.txt", "--out", tmp_path / "kd", "--steps", "3", "--teacher", d / "teacher",
                  "--kd-alpha", "0.5") == 0                  # the soft term does change the training
    assert not _equal(_weights(tmp_path / "plain", 3), _weights(tmp_path / "kd", 3))


def test_a_distilled_run_interrupted_and_resumed_ends_bit_equal(teachers, tmp_path, monkeypatch, capsys):
    d = teachers
    args = ["--data", d / "text.txt", "--steps", "4", "--save-every", "10", "--teacher", d / "teacher",
            "--kd-alpha", "0.7", "--kd-temperature", "2"]
    assert _train(*args, "--out", tmp_path / "ref") == 0
    sigint_during_step(monkeypatch, 2)
    assert _train(*args, "--out", tmp_path / "run") == 130
    assert (tmp_path / "run" / "latest").read_text().strip() == "step-0000002"
    monkeypatch.undo()
    capsys.readouterr()
    assert _train(*args[:-4], "--out", tmp_path / "run", "--resume") == 0     # T and alpha from the run
    ref, resumed = _weights(tmp_path / "ref", 4), _weights(tmp_path / "run", 4)
    assert _equal(ref, resumed)
    student = sum(v.numel() for v in ref.values())
    teacher = sum(v.numel() for v in load_file(d / "teacher" / "step-0000006" / "model.safetensors").values())
    assert student < teacher                              # the student's tensors alone, no teacher in them
    meta = json.loads((tmp_path / "run" / "step-0000004" / "run.json").read_text())
    assert meta["task_options"]["teacher"]["path"] == str((d / "teacher").resolve())
    assert len(meta["task_options"]["teacher"]["sha256"]) == 64


def _one_error_line(err: str) -> str:
    """The error's line (after the progress line "preparing data ..." where the data was being read)."""
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("preparing data")]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("attnlab train: error: "), err
    return lines[0]


def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(teachers, tmp_path, capsys):
    d = teachers
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--teacher", d / "teacher", "--vocab-size",
                  "500", "--steps", "1") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--vocab-size 500" in line and "vocabulary of 32 tokens" in line
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--teacher", d / "teacher", "--tokenizer",
                  "bpe", "--steps", "1") == 2
    assert "has a char tokenizer of 32 tokens" in _one_error_line(capsys.readouterr().err)
    # a student run resumed with a teacher (the same path) whose vocabulary is now another
    shutil.copytree(d / "teacher", tmp_path / "t")
    assert _train("--data", d / "text.txt", "--out", tmp_path / "s", "--teacher", tmp_path / "t", "--steps", "2",
                  "--save-every", "1") == 0
    shutil.rmtree(tmp_path / "t")
    shutil.copytree(d / "foreign", tmp_path / "t")
    capsys.readouterr()
    assert _train("--data", d / "text.txt", "--out", tmp_path / "s", "--resume", "--steps", "3") == 2
    foreign = json.loads((d / "foreign" / "step-0000006" / "run.json").read_text())["config"]["vocab_size"]
    assert foreign != 32
    assert f"its vocabulary has {foreign} tokens, the student's in" in _one_error_line(capsys.readouterr().err)
    # a student model over another vocabulary than the teacher's (the teacher's tokenizer and model disagree)
    from attnlab.models import GPT, GPTConfig
    from attnlab.tasks.distill import Teacher
    from attnlab.tasks.lm import load_lm
    teacher = Teacher(load_lm(d / "teacher", "cpu", "fp32"), {"vocab_size": 32}, 2.0, 0.5)
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    assert not teacher.logits(torch.zeros(1, 4, dtype=torch.long)).requires_grad
    assert teacher.check_student(GPT(GPTConfig(vocab_size=32, n_positions=16, d_model=8, num_heads=2,
                                               num_layers=1))) is teacher
    with pytest.raises(ValueError, match="its vocabulary has 32 tokens and the student's 40"):
        teacher.check_student(GPT(GPTConfig(vocab_size=40, n_positions=16, d_model=8, num_heads=2, num_layers=1)))


def test_another_teacher_on_resume_is_refused_in_one_line(teachers, tmp_path, capsys):
    d = teachers
    shutil.copytree(d / "teacher", tmp_path / "t")
    args = ["--data", d / "text.txt", "--out", tmp_path / "s", "--save-every", "1"]
    assert _train(*args, "--teacher", tmp_path / "t", "--steps", "1") == 0
    capsys.readouterr()
    assert _train(*args, "--teacher", d / "teacher2", "--steps", "2", "--resume") == 2     # another path
    assert f"--teacher {d / 'teacher2'} differs from the run's" in _one_error_line(capsys.readouterr().err)
    shutil.rmtree(tmp_path / "t")
    shutil.copytree(d / "teacher2", tmp_path / "t")       # the same path, other weights
    assert _train(*args, "--steps", "2", "--resume") == 2
    assert f"the teacher {tmp_path / 't'} is not the one" in _one_error_line(capsys.readouterr().err)
    shutil.rmtree(tmp_path / "t")
    shutil.copytree(d / "teacher", tmp_path / "t")        # the original back: the run continues
    assert _train(*args, "--steps", "2", "--resume") == 0


def test_bad_distillation_options_are_refused_in_one_line(teachers, tmp_path, capsys):
    d = teachers
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--kd-alpha", "0.5") == 2
    assert "--kd-alpha applies with --teacher" in _one_error_line(capsys.readouterr().err)
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--teacher", tmp_path / "nothing") == 2
    assert "--teacher: no checkpoint at" in _one_error_line(capsys.readouterr().err)
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--teacher", d / "teacher", "--init",
                  d / "teacher2") == 2
    assert "does not combine with --init" in _one_error_line(capsys.readouterr().err)
    assert _train("--data", d / "text.txt", "--out", tmp_path / "r", "--teacher", d / "teacher", "--kd-alpha",
                  "1.5") == 2
    assert "--kd-alpha: must be in [0, 1], got 1.5" in _one_error_line(capsys.readouterr().err)
