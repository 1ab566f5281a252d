"""A model owns its training objective (attnlab.models.objective): the kind's loss, or the class's
own ``loss``, reached through ``training_loss`` with no family named by the caller.

Parity against transformers' own losses with identical weights (fp32, FP32 = 1e-5 of the scale):
ELECTRA's replaced-token detection (ElectraForPreTraining's loss), BERT's masked-LM plus
next-sentence loss (BertForPreTraining's), MAE's reconstruction (ViTMAEForPreTraining's, the same
noise). DeiT's distillation objective equals the losses of its own module (tested against the
paper's formulas in test_deit.py) exactly; the classifier kind's is the summed cross-entropy.
Each objective runs the model only through ``forward`` (what a DDP wrapper must see)."""
import pytest
import torch
import torch.nn.functional as F

import attnlab.models  # noqa: F401  (registers every family)
import contract
from _encoders import hf_pair, padded_two_segment_batch
from _tolerance import FP32, assert_close_scaled
from attnlab.models.deit import (DEIT, DeiTForImageClassificationWithTeacher, hard_distillation_loss,
                                 soft_distillation_loss)
from attnlab.models.objective import IGNORE_INDEX, Objective
from attnlab.models.registry import family, training_loss

transformers = pytest.importorskip("transformers")


class _Counting:
    """A stand-in for a DDP wrapper: runs the model and counts the calls."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_electra_replaced_token_loss_equals_transformers(tmp_path):
    config = transformers.ElectraConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=48, max_position_embeddings=40,
                                        type_vocab_size=3, pad_token_id=0)
    hf, ours = hf_pair(transformers.ElectraForPreTraining, config, tmp_path)
    ids, mask, _ = padded_two_segment_batch(99, seed=3)
    labels = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(4))
    wrapper = _Counting(ours)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long(), labels=labels).loss
        out = training_loss(ours, {"input_ids": ids, "attention_mask": mask, "labels": labels}, forward=wrapper)
    assert isinstance(out, Objective) and out.count == int(mask.sum()) and wrapper.calls == 1
    assert_close_scaled(out.loss / out.count, want, FP32)
    flipped = training_loss(ours, {"input_ids": ids, "attention_mask": mask, "labels": 1 - labels})
    assert not torch.allclose(flipped.loss, out.loss)


def test_bert_masked_lm_and_next_sentence_loss_equals_transformers(tmp_path):
    config = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=40, type_vocab_size=3)
    hf, ours = hf_pair(transformers.BertForPreTraining, config, tmp_path)
    ids, mask, types = padded_two_segment_batch(99, seed=5)
    g = torch.Generator().manual_seed(6)
    labels = torch.where((torch.rand(ids.shape, generator=g) < 0.3) & mask, ids, IGNORE_INDEX)
    labels[0, 1] = ids[0, 1]                           # at least one masked token
    pair = torch.tensor([0, 1, 1])
    batch = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "labels": labels,
             "sentence_label": pair}
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long(), token_type_ids=types, labels=labels,
                  next_sentence_label=pair).loss
        out = training_loss(ours, batch)
    assert out.count == int((labels != IGNORE_INDEX).sum())
    assert_close_scaled(out.loss / out.count, want, FP32)
    assert_close_scaled(out.metrics["mlm_loss"] / out.count + out.metrics["pair_loss"], want, FP32)


@pytest.mark.parametrize("norm_pix_loss", [False, True])
def test_mae_reconstruction_loss_equals_transformers(norm_pix_loss, tmp_path):
    config = transformers.ViTMAEConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                       num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                                       decoder_hidden_size=16, decoder_num_attention_heads=2,
                                       decoder_num_hidden_layers=2, decoder_intermediate_size=32,
                                       norm_pix_loss=norm_pix_loss)
    hf, ours = hf_pair(transformers.ViTMAEForPreTraining, config, tmp_path)
    g = torch.Generator().manual_seed(7)
    x, noise = torch.randn(3, 3, 16, 16, generator=g), torch.rand(3, 16, generator=g)
    wrapper = _Counting(ours)
    with torch.no_grad():
        want = hf(pixel_values=x, noise=noise).loss
        out = training_loss(ours, {"pixel_values": x, "noise": noise}, forward=wrapper)
    assert out.count == 3 * 12 and wrapper.calls == 1          # mask ratio 0.75 of 16 patches
    assert_close_scaled(out.loss / out.count, want, FP32)


def _deit():
    torch.manual_seed(0)
    model = DEIT.for_kind("image-classifier").build(DEIT.preset("tiny"))
    contract.randomize_(model, 0)
    return model.eval()


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_deit_distillation_objective_is_its_losses(mode):
    model = _deit()
    g = torch.Generator().manual_seed(8)
    x, y, teacher = torch.randn(4, 3, 16, 16, generator=g), torch.tensor([0, 1, 2, 1]), torch.randn(4, 3, generator=g)
    wrapper = _Counting(model)
    batch = {"pixel_values": x, "labels": y, "teacher_logits": teacher, "distillation": mode, "alpha": 0.3, "tau": 2.0}
    with torch.no_grad():
        out = training_loss(model, batch, forward=wrapper)
        cls_logits, dist_logits = model.heads(x)
    want = (hard_distillation_loss(cls_logits, dist_logits, teacher, y, reduction="sum") if mode == "hard" else
            soft_distillation_loss(cls_logits, dist_logits, teacher, y, 0.3, 2.0, "sum"))
    assert wrapper.calls == 1 and out.count == 4
    assert torch.equal(out.loss, want)
    assert int(out.metrics["correct"]) == int((((cls_logits + dist_logits) / 2).argmax(-1) == y).sum())
    assert DeiTForImageClassificationWithTeacher.learns_from_teacher
    with pytest.raises(ValueError, match="'hard' or 'soft'"):
        training_loss(model, dict(batch, distillation="warm"))


@pytest.mark.parametrize("model_type", ["vit", "deit", "swin"])
def test_an_image_classifier_without_a_teacher_learns_by_cross_entropy(model_type):
    fam = family(model_type)
    torch.manual_seed(0)
    model = fam.for_kind("image-classifier").build(fam.preset("tiny")).eval()
    size = fam.input_limits(model.config)["image_size"]
    x, y = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(9)), torch.tensor([0, 1, 0])
    with torch.no_grad():
        out = training_loss(model, {"pixel_values": x, "labels": y, "label_smoothing": 0.1})
        want = F.cross_entropy(model(x).float(), y, reduction="sum", label_smoothing=0.1)
    assert_close_scaled(out.loss, want, FP32) and out.count == 3


def test_a_kind_without_an_objective_says_so():
    fam = family("vit")
    model = fam.for_kind("image-base").build(fam.preset("tiny"))
    with pytest.raises(ValueError, match="states no training objective"):
        training_loss(model, {"pixel_values": torch.zeros(1, 3, 16, 16)})
