"""The text classifiers (attnlab.models.classifier): the chapter's constructor, padding that changes
nothing in train or eval mode, the chapter's bug it fixes, and EncoderClassifier over any base."""
import pytest
import torch

import attnlab.models  # noqa: F401  (registers every family)
from attnlab.models.classifier import (EncoderClassifier, EncoderClassifierConfig, TextClassifier,
                                       TextClassifierConfig)
from attnlab.models.gpt import GPTConfig, GPTModel
from attnlab.models.registry import families, family
from _tolerance import FP32, assert_close_scaled  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 0, 0, 0, 0]])   # 0 = <pad>


def _rows_alone(model, ids):
    return torch.cat([model(ids[b:b + 1, :int((ids[b] != 0).sum())]) for b in range(ids.size(0))])


@pytest.mark.parametrize("pooling", ["mean", "cls", "attention"])
def test_padding_changes_no_prediction(pooling):
    """Each row classified alone (unpadded) equals the row in the padded batch, and more padding
    changes nothing: in eval mode, and in train mode when dropout is off (pitfall: padded positions
    must not leak into attention or the pooling)."""
    torch.manual_seed(0)
    model = TextClassifier(vocab_size=20, embed_dim=16, num_heads=2, num_classes=3, num_layers=2, pooling=pooling,
                           dropout=0.0)
    for mode in (model.eval, model.train):
        mode()
        padded = model(IDS)
        assert_close_scaled(padded, _rows_alone(model, IDS), FP32, f"{pooling}: padded vs alone")
        more = torch.cat([IDS, torch.zeros(3, 6, dtype=torch.long)], 1)
        assert_close_scaled(model(more), padded, FP32, f"{pooling}: more padding")
        mask = IDS != 0                                  # an explicit mask says the same as pad_id
        assert torch.equal(model(IDS, attention_mask=mask), padded)


def test_the_chapter_s_classifier_is_wrong_where_ours_is_not():
    """The chapter's forward (no mask, x.mean(dim=1) over padding too) changes its output when a
    text is padded; ours does not."""
    torch.manual_seed(0)
    ours = TextClassifier(20, 16, 2, 2, dropout=0.0).eval()
    text, padded = IDS[1:2, :3], IDS[1:2]
    chapter = TextClassifier(20, 16, 2, 2, dropout=0.0, pad_id=None).eval()    # every id counted as real
    chapter.load_state_dict(ours.state_dict())
    assert not torch.allclose(chapter(text), chapter(padded), atol=1e-4)
    assert_close_scaled(ours(padded), ours(text), FP32, "ours")


def test_constructor_keeps_the_chapter_s_names_and_validates():
    model = TextClassifier(vocab_size=100, embed_dim=32, num_heads=4, num_classes=5)
    assert model.config.num_labels == 5 and model.config.d_model == 32 and model.config.d_ff == 128
    assert model(torch.randint(1, 100, (2, 7))).shape == (2, 5)
    assert isinstance(model.config, TextClassifierConfig)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        TextClassifier(100, 30, 4, 2)
    with pytest.raises(ValueError, match="pooling must be one of"):
        TextClassifier(100, 32, 4, 2, pooling="max")
    with pytest.raises(ValueError, match="token id out of range"):
        model(torch.tensor([[1, 100]]))


def test_both_families_are_registered_classifiers():
    kinds = {f.model_type for f in families("classifier")}
    assert {"text-classifier", "encoder-classifier"} <= kinds
    config = family("text-classifier").build_config(vocab_size=50, context=32, d_model=16, num_heads=2,
                                                    num_layers=1, num_classes=4, pooling="cls")
    assert (config.max_len, config.num_classes, config.pooling) == (32, 4, "cls")


def test_encoder_classifier_keeps_the_base_weights_and_ignores_padding():
    torch.manual_seed(0)
    base = GPTModel(GPTConfig(vocab_size=30, n_positions=16, d_model=16, num_heads=2, num_layers=1, dropout=0.0))
    model = EncoderClassifier.from_base(base, num_labels=3, pooling="mean", dropout=0.0).eval()
    assert isinstance(model.config, EncoderClassifierConfig) and model.config.vocab_size == 30
    for name, p in base.state_dict().items():
        assert torch.equal(model.encoder.state_dict()[name], p)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    batched = model(ids, attention_mask=mask)
    assert_close_scaled(batched[1], model(ids[1:, :2])[0], FP32, "encoder classifier padded vs alone")
    # rebuilt from its config through the registry: the same architecture, weights loadable
    again = family("encoder-classifier").default.build(EncoderClassifierConfig(**model.config.__dict__))
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.eval()(ids, attention_mask=mask), batched)
    with pytest.raises(ValueError, match="not a base encoder"):
        EncoderClassifier(EncoderClassifierConfig("gpt2", "GPT2LMHeadModel", model.config.base_config))
