"""Processors: what turns a user's data into a model's main input, saved beside the model.

A model declares its main input through its kind (:data:`attnlab.models.registry.KINDS`):
token ids for text, pixel values for images. A processor makes that input from what a user has
and is saved with a run and with an exported Hugging Face directory, so that inference sees its
data exactly as training did:

- text: a tokenizer (:mod:`attnlab.tokenizer`: ``encode(text) -> ids``), saved as ``tokenizer.json``;
- images: an :class:`ImageProcessor` (resize, centre crop, rescale, normalise by mean and std),
  saved as ``preprocessor_config.json`` in the layout transformers' image processors read and write;
- audio: a :class:`LogMelFeatureExtractor` (a waveform padded to a fixed chunk -> log-mel frames),
  saved as ``preprocessor_config.json`` in the layout of transformers' WhisperFeatureExtractor.

Each says its ``modality``; :func:`save_processor` writes any of them into a directory and
:func:`load_processor` reads it back. Reading an image or a sound is where a user's file can be
wrong, so :func:`open_image` and :func:`read_wav` name the file and the problem in one line.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = ["Processor", "ImageProcessor", "ImageError", "open_image", "load_processor", "save_processor",
           "IMAGE_CONFIG", "RESAMPLE", "IMAGE_SUFFIXES", "PROCESSOR_FILES", "LogMelFeatureExtractor", "AudioError",
           "read_wav", "write_wav", "mel_filter_bank"]

IMAGE_CONFIG = "preprocessor_config.json"
# PIL's resampling filters by the names people use and the integer codes preprocessor_config.json holds
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
# the file each modality's processor is saved as (transformers keeps image and audio settings in one name)
PROCESSOR_FILES = {"text": "tokenizer.json", "image": IMAGE_CONFIG, "audio": IMAGE_CONFIG}
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
        return cls.from_dict(*_read_config(path, "image processor"))


# ----------------------------------------------------------------------------- audio
class AudioError(ValueError):
    """A sound file that cannot be used; the message names the file and the problem."""


def read_wav(path: str | Path) -> tuple[Tensor, int]:
    """A 16-bit PCM WAV file -> (samples (N,) float32 in [-1, 1), sampling rate). Several
    channels are averaged to one. AudioError naming the file for a file that is missing, not a
    WAV, not 16-bit PCM, or shorter than its header says."""
    import wave
    path = Path(path)
    try:
        with wave.open(str(path), "rb") as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            if width != 2:
                raise AudioError(f"{path}: {8 * width}-bit samples; attnlab reads 16-bit PCM WAV files")
            data = w.readframes(frames)
    except FileNotFoundError:
        raise AudioError(f"{path}: no such sound file") from None
    except IsADirectoryError:
        raise AudioError(f"{path}: a directory, not a sound file") from None
    except (wave.Error, EOFError) as e:       # not RIFF/WAVE, an unknown format (float, A-law, ...), damaged
        raise AudioError(f"{path}: not a 16-bit PCM WAV file ({e})") from None
    if len(data) != frames * channels * width:
        raise AudioError(f"{path}: truncated WAV file ({len(data)} bytes of samples, the header says "
                         f"{frames * channels * width})")
    x = torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0)
    return x.view(-1, channels).mean(1) if channels > 1 else x, rate


def write_wav(path: str | Path, samples: Tensor | np.ndarray, sampling_rate: int) -> None:
    """Write mono samples in [-1, 1] as a 16-bit PCM WAV file (values outside are clipped)."""
    import wave
    x = np.clip(np.asarray(samples, dtype=np.float64), -1.0, 32767 / 32768)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sampling_rate))
        w.writeframes(np.round(x * 32768).astype("<i2").tobytes())


def _hz_to_mel(f: Tensor) -> Tensor:
    """Slaney's mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per
    factor 6.4), so that 1 kHz is 15 mels."""
    return torch.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + torch.log(f / 1000.0) * (27.0 / math.log(6.4)))


def _mel_to_hz(m: Tensor) -> Tensor:
    return torch.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * torch.exp((m - 15.0) * (math.log(6.4) / 27.0)))


def mel_filter_bank(n_fft: int, n_mels: int, sampling_rate: int, f_min: float = 0.0, f_max: float = 8000.0) -> Tensor:
    """Triangular filters (n_fft // 2 + 1, n_mels), float64, that turn a power spectrum's
    frequency bins into mel bands. The n_mels + 2 edges are equally spaced on Slaney's mel scale
    from f_min to f_max; filter m rises linearly from edge m to edge m + 1 and falls to edge
    m + 2 (in Hz), and is scaled by 2 / (width in Hz) so that every band has the same area."""
    edges = _mel_to_hz(torch.linspace(float(_hz_to_mel(torch.tensor(float(f_min), dtype=torch.float64))),
                                      float(_hz_to_mel(torch.tensor(float(f_max), dtype=torch.float64))),
                                      n_mels + 2, dtype=torch.float64))
    bins = torch.linspace(0, sampling_rate // 2, n_fft // 2 + 1, dtype=torch.float64)[:, None]    # (F, 1)
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]                                    # (M,) each
    rising = (bins - lower) / (centre - lower)
    falling = (upper - bins) / (upper - centre)
    return torch.clamp(torch.minimum(rising, falling), min=0.0) * (2.0 / (upper - lower))


@dataclass
class LogMelFeatureExtractor:
    """Waveforms -> log-mel input_features (B, feature_size, frames), as transformers'
    WhisperFeatureExtractor computes them:

    1. each waveform (float32 samples at ``sampling_rate``) is cut or padded with
       ``padding_value`` to ``chunk_length`` seconds (``n_samples``); with ``do_normalize`` it is
       then shifted and scaled to zero mean and unit variance over its real samples (the padding
       set back to ``padding_value``);
    2. a short-time Fourier transform: Hann windows of ``n_fft`` samples every ``hop_length``
       (centred, the signal reflected at both ends), the last frame dropped, so ``n_samples /
       hop_length`` frames; the power |X|^2 of each bin;
    3. the mel filter bank (:func:`mel_filter_bank`, 0 to 8 kHz) maps bins to ``feature_size`` bands;
    4. log10 of the band power, floored at 1e-10; dynamic range limited to 8 (80 dB) below the
       loudest value of each example; then (x + 4) / 4, which brings speech to about [-1, 1].

    Field names and values are preprocessor_config.json's (:meth:`save`, :meth:`load`).
    """
    feature_size: int = 80
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30
    n_fft: int = 400
    padding_value: float = 0.0
    dither: float = 0.0
    return_attention_mask: bool = False
    padding_side: str = "right"
    feature_extractor_type: str = "WhisperFeatureExtractor"
    modality = "audio"

    def __post_init__(self):
        for name in ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"LogMelFeatureExtractor: {name} must be a positive integer, got {v!r}")
        if self.dither != 0.0:       # random noise per call: nothing a saved run could reproduce
            raise ValueError(f"LogMelFeatureExtractor: dither must be 0.0, got {self.dither}")
        if self.padding_side != "right":
            raise ValueError(f"LogMelFeatureExtractor: padding_side must be 'right', got {self.padding_side!r}")
        self.padding_value = float(self.padding_value)

    @property
    def n_samples(self) -> int:
        """Samples in one chunk: every waveform is cut or padded to this length."""
        return self.chunk_length * self.sampling_rate

    @property
    def nb_max_frames(self) -> int:
        """Frames of features per chunk."""
        return self.n_samples // self.hop_length

    def mel_filters(self) -> Tensor:
        return mel_filter_bank(self.n_fft, self.feature_size, self.sampling_rate)

    def _chunk(self, wave: Tensor, do_normalize: bool) -> Tensor:
        x = wave.to(torch.float32).reshape(-1)[:self.n_samples]
        n = x.numel()
        if do_normalize:
            # in numpy's float32 (pairwise sums, a true division), as transformers computes it: after
            # the shift, silence is a constant whose tiny power the log magnifies, so the rounding
            # shows in the frames where a sound stops (torch divides by a scalar's reciprocal)
            v = x.numpy()
            x = torch.from_numpy((v - v.mean()) / np.sqrt(v.var() + np.float32(1e-7)))
        out = torch.full((self.n_samples,), self.padding_value, dtype=torch.float32)
        out[:n] = x
        return out

    def __call__(self, waveforms: Sequence, sampling_rate: int | None = None, do_normalize: bool = False) -> Tensor:
        """input_features (B, feature_size, nb_max_frames) float32 for a sequence of mono
        waveforms (1-D tensors, arrays or lists of samples); ``sampling_rate``, if given, must be
        the extractor's (nothing is resampled)."""
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"LogMelFeatureExtractor: audio at {sampling_rate} Hz, the extractor takes "
                             f"{self.sampling_rate} Hz (resample it first)")
        waves = [torch.as_tensor(np.asarray(w, dtype=np.float32)) for w in waveforms]
        if not waves or any(w.dim() != 1 or w.numel() == 0 for w in waves):
            raise ValueError("LogMelFeatureExtractor: expected a non-empty sequence of non-empty mono (1-D) waveforms")
        x = torch.stack([self._chunk(w, do_normalize) for w in waves])                       # (B, N)
        window = torch.hann_window(self.n_fft)
        spec = torch.stft(x, self.n_fft, self.hop_length, window=window, center=True, pad_mode="reflect",
                          return_complex=True)[..., :-1]                                      # (B, F, frames)
        power = spec.abs() ** 2
        mel = self.mel_filters().to(torch.float32).T @ power                                  # (B, M, frames)
        log = torch.clamp(mel, min=1e-10).log10()
        log = torch.maximum(log, log.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log + 4.0) / 4.0

    def features(self, path: str | Path) -> Tensor:
        """input_features (feature_size, nb_max_frames) of one WAV file (:func:`read_wav`);
        AudioError naming the file when its rate is not the extractor's."""
        wave, rate = read_wav(path)
        if rate != self.sampling_rate:
            raise AudioError(f"{path}: sampled at {rate} Hz; the model takes {self.sampling_rate} Hz audio "
                             f"(resample it, e.g. sox in.wav -r {self.sampling_rate} out.wav)")
        if wave.numel() == 0:
            raise AudioError(f"{path}: holds no samples")
        return self([wave])[0]

    # ------------------------------------------------------------------ preprocessor_config.json
    def to_dict(self) -> dict:
        return {**asdict(self), "n_samples": self.n_samples, "nb_max_frames": self.nb_max_frames}

    def save(self, directory: str | Path, name: str | None = None) -> str:
        name = name or IMAGE_CONFIG
        Path(directory, name).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return name

    @classmethod
    def from_dict(cls, data: dict, where: str = IMAGE_CONFIG) -> "LogMelFeatureExtractor":
        """From preprocessor_config.json's fields (the derived n_samples and nb_max_frames are
        recomputed); wrong values are a ValueError naming the file."""
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "LogMelFeatureExtractor":
        """From a preprocessor_config.json file or a directory holding one."""
        return cls.from_dict(*_read_config(path, "feature extractor"))


def _read_config(path: str | Path, what: str) -> tuple[dict, str]:
    path = Path(path)
    file = path / IMAGE_CONFIG if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{file}: no {what} configuration") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data, str(file)


def load_processor(path: str | Path, modality: str | None = None):
    """The processor of ``modality`` saved at ``path`` (a file, or a directory holding the usual
    file): a tokenizer for "text" (:func:`attnlab.tokenizer.load_tokenizer`), an
    :class:`ImageProcessor` for "image", a :class:`LogMelFeatureExtractor` for "audio"; None: what
    a directory's preprocessor_config.json holds (a feature extractor's names a
    ``feature_extractor_type``), its tokenizer where it has none."""
    if modality is None:
        config = Path(path, IMAGE_CONFIG)
        modality = "text"
        if config.is_file():
            modality = "audio" if "feature_extractor_type" in _read_config(config, "processor")[0] else "image"
    if modality == "text":
        from .tokenizer import load_tokenizer
        return load_tokenizer(path)
    if modality == "image":
        return ImageProcessor.load(path)
    if modality == "audio":
        return LogMelFeatureExtractor.load(path)
    raise ValueError(f"load_processor: no processor for modality {modality!r} (text, image, audio)")


def save_processor(processor, directory: str | Path, name: str | None = None) -> str:
    """Write ``processor`` into ``directory`` under its usual file name (or ``name``); return the name."""
    if isinstance(processor, (ImageProcessor, LogMelFeatureExtractor)):
        return processor.save(directory, name)
    name = name or "tokenizer.json"
    processor.save(Path(directory) / name)
    return name
