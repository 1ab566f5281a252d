"""DeiT against transformers with the same weights (both heads, their mean, the bare encoder, at the
trained size and resized), and its distillation losses against the paper's formulas written out
image by image."""
import math

import pytest
import torch

import attnlab
import attnlab.models  # noqa: F401  (registers every family)
import contract
from _tolerance import FP32, FP32_OP, assert_close_scaled
from attnlab.models.deit import (DeiTConfig, DeiTForImageClassificationWithTeacher, DeiTModel, hard_distillation_loss,
                                 soft_distillation_loss)
from attnlab.train import split_decay

transformers = pytest.importorskip("transformers")

HF_SIZES = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48, num_attention_heads=4,
                num_hidden_layers=2, intermediate_size=96)


def _pixels(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _hf(cls, seed=0):
    torch.manual_seed(seed)
    model = cls(transformers.DeiTConfig(**HF_SIZES, num_labels=7))
    contract.randomize_(model, seed)
    return model.eval()


@pytest.mark.parametrize("size", [None, (48, 40)], ids=["trained size", "48x40"])
def test_deit_with_teacher_equals_transformers(size, tmp_path):
    """Both heads and the logits (their mean), from transformers to attnlab and back."""
    hf = _hf(transformers.DeiTForImageClassificationWithTeacher)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is DeiTForImageClassificationWithTeacher
    x = _pixels(3, 3, *(size or (32, 32)), seed=1)
    flag = dict(interpolate_pos_encoding=True) if size else {}
    with torch.no_grad():
        want = hf(pixel_values=x, **flag)
        cls_logits, dist_logits = ours.heads(x, **flag)
        assert_close_scaled(cls_logits, want.cls_logits, FP32)
        assert_close_scaled(dist_logits, want.distillation_logits, FP32)
        assert_close_scaled(ours(x, **flag), want.logits, FP32)
        assert not torch.allclose(cls_logits, dist_logits)           # two heads, not one read twice
        back_dir = ours.save_pretrained(tmp_path / "back")
        back = transformers.DeiTForImageClassificationWithTeacher.from_pretrained(back_dir).eval()
        assert_close_scaled(back(pixel_values=x, **flag).logits, want.logits, FP32)


def test_deit_model_equals_transformers(tmp_path):
    hf = _hf(transformers.DeiTModel)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is DeiTModel
    x = _pixels(2, 3, 32, 32, seed=2)
    with torch.no_grad():
        out = hf(pixel_values=x)
        hidden = ours(x)
        assert hidden.shape == (2, 2 + 16, 48)
        assert_close_scaled(hidden, out.last_hidden_state, FP32)
        assert_close_scaled(ours.pool(hidden), out.pooler_output, FP32)


def test_deit_reads_its_tokens_and_refuses_mean_pooling():
    model = attnlab.models.family("deit").default.build(attnlab.models.family("deit").preset("tiny"))
    _, no_decay = ({n for n, _ in group} for group in split_decay(model))
    assert {"cls_token", "distillation_token", "position.weight"} <= no_decay
    assert model.position.weight.shape == (1, 2 + 16, 32)
    with pytest.raises(ValueError, match="DeiTConfig: pooling must be 'cls'"):
        DeiTConfig(pooling="mean")


# ----------------------------------------------------------------------------- the losses, by hand
def _log_softmax(row):
    m = max(row)
    lse = m + math.log(sum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


def _logits(seed, B=5, C=4):
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(B, C, generator=g)).double()


def test_hard_distillation_is_half_label_half_teacher_argmax():
    cls_l, dist_l, teacher = _logits(0), _logits(1), _logits(2)
    labels = torch.tensor([0, 3, 1, 1, 2])
    per_image = []
    for i in range(5):
        y_t = max(range(4), key=lambda c: teacher[i, c].item())
        per_image.append(0.5 * -_log_softmax(cls_l[i].tolist())[labels[i]]
                         + 0.5 * -_log_softmax(dist_l[i].tolist())[y_t])
    got = hard_distillation_loss(cls_l.float(), dist_l.float(), teacher.float(), labels)
    assert_close_scaled(got, torch.tensor(sum(per_image) / 5), FP32_OP)
    got_sum = hard_distillation_loss(cls_l.float(), dist_l.float(), teacher.float(), labels, reduction="sum")
    assert_close_scaled(got_sum, torch.tensor(sum(per_image)), FP32_OP)


@pytest.mark.parametrize("alpha, tau", [(0.1, 3.0), (0.5, 1.0)])
def test_soft_distillation_is_the_papers_formula(alpha, tau):
    cls_l, dist_l, teacher = _logits(3), _logits(4), _logits(5)
    labels = torch.tensor([2, 0, 0, 3, 1])
    total = 0.0
    for i in range(5):
        ce = -_log_softmax(cls_l[i].tolist())[labels[i]]
        log_s = _log_softmax([v / tau for v in dist_l[i].tolist()])
        log_t = _log_softmax([v / tau for v in teacher[i].tolist()])
        kl = sum(math.exp(t) * (t - s) for t, s in zip(log_t, log_s))
        total += (1 - alpha) * ce + alpha * tau ** 2 * kl
    got = soft_distillation_loss(cls_l.float(), dist_l.float(), teacher.float(), labels, alpha=alpha, tau=tau)
    assert_close_scaled(got, torch.tensor(total / 5), FP32_OP)
    # a student that copies the teacher pays only its label loss
    same = soft_distillation_loss(cls_l.float(), teacher.float(), teacher.float(), labels, alpha=alpha, tau=tau)
    ce = torch.nn.functional.cross_entropy(cls_l.float(), labels)
    assert_close_scaled(same, (1 - alpha) * ce, FP32_OP)
    with pytest.raises(ValueError, match="need 0 <= alpha <= 1 and tau > 0"):
        soft_distillation_loss(cls_l, dist_l, teacher, labels, tau=0.0)


def test_the_losses_train_both_heads():
    model = DeiTForImageClassificationWithTeacher(attnlab.models.family("deit").preset("tiny"))
    x, labels = _pixels(4, 3, 16, 16), torch.tensor([0, 1, 2, 0])
    teacher = _logits(6, B=4, C=3).float()
    for loss_fn in (hard_distillation_loss, soft_distillation_loss):
        model.zero_grad()
        loss_fn(*model.heads(x), teacher, labels).backward()
        assert model.head.weight.grad.abs().sum() > 0 and model.head_dist.weight.grad.abs().sum() > 0
