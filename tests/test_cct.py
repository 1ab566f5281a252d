"""The ViT family's convolutional tokeniser and sequence pooling (a Compact Convolutional
Transformer, Hassani et al. 2021) against an independent reference: the same network written with
plain PyTorch modules (Conv2d, ReLU, MaxPool2d, nn.TransformerEncoderLayer, LayerNorm, a Linear
scoring each token) holding identical weights; saved and loaded back (a Hugging Face-style
directory and an `attnlab train image` run) unchanged.

Tolerance: fp32, 1e-5 relative to the logits' scale (tests/_tolerance.py)."""
import pytest
import torch
from torch import nn

import attnlab
from attnlab.cli import main
from attnlab.models.vit import VisionTransformer, build_config
from attnlab.nn.patch import ConvTokenizer, PatchEmbedding
from _tolerance import FP32, assert_close_scaled


class _Reference(nn.Module):
    """CCT from torch.nn's own modules: conv tokeniser, learned positions, Pre-Norm encoder layers,
    final LayerNorm, sequence pooling, linear head."""

    def __init__(self, c):
        super().__init__()
        layers, convs = c.patch_size.bit_length() - 1, []
        for i in range(layers):
            convs += [nn.Conv2d(c.in_channels if i == 0 else c.d_model, c.d_model, 3, padding=1, bias=False),
                      nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)]
        self.tokenizer = nn.Sequential(*convs)
        self.positions = nn.Parameter(torch.zeros(1, c.num_patches, c.d_model))
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(c.d_model, c.num_heads, c.d_ff, dropout=0.0, activation="gelu",
                                       layer_norm_eps=c.layer_norm_eps, batch_first=True, norm_first=True)
            for _ in range(c.num_layers))
        self.norm = nn.LayerNorm(c.d_model, eps=c.layer_norm_eps)
        self.score = nn.Linear(c.d_model, 1)
        self.head = nn.Linear(c.d_model, c.num_labels)

    def forward(self, x):
        x = self.tokenizer(x).flatten(2).transpose(1, 2) + self.positions
        for layer in self.encoder:
            x = layer(x)
        x = self.norm(x)
        w = torch.softmax(self.score(x), dim=1)
        return self.head((w.transpose(1, 2) @ x).squeeze(1))


def _copy_into(ref: _Reference, ours: VisionTransformer) -> None:
    o = dict(ours.named_parameters())
    with torch.no_grad():
        convs = [m for m in ref.tokenizer if isinstance(m, nn.Conv2d)]
        for i, conv in enumerate(convs):
            conv.weight.copy_(o[f"patch_embed.convs.{i}.weight"])
        ref.positions.copy_(o["position.weight"])
        for i, layer in enumerate(ref.encoder):
            p = f"layers.{i}."
            for theirs, mine in [("self_attn.in_proj_weight", "self_attn.qkv_proj.weight"),
                                 ("self_attn.in_proj_bias", "self_attn.qkv_proj.bias"),
                                 ("self_attn.out_proj.weight", "self_attn.out_proj.weight"),
                                 ("self_attn.out_proj.bias", "self_attn.out_proj.bias"),
                                 ("norm1.weight", "self_attn_norm.weight"), ("norm1.bias", "self_attn_norm.bias"),
                                 ("linear1.weight", "ff.linear1.weight"), ("linear1.bias", "ff.linear1.bias"),
                                 ("linear2.weight", "ff.linear2.weight"), ("linear2.bias", "ff.linear2.bias"),
                                 ("norm2.weight", "ff_norm.weight"), ("norm2.bias", "ff_norm.bias")]:
                layer.get_parameter(theirs).copy_(o[p + mine])
        for theirs, mine in [("norm.weight", "norm.weight"), ("norm.bias", "norm.bias"),
                             ("score.weight", "seq_pool.proj.weight"), ("score.bias", "seq_pool.proj.bias"),
                             ("head.weight", "head.weight"), ("head.bias", "head.bias")]:
            ref.get_parameter(theirs).copy_(o[mine])
    assert len(o) == sum(1 for _ in ref.parameters())          # every weight of ours has its twin


def _cct(patch_size=4, channels=1, seed=0):
    config = build_config(image_size=16, patch_size=patch_size, in_channels=channels, d_model=32, num_heads=4,
                          num_layers=2, d_ff=64, num_labels=5, pooling="seq", tokenizer="conv")
    torch.manual_seed(seed)
    model = VisionTransformer.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():                       # O(1) weights, norms near 1: every mapping error shows
        for name, p in model.named_parameters():
            p.copy_((1.0 if p.dim() == 1 and "norm" in name and name.endswith("weight") else 0.0)
                    + 0.2 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("patch_size, channels", [(2, 3), (4, 1), (8, 3)])
def test_a_cct_equals_the_same_network_in_plain_pytorch_modules(patch_size, channels):
    ours = _cct(patch_size, channels)
    assert ours.config.prefix_tokens == 0 and not hasattr(ours, "cls_token")      # no class token
    ref = _Reference(ours.config).eval()
    _copy_into(ref, ours)
    x = torch.randn(3, channels, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close_scaled(ours(x), ref(x), FP32, "CCT logits")
    # the tokeniser gives the grid a patch embedding of that size gives
    assert ours.patch_embed.grid == PatchEmbedding(16, patch_size, channels, 32).grid == (16 // patch_size,) * 2


def test_the_conv_tokenizer_alone_and_its_refusals():
    tok = ConvTokenizer(12, 2, 3, 8)
    convs = nn.Sequential(tok.convs[0], nn.ReLU(), nn.MaxPool2d(3, 2, 1), tok.convs[1], nn.ReLU(), nn.MaxPool2d(3, 2, 1))
    x = torch.randn(2, 3, 12, 12)
    assert_close_scaled(tok(x), convs(x).flatten(2).transpose(1, 2), FP32, "tokens")
    assert tok(x).shape == (2, 9, 8) and tok.patch_size == 4
    with pytest.raises(ValueError, match=r"^ConvTokenizer: img_size \(10, 10\) is not a multiple of 2\^layers = 4$"):
        ConvTokenizer(10, 2, 3, 8)
    with pytest.raises(ValueError, match=r"^ConvTokenizer: a 14x12 image; its 2 layers need sides that 4 divides$"):
        tok(torch.randn(1, 3, 14, 12))
    # another size that 4 divides: the grid a patch embedding gives, so the position table interpolates
    model = _cct()
    assert model(torch.randn(1, 1, 24, 24), interpolate_pos_encoding=True).shape == (1, 5)
    with pytest.raises(ValueError, match="patch_size must be 2, 4, 8, ..., got 6"):
        build_config(image_size=12, patch_size=6, in_channels=3, d_model=8, num_heads=2, num_layers=1,
                     tokenizer="conv")


def test_a_cct_saves_and_loads_unchanged_and_transformers_is_told_it_cannot_run_it(tmp_path):
    from attnlab.models.vit import hf_unsupported
    ours = _cct()
    attnlab.save_pretrained(ours, tmp_path)
    back = attnlab.from_pretrained(tmp_path)
    assert back.config == ours.config and back.config.tokenizer == "conv"
    x = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(back(x), ours(x))
    assert "tokenizer='conv'" in hf_unsupported(ours.config)


def test_train_image_with_the_conv_tokenizer_saves_a_run_that_loads_and_scores(tmp_path, capsys):
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for c, label in enumerate(("dark", "light")):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(8):
            Image.fromarray(rng.integers(0, 100, (16, 16)).astype(np.uint8) + 120 * c).save(
                tmp_path / "data" / label / f"{i}.png")
    run = tmp_path / "run"
    code = main(["train", "image", "--data", str(tmp_path / "data"), "--out", str(run), "--steps", "3",
                 "--tokenizer", "conv", "--pooling", "seq", "--image-size", "16", "--patch-size", "4",
                 "--d-model", "16", "--heads", "2", "--layers", "1", "--batch-size", "4", "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err
    from attnlab.tasks import get_task, open_run
    clf = get_task("image").load(open_run(run))
    assert clf.model.config.tokenizer == "conv" and clf.model.config.pooling == "seq"
    assert clf.probabilities([tmp_path / "data" / "dark" / "0.png"]).shape == (1, 2)
