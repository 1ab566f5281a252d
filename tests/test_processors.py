"""attnlab.processors.ImageProcessor against transformers' own image processors (the PIL backend,
which needs no torchvision) on the same images and the same preprocessor_config.json, both ways;
and the one-line errors for image files that cannot be read.

Tolerance: the pixel values agree to 1e-6 absolute (both resize with PIL on bytes, then rescale
and normalise in float32; the last bit may differ with the order of float operations).
"""
import json

import numpy as np
import pytest
import torch

from attnlab.processors import ImageError, ImageProcessor, load_processor, open_image, save_processor


def _images(seed=0):
    rng = np.random.default_rng(seed)
    from PIL import Image
    # landscape, portrait, square, and one smaller than the crop
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
            ((40, 57), (63, 31), (32, 32), (12, 20))]


def _hf(name):
    import transformers
    return getattr(transformers, name)


CASES = [
    ("ViTImageProcessorPil", dict(size={"height": 24, "width": 24})),
    ("ViTImageProcessorPil", dict(size={"height": 20, "width": 28}, resample=3, image_mean=[0.4, 0.5, 0.6],
                                  image_std=[0.2, 0.25, 0.3])),
    ("DeiTImageProcessorPil", dict(size={"height": 30, "width": 30}, crop_size={"height": 24, "width": 24})),
    ("DeiTImageProcessorPil", dict(size={"shortest_edge": 26}, crop_size={"height": 24, "width": 24})),
    ("DeiTImageProcessorPil", dict(do_resize=False, crop_size={"height": 16, "width": 16}, do_normalize=False)),
]


@pytest.mark.parametrize("cls,kwargs", CASES)
def test_pixel_values_equal_transformers_image_processors(cls, kwargs, tmp_path):
    hf = _hf(cls)(**kwargs)
    hf.save_pretrained(tmp_path)                       # the reference writes the file; we read it
    ours = ImageProcessor.load(tmp_path)
    assert ours.do_center_crop == bool(getattr(hf, "do_center_crop", False))
    for img in _images():
        want = hf(img, return_tensors="pt")["pixel_values"][0]
        got = ours([img])[0]
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_a_saved_processor_is_read_by_transformers(tmp_path):
    ours = ImageProcessor(size={"height": 30, "width": 30}, do_center_crop=True, crop_size=24, resample="bicubic",
                          image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225],
                          image_processor_type="DeiTImageProcessor")
    assert save_processor(ours, tmp_path) == "preprocessor_config.json"
    import transformers
    hf = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    assert type(hf).__name__.startswith("DeiTImageProcessor")
    for img in _images(1):
        torch.testing.assert_close(ours([img])[0], hf(img, return_tensors="pt")["pixel_values"][0], rtol=0, atol=1e-6)
    back = load_processor(tmp_path, "image")
    assert back == ours


def test_grey_images_have_one_channel(tmp_path):
    from PIL import Image
    p = ImageProcessor(size=8, image_mean=[0.5], image_std=[0.5])
    img = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8))
    x = p([img, img.convert("RGB")])                   # an RGB file is read as grey too
    assert x.shape == (2, 1, 8, 8)
    torch.testing.assert_close(x[0, 0], (torch.arange(64.).view(8, 8) / 255 - 0.5) / 0.5)


def test_bad_image_files_are_named(tmp_path):
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ImageError, match=r"text\.png: not an image file"):
        open_image(tmp_path / "text.png")
    _images()[0].save(tmp_path / "ok.png")
    data = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match=r"cut\.png: damaged or truncated image"):
        open_image(tmp_path / "cut.png")
    with pytest.raises(ImageError, match=r"gone\.png: no such image file"):
        open_image(tmp_path / "gone.png")


def test_bad_configurations_are_refused(tmp_path):
    with pytest.raises(ValueError, match="do_center_crop needs crop_size"):
        ImageProcessor(do_center_crop=True)
    with pytest.raises(ValueError, match="image_std must be positive"):
        ImageProcessor(image_std=[0.5, 0.0, 0.5])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"height": -3, "width": 4}}))
    with pytest.raises(ValueError, match=r"preprocessor_config\.json: ImageProcessor: size must be"):
        ImageProcessor.load(tmp_path)
