"""An image family defined and registered in this file alone: proof that a family of another
modality needs its own module and nothing else. It declares a kind of its own (patch features,
with pixel_values input), registers a classifier of the registry's "image-classifier" kind, meets
the contract (tests/contract.py), trains through ``attnlab train image`` on a folder of PNGs
written here, saves and reloads its image processor, and classifies and scores PNGs through the
commands. No file outside this one names it.

    pixel_values (B, C, H, W) -> Conv2d patches (B, P, E) -> [CLS] + learned positions
        -> N x Pre-Norm [attention, feed-forward] -> LayerNorm -> head on [CLS]
"""
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import contract
from attnlab.models.pretrained import SavePretrained
from attnlab.models.registry import KINDS, family, register_family, register_kind
from attnlab.nn import FeedForward, LayerNorm, MultiHeadAttention
from attnlab.processors import ImageProcessor


@dataclass
class ToyViTConfig:
    image_size: int = 16
    patch_size: int = 4
    in_channels: int = 3
    d_model: int = 32
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 64
    num_labels: int = 3
    dropout: float = 0.0


class ToyLayer(nn.Module):
    def __init__(self, c: ToyViTConfig):
        super().__init__()
        self.attn_norm, self.ff_norm = LayerNorm(c.d_model), LayerNorm(c.d_model)
        self.attn = MultiHeadAttention(c.d_model, c.num_heads, c.dropout)
        self.ff = FeedForward(c.d_model, c.d_ff, activation="gelu", dropout=c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))[0]
        return x + self.ff(self.ff_norm(x))


class ToyPatchEncoder(SavePretrained, nn.Module):
    """forward(pixel_values (B, C, H, W)) -> (B, 1 + P, E): the class token, then one vector per patch."""

    def __init__(self, config: ToyViTConfig):
        super().__init__()
        self.config = c = config
        self.patches = nn.Conv2d(c.in_channels, c.d_model, c.patch_size, stride=c.patch_size)
        n = (c.image_size // c.patch_size) ** 2
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.position = nn.Parameter(0.02 * torch.randn(1, 1 + n, c.d_model))
        self.layers = nn.ModuleList(ToyLayer(c) for _ in range(c.num_layers))
        self.norm = LayerNorm(c.d_model)

    def forward(self, pixel_values: Tensor) -> Tensor:
        x = self.patches(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.size(0), -1, -1), x], 1) + self.position
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class ToyViTClassifier(SavePretrained, nn.Module):
    """forward(pixel_values (B, C, H, W)) -> logits (B, num_labels), from the class token."""

    def __init__(self, config: ToyViTConfig):
        super().__init__()
        self.config = config
        self.encoder = ToyPatchEncoder(config)
        self.head = nn.Linear(config.d_model, config.num_labels)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.head(self.encoder(pixel_values)[:, 0])


def build_config(*, image_size, patch_size, in_channels, d_model, num_heads, num_layers, d_ff=None, dropout=0.0,
                 num_labels=2) -> ToyViTConfig:
    return ToyViTConfig(image_size, patch_size, in_channels, d_model, num_heads, num_layers, d_ff or 2 * d_model,
                        num_labels, dropout)


def _patches(c, x) -> tuple:
    return x["pixel_values"].size(0), 1 + (c.image_size // c.patch_size) ** 2, c.d_model


if "toy-patch-features" not in KINDS:
    register_kind("toy-patch-features", modality="image", example=KINDS["image-classifier"].example, shapes=_patches,
                  outputs=("last_hidden_state",),
                  does="forward(pixel_values (B, C, H, W)) -> (B, 1 + P, E): the class token and each patch")
TOY = register_family("toy-vit", ToyViTConfig, modality="image", presets={"tiny": {}}, build_config=build_config,
                      limits=lambda c: {"image_size": c.image_size, "patch_size": c.patch_size,
                                        "in_channels": c.in_channels})
TOY.register("ToyViTClassifier", ToyViTClassifier, kind="image-classifier")
TOY.register("ToyPatchEncoder", ToyPatchEncoder, kind="toy-patch-features")


# ----------------------------------------------------------------------------- tests
def test_the_kinds_say_what_the_models_take():
    assert KINDS["image-classifier"].main_input == "pixel_values" and KINDS["causal-lm"].main_input == "input_ids"
    assert KINDS["toy-patch-features"].modality == "image"
    assert family("toy-vit").input_limits(ToyViTConfig()) == {"image_size": 16, "patch_size": 4, "in_channels": 3}
    with pytest.raises(ValueError, match="needs image_size, patch_size, in_channels"):
        TOY.build_config(d_model=8, num_heads=2, num_layers=1)
    with pytest.raises(ValueError, match="kind 'causal-lm' takes text input, the family's modality is 'image'"):
        TOY.register("Other", ToyViTClassifier, kind="causal-lm")
    with pytest.raises(ValueError, match="Linear has no save_pretrained; every model has one"):
        TOY.register("Other", nn.Linear, kind="image-classifier")


@pytest.mark.parametrize("name", ["ToyViTClassifier", "ToyPatchEncoder"])
def test_the_toy_image_family_meets_the_contract(name, tmp_path):
    contract.run_contract(TOY.architectures[name], tmp_path)


def _write_images(root, per_class=16, seed=0):
    """Three classes told apart by their dominant colour, at sizes that need resizing."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    for c, label in enumerate(["blue", "green", "red"]):
        (root / label).mkdir(parents=True)
        for i in range(per_class):
            h, w = rng.integers(12, 30, 2)
            x = rng.integers(0, 90, (h, w, 3))
            x[..., 2 - c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / label / f"{i:03d}.png")


def test_trains_through_the_image_task_and_classifies_pngs(tmp_path, capsys):
    from attnlab.cli import main
    from attnlab.tasks import open_run
    data = tmp_path / "images"
    _write_images(data / "train")
    _write_images(data / "val", per_class=4, seed=1)
    (data / "train" / "README.txt").write_text("not an image: ignored")
    run = tmp_path / "run"
    assert main(["train", "image", "--model", "toy-vit", "--data", str(data), "--out", str(run), "--steps", "30",
                 "--image-size", "16", "--patch-size", "4", "--d-model", "32", "--heads", "2", "--layers", "1",
                 "--batch-size", "16", "--lr", "3e-3", "--warmup", "3", "--eval-every", "15", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "48 training images, 12 validation; 3 classes: blue, green, red" in err and "ToyViTClassifier" in err
    info = open_run(run)
    assert info.task == "image" and info.processors == {"image": {"modality": "image",
                                                                  "file": "preprocessor_config.json"}}
    saved = ImageProcessor.load(info.path)
    assert saved.size == {"height": 16, "width": 16} and saved.channels == 3
    evals = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "eval"' in line]
    assert len(evals) == 2

    from PIL import Image
    probe = tmp_path / "probe.png"
    Image.fromarray(np.full((20, 20, 3), (230, 20, 20), dtype=np.uint8)).save(probe)
    assert main(["classify", str(run), str(probe), "--top", "3"]) == 0
    line = capsys.readouterr().out.strip().split("\t")
    assert line[0] == "red" and len(line) == 6 and abs(sum(map(float, line[1::2])) - 1) < 1e-3

    assert main(["eval", str(run), "--data", str(data / "val")]) == 0
    out = capsys.readouterr().out
    assert "12 images" in out and "accuracy" in out
    accuracy = float(out.split("accuracy ")[1].split("%")[0])
    assert accuracy >= 75.0, out

    (tmp_path / "broken.png").write_text("not a png")
    assert main(["classify", str(run), str(tmp_path / "broken.png")]) == 2
    assert "broken.png: not an image file that Pillow can read" in capsys.readouterr().err


def test_an_image_folder_that_is_wrong_is_named(tmp_path, capsys):
    from attnlab.cli import main
    (tmp_path / "flat").mkdir()
    from PIL import Image
    Image.new("RGB", (8, 8)).save(tmp_path / "flat" / "a.png")
    assert main(["train", "image", "--model", "toy-vit", "--data", str(tmp_path / "flat"), "--steps", "1",
                 "--out", str(tmp_path / "r")]) == 2
    assert "no class folders" in capsys.readouterr().err
    assert main(["train", "image", "--model", "toy-vit", "--data", str(tmp_path / "flat" / "a.png"), "--steps", "1",
                 "--out", str(tmp_path / "r")]) == 2
    assert "a.png: a file; give a directory (an image folder: one sub-folder of images per class)" in \
        capsys.readouterr().err
    _write_images(tmp_path / "one", per_class=3)
    for label in ("green", "red"):
        for f in (tmp_path / "one" / label).iterdir():
            f.unlink()
        (tmp_path / "one" / label).rmdir()
    assert main(["train", "image", "--model", "toy-vit", "--data", str(tmp_path / "one"), "--steps", "1",
                 "--out", str(tmp_path / "r")]) == 2
    assert "a classifier needs at least two" in capsys.readouterr().err
