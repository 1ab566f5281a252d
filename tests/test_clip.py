"""CLIP against transformers' CLIPModel, both ways, beyond the registry-wide contract: padded
captions whose end token sits at different positions, the legacy end-of-text rule (eos 2: the
largest id), the projected features, another image size, and the published size.

Tolerance: fp32, 1e-5 relative to the values' scale (tests/_tolerance.py)."""
import pytest
import torch

import attnlab
from attnlab.models.clip import CLIPConfig, CLIPModel, contrastive_loss
from attnlab.models.registry import family
from _tolerance import FP32, assert_close_scaled
from contract import randomize_, tiny_in_transformers

transformers = pytest.importorskip("transformers")


def _randomize(model, seed=0):
    randomize_(model, seed)
    with torch.no_grad():
        model.logit_scale.fill_(1.5)


def _captions(config, eos):
    """Three captions of lengths 7, 4 and 9, each ended by ``eos`` and right-padded with 0."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for row, n in enumerate((7, 4, 9)):
        ids[row, :n - 1] = torch.randint(3, config.vocab_size - 1, (n - 1,), generator=g)
        ids[row, n - 1], mask[row, :n] = eos, 1
    return ids, mask


@pytest.mark.parametrize("eos", [98, 2], ids=["eos-token", "legacy-largest-id"])
def test_from_transformers_with_padded_captions(tmp_path, eos):
    config = family("clip").preset("tiny", eos_token_id=eos)
    hf_config = transformers.CLIPConfig(**attnlab.models.clip.clip_config_to_hf(config))
    torch.manual_seed(0)
    hf = transformers.CLIPModel(hf_config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert isinstance(ours, CLIPModel)
    ids, mask = _captions(config, eos)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask)
        got = ours(ids, pixels, mask)
        for name, g in zip(("logits_per_image", "logits_per_text", "text_embeds", "image_embeds"), got, strict=True):
            assert_close_scaled(g, getattr(want, name), FP32, name)
        assert_close_scaled(ours.image_features(pixels), hf.get_image_features(pixel_values=pixels).pooler_output,
                            FP32, "image features")
        assert_close_scaled(ours.text_features(ids, mask),
                            hf.get_text_features(input_ids=ids, attention_mask=mask).pooler_output, FP32,
                            "text features")
        big = torch.randn(1, 3, 24, 24, generator=torch.Generator().manual_seed(5))
        assert_close_scaled(ours.image_features(big, interpolate_pos_encoding=True),
                            hf.get_image_features(pixel_values=big, interpolate_pos_encoding=True).pooler_output,
                            FP32, "an image of another size")


def test_to_transformers_with_padded_captions(tmp_path):
    config, ours, hf = tiny_in_transformers("clip", CLIPModel, transformers.CLIPModel, tmp_path, 1, _randomize)
    ids, mask = _captions(config, config.eos_token_id)
    pixels = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask)
        got = ours(ids, pixels, mask)
    assert_close_scaled(got[0], want.logits_per_image, FP32, "logits_per_image")
    assert_close_scaled(got[2], want.text_embeds, FP32, "text_embeds")


def test_padding_does_not_change_a_caption():
    config = family("clip").preset("tiny")
    model = CLIPModel(config).eval()
    _randomize(model)
    ids, mask = _captions(config, config.eos_token_id)
    with torch.no_grad():
        alone = model.text_features(ids[1:2, :4])
        padded = model.text_features(ids, mask)[1:2]
    assert_close_scaled(padded, alone, FP32, "a padded caption")


def test_contrastive_loss_is_the_mean_of_both_directions():
    logits = torch.tensor([[3.0, 0.0, 1.0], [0.5, 2.0, 0.0], [0.0, 4.0, 1.0]])
    loss, correct = contrastive_loss(logits)
    target = torch.arange(3)
    want = (torch.nn.functional.cross_entropy(logits, target)
            + torch.nn.functional.cross_entropy(logits.t(), target)) / 2
    torch.testing.assert_close(loss, want)
    assert int(correct) == 2                        # row 2 prefers caption 1


def test_the_published_size_and_bad_configs():
    with torch.device("meta"):
        model = CLIPModel(family("clip").preset("clip-vit-base-patch32"))
    assert sum(p.numel() for p in model.parameters()) == 151_277_313        # openai/clip-vit-base-patch32
    with pytest.raises(ValueError, match="image_size 20 is not a multiple of patch_size 8"):
        CLIPConfig(image_size=20, patch_size=8)
    with pytest.raises(ValueError, match="activation must be one of"):
        CLIPConfig(activation="swish")


def test_a_caption_shared_by_several_images_takes_them_all_as_targets():
    """Four images, three captions (images 0 and 2 share caption 1): image->text is the cross-entropy
    against each image's caption; text->image, per caption, the mean of -log p over its images."""
    logits = torch.tensor([[0.3, 2.0, -1.0], [1.5, 0.0, 0.2], [0.1, 1.0, 0.4], [-0.5, 0.3, 2.5]])
    text_index = torch.tensor([1, 0, 1, 2])
    loss, correct = contrastive_loss(logits, text_index)
    image_to_text = torch.nn.functional.cross_entropy(logits, text_index)
    log_p = logits.t().log_softmax(-1)                       # (texts, images)
    per_text = [-(sum(log_p[t, i] for i in range(4) if text_index[i] == t) / int((text_index == t).sum()))
                for t in range(3)]
    want = (image_to_text + sum(per_text) / 3) / 2
    torch.testing.assert_close(loss, want)
    assert int(correct) == 4
