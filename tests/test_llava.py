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
from contract import randomize_ as _randomize, tiny_in_transformers

transformers = pytest.importorskip("transformers")


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
    config, ours, hf = tiny_in_transformers("llava", LlavaForConditionalGeneration,
                                            transformers.LlavaForConditionalGeneration, tmp_path)
    ids, pixels, mask = _batch(config)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=pixels, attention_mask=mask).logits
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


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_image_tokens_are_expanded_as_transformers_processor_does(strategy):
    """transformers' LlavaProcessor turns one "<image>" into as many tokens as the tower gives
    features; expand_image_tokens on the ids with one placeholder gives the same ids."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers
    config = family("llava").preset("tiny", vision_feature_select_strategy=strategy)
    vocab = {"<unk>": 0, "USER:": 1, "what": 2, "digit?": 3, "<image>": config.image_token_id}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                                            vision_feature_select_strategy=strategy, image_token="<image>",
                                            num_additional_image_tokens=1)
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    got = processor(text="USER: <image> what digit?", images=image)["input_ids"][0]
    want = expand_image_tokens([1, config.image_token_id, 2, 3], config.image_token_id, config.image_tokens)
    assert list(got) == want and config.image_tokens == 16 + (strategy == "full")
