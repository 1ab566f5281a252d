"""LLaVA against transformers' LlavaForConditionalGeneration, both ways, on a small random config
(a CLIP vision tower, the projector, a LLaMA): two images in a left-padded batch, the feature
layer and class-row strategies, the image tokens expanded as transformers' processor does, and a
mismatch in their number refused in one line.

Tolerance: fp32, 1e-5 relative to the logits' scale (tests/_tolerance.py)."""
import pytest
import torch

import attnlab
from attnlab.models.llava import LlavaForConditionalGeneration, expand_image_tokens, llava_config_to_hf
from attnlab.models.registry import family
from _tolerance import FP32, assert_close_scaled

transformers = pytest.importorskip("transformers")


def _randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if p.dim() == 1 and name.endswith("weight") else 0.0
            p.copy_(mean + 0.2 * torch.randn(p.shape, generator=g))


def _batch(config):
    """Two prompts, the second left-padded by 3, each with one image's tokens expanded from one placeholder."""
    image = config.image_token_id
    first = expand_image_tokens([5, image, 7, 8, 9, 10], image, config.image_tokens)
    second = [0, 0, 0] + expand_image_tokens([11, image, 12], image, config.image_tokens)
    ids = torch.tensor([first, second])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    return ids, pixels, mask


@pytest.mark.parametrize("layer, strategy", [(-2, "default"), (1, "full")])
def test_from_transformers(tmp_path, layer, strategy):
    config = family("llava").preset("tiny", vision_feature_layer=layer, vision_feature_select_strategy=strategy)
    hf_config = transformers.LlavaConfig(**llava_config_to_hf(config))
    torch.manual_seed(0)
    hf = transformers.LlavaForConditionalGeneration(hf_config).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert isinstance(ours, LlavaForConditionalGeneration) and ours.config == config
    ids, pixels, mask = _batch(config)
    assert ids.size(1) == 5 + config.image_tokens
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits
        got = ours(ids, pixels, mask)
    real = mask.bool()
    assert_close_scaled(got[real], want[real], FP32, "logits of the real tokens")


def test_to_transformers(tmp_path):
    config = family("llava").preset("tiny")
    torch.manual_seed(1)
    ours = LlavaForConditionalGeneration(config).eval()
    _randomize(ours, 1)
    ours.save_pretrained(tmp_path)
    hf, info = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    ids, pixels, mask = _batch(config)
    with torch.no_grad():
        want = hf.eval()(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits
        got = ours(ids, pixels, mask)
    real = mask.bool()
    assert_close_scaled(got[real], want[real], FP32, "logits of the real tokens")
    # the tower's layer past the feature layer is read by nothing: kept (saved), not trained
    assert "vision_tower.layers.2.ff.linear1.weight" in dict(ours.named_buffers())
    assert all(not n.startswith("vision_tower.layers.2") for n, _ in ours.named_parameters())


def test_the_image_tokens_must_match_the_images():
    config = family("llava").preset("tiny")
    model = LlavaForConditionalGeneration(config).eval()
    ids, pixels, mask = _batch(config)
    assert model(ids[:1], pixels[:1], mask[:1]).shape == (1, ids.size(1), config.text.vocab_size)
    with pytest.raises(ValueError, match=r"input_ids hold 32 image tokens, the 1 image\(s\) give 16 each"):
        model(ids, pixels[:1], mask)
