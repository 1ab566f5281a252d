"""Processors: what turns a user's data into a model's main input, saved beside the model.

A model declares its main input through its kind (:data:`attnlab.models.registry.KINDS`):
token ids for text, pixel values for images. A processor makes that input from what a user has
and is saved with a run and with an exported Hugging Face directory, so that inference sees its
data exactly as training did:

- text: a tokenizer (:mod:`attnlab.tokenizer`: ``encode(text) -> ids``), saved as ``tokenizer.json``;
- images: an :class:`ImageProcessor` (resize, centre crop, rescale, normalise by mean and std),
  saved as ``preprocessor_config.json`` in the layout transformers' image processors read and write.

Both say their ``modality``; :func:`save_processor` writes either into a directory and
:func:`load_processor` reads it back. Reading an image is where a user's file can be wrong, so
:func:`open_image` names the file and the problem in one line.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = ["Processor", "ImageProcessor", "ImageError", "open_image", "load_processor", "save_processor",
           "IMAGE_CONFIG", "RESAMPLE", "IMAGE_SUFFIXES"]

IMAGE_CONFIG = "preprocessor_config.json"
# PIL's resampling filters by the names people use and the integer codes preprocessor_config.json holds
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


@runtime_checkable
class Processor(Protocol):
    """What a run saves for each of its inputs (a tokenizer, an image processor)."""
    modality: str


class ImageError(ValueError):
    """An image file that cannot be read; the message names the file and the problem."""


def open_image(path: str | Path, channels: int = 3):
    """The image at ``path`` as a PIL image with ``channels`` channels (1: grey, "L"; 3: "RGB").
    ImageError naming the file for a file that is missing, not an image, truncated or damaged."""
    from PIL import Image, UnidentifiedImageError
    path = Path(path)
    if channels not in (1, 3):
        raise ValueError(f"open_image: channels must be 1 or 3, got {channels}")
    try:
        with Image.open(path) as img:
            img.load()                     # decode now: a truncated file fails here, not later
            return img.convert("L" if channels == 1 else "RGB")
    except FileNotFoundError:
        raise ImageError(f"{path}: no such image file") from None
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image file that Pillow can read") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{path}: damaged or truncated image ({e})") from None


def _size(value, what: str) -> dict:
    """A size as preprocessor_config.json writes it: {"height", "width"} or {"shortest_edge"}."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value}
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return {"height": int(value[0]), "width": int(value[1])}
    if isinstance(value, dict) and (set(value) == {"height", "width"} or set(value) == {"shortest_edge"}):
        if all(isinstance(v, int) and v > 0 for v in value.values()):
            return {k: int(v) for k, v in value.items()}
    raise ValueError(f"ImageProcessor: {what} must be an int, (height, width), {{'height', 'width'}} or "
                     f"{{'shortest_edge'}} with positive values, got {value!r}")


@dataclass
class ImageProcessor:
    """Images -> pixel_values (B, C, H, W), as transformers' ViT and DeiT image processors do:

    1. resize with PIL (``size``: {"height", "width"} exactly, or {"shortest_edge": s}, keeping the
       aspect ratio) with the ``resample`` filter;
    2. centre-crop to ``crop_size`` (``do_center_crop``; an image smaller than it is padded with zeros);
    3. rescale: x * ``rescale_factor`` (1/255 maps bytes to [0, 1]);
    4. normalise: (x - mean) / std per channel.

    The number of channels is that of ``image_mean`` (1: grey images, 3: RGB). Field names and
    values are preprocessor_config.json's; :meth:`save` and :meth:`load` read and write it.
    """
    size: Any = 224
    resample: int = RESAMPLE["bilinear"]
    do_resize: bool = True
    do_center_crop: bool = False
    crop_size: Any = None
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_processor_type: str = "ViTImageProcessor"
    modality = "image"

    def __post_init__(self):
        self.size = _size(self.size, "size")
        self.crop_size = None if self.crop_size is None else _size(self.crop_size, "crop_size")
        if self.do_center_crop and (self.crop_size is None or "height" not in self.crop_size):
            raise ValueError("ImageProcessor: do_center_crop needs crop_size as (height, width)")
        if isinstance(self.resample, str):
            if self.resample not in RESAMPLE:
                raise ValueError(f"ImageProcessor: resample {self.resample!r} is not one of {', '.join(RESAMPLE)}")
            self.resample = RESAMPLE[self.resample]
        self.image_mean, self.image_std = list(map(float, self.image_mean)), list(map(float, self.image_std))
        if len(self.image_mean) not in (1, 3) or len(self.image_std) != len(self.image_mean):
            raise ValueError(f"ImageProcessor: image_mean and image_std need 1 or 3 values each, got "
                             f"{self.image_mean} and {self.image_std}")
        if any(s <= 0 for s in self.image_std):
            raise ValueError(f"ImageProcessor: image_std must be positive, got {self.image_std}")

    @property
    def channels(self) -> int:
        return len(self.image_mean)

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(H, W) of every processed image; None when it follows each image (shortest-edge resize, no crop)."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        return None

    def _resized(self, img):
        w, h = img.size
        if "height" in self.size:
            new = (self.size["width"], self.size["height"])
        else:                                        # the short side to s, the long side in proportion
            s = self.size["shortest_edge"]
            new = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
            if (w <= h and w == s) or (h <= w and h == s):
                new = (w, h)
        return img if new == (w, h) else img.resize(new, resample=self.resample)

    def _cropped(self, x: np.ndarray) -> np.ndarray:
        """Centre crop of an (H, W, C) array; zero padding where the image is smaller."""
        ch, cw = self.crop_size["height"], self.crop_size["width"]
        h, w = x.shape[:2]
        if ch > h or cw > w:                       # pad to at least the crop, the image in the middle
            H, W = max(h, ch), max(w, cw)
            padded = np.zeros((H, W, x.shape[2]), dtype=x.dtype)
            top, left = -(-(H - h) // 2), -(-(W - w) // 2)
            padded[top:top + h, left:left + w] = x
            x, h, w = padded, H, W
        top, left = (h - ch) // 2, (w - cw) // 2
        return x[top:top + ch, left:left + cw]

    def resized(self, image) -> Tensor:
        """Steps 1-2 on one image (a PIL image, a path, or an (H, W[, C]) uint8 array): the resized,
        cropped bytes as a (C, H, W) uint8 tensor, a quarter of the memory of finished pixels (a
        task keeps a data set in this form and finishes each batch)."""
        from PIL import Image
        if isinstance(image, (str, Path)):
            image = open_image(image, self.channels)
        elif isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        if not isinstance(image, Image.Image):
            raise TypeError(f"ImageProcessor: expected a PIL image, a path or a uint8 array, got "
                            f"{type(image).__name__}")
        image = image.convert("L" if self.channels == 1 else "RGB")
        if self.do_resize:
            image = self._resized(image)
        x = np.asarray(image)
        x = x[..., None] if x.ndim == 2 else x
        if self.do_center_crop:
            x = self._cropped(x)
        return torch.from_numpy(np.array(x)).permute(2, 0, 1).contiguous()      # a copy: PIL's buffer is read-only

    def finish(self, data: Tensor) -> Tensor:
        """Steps 3-4 on (..., C, H, W) bytes from :meth:`resized`: float32 pixel values."""
        x = data.double() * self.rescale_factor if self.do_rescale else data.double()
        x = x.float()
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None, None]
            std = torch.tensor(self.image_std, dtype=torch.float32)[:, None, None]
            x = (x - mean) / std
        return x

    def pixels(self, image) -> Tensor:
        """One image (as :meth:`resized` takes it) -> pixel values (C, H, W) float32."""
        return self.finish(self.resized(image))

    def __call__(self, images: Sequence) -> Tensor:
        """pixel_values (B, C, H, W) for a sequence of images (each as :meth:`resized` takes it)."""
        if self.output_size is None and len(images) > 1:
            raise ValueError("ImageProcessor: a shortest-edge resize without a centre crop gives images of "
                             "different sizes; process them one at a time or set crop_size")
        return self.finish(torch.stack([self.resized(img) for img in images]))

    # ------------------------------------------------------------------ preprocessor_config.json
    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if not (k == "crop_size" and v is None)}

    def save(self, directory: str | Path, name: str | None = None) -> str:
        name = name or IMAGE_CONFIG
        Path(directory, name).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return name

    @classmethod
    def from_dict(cls, data: dict, where: str = IMAGE_CONFIG) -> "ImageProcessor":
        """From preprocessor_config.json's fields; fields attnlab does not use (a processor class's
        own extras) are ignored, wrong values are a ValueError naming the file."""
        known = {f for f in cls.__dataclass_fields__}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("size"), dict):        # transformers may write both kinds of key, unused as None
            kwargs["size"] = {k: v for k, v in kwargs["size"].items() if v is not None}
        if isinstance(kwargs.get("crop_size"), dict):
            kwargs["crop_size"] = {k: v for k, v in kwargs["crop_size"].items() if v is not None}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ImageProcessor":
        """From a preprocessor_config.json file or a directory holding one."""
        path = Path(path)
        file = path / IMAGE_CONFIG if path.is_dir() else path
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"{file}: no image processor configuration") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file}: not readable JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{file}: expected a JSON object, found {type(data).__name__}")
        return cls.from_dict(data, str(file))


def load_processor(path: str | Path, modality: str | None = None):
    """The processor of ``modality`` saved at ``path`` (a file, or a directory holding the usual
    file): a tokenizer for "text" (:func:`attnlab.tokenizer.load_tokenizer`), an
    :class:`ImageProcessor` for "image"; None: an image processor where a directory holds
    preprocessor_config.json, its tokenizer otherwise."""
    if modality is None:
        modality = "image" if Path(path, IMAGE_CONFIG).is_file() else "text"
    if modality == "text":
        from .tokenizer import load_tokenizer
        return load_tokenizer(path)
    if modality == "image":
        return ImageProcessor.load(path)
    raise ValueError(f"load_processor: no processor for modality {modality!r} (text, image)")


def save_processor(processor, directory: str | Path, name: str | None = None) -> str:
    """Write ``processor`` into ``directory`` under its usual file name (or ``name``); return the name."""
    if isinstance(processor, ImageProcessor):
        return processor.save(directory, name)
    name = name or "tokenizer.json"
    processor.save(Path(directory) / name)
    return name
