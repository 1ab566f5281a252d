"""The Vision Transformer and its blocks against independent references: the chapter's example,
PatchEmbedding against patches cut by hand, the position table's resizing against transformers'
``interpolate_pos_encoding``, and ViTForImageClassification / ViTModel against transformers with
the same weights, at the trained size and at others."""
import pytest
import torch
import torch.nn.functional as F

import attnlab
import attnlab.models  # noqa: F401  (registers every family)
import contract
from _tolerance import FP32, FP32_OP, assert_close_scaled
from attnlab.models.vit import ViTConfig, ViTModel, VisionTransformer
from attnlab.nn.norm import DyT, LayerNorm
from attnlab.nn.patch import PatchEmbedding, PatchPositionEmbedding, interpolate_grid_table
from attnlab.train import split_decay

transformers = pytest.importorskip("transformers")

HF_SIZES = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48, num_attention_heads=4,
                num_hidden_layers=2, intermediate_size=96)


def _pixels(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _hf(cls, seed=0, **overrides):
    config = transformers.ViTConfig(**{**HF_SIZES, "num_labels": 5, **overrides})
    torch.manual_seed(seed)
    model = cls(config)
    contract.randomize_(model, seed)
    return model.eval()


def test_the_chapters_example_runs_as_written():
    model = VisionTransformer(img_size=224, patch_size=16, num_classes=10)
    assert model(torch.randn(2, 3, 224, 224)).shape == (2, 10)
    # 224 / 16 = 14 patches a side: 196 patches of 16 * 16 * 3 = 768 values, plus the class token
    assert model.patch_embed.num_patches == 196 and model.position.weight.shape == (1, 197, 768)
    assert model.patch_embed.proj.weight[0].numel() == 768


def test_patch_embedding_is_a_linear_map_of_each_patch():
    embed = PatchEmbedding(img_size=12, patch_size=4, in_channels=3, embed_dim=8)
    x = _pixels(2, 3, 12, 12)
    # the patches cut by hand, row by row, each flattened as (channel, row, column)
    patches = x.unfold(2, 4, 4).unfold(3, 4, 4).permute(0, 2, 3, 1, 4, 5).reshape(2, 9, 48)
    want = patches @ embed.proj.weight.reshape(8, 48).T + embed.proj.bias
    assert_close_scaled(embed(x), want, FP32_OP)
    with pytest.raises(ValueError, match=r"PatchEmbedding: expected pixel values \(batch, 3, height, width\), got "
                                         r"shape \(2, 1, 12, 12\)"):
        embed(_pixels(2, 1, 12, 12))
    with pytest.raises(ValueError, match="img_size \\(10, 10\\) is not a multiple of patch_size 4"):
        PatchEmbedding(10, 4, 3, 8)


@pytest.mark.parametrize("prefix, size", [(1, (48, 48)), (1, (24, 40)), (2, (56, 32))])
def test_the_position_table_resizes_as_transformers_does(prefix, size):
    """Our table resized to a new grid equals transformers' ViT (one prefix token) and DeiT (two)
    interpolate_pos_encoding, given the same table."""
    hf_config = dict(HF_SIZES, hidden_size=16, num_attention_heads=2)
    # the embeddings read through the public models (ViTEmbeddings, DeiTEmbeddings are not exported)
    if prefix == 1:
        hf = transformers.ViTModel(transformers.ViTConfig(**hf_config)).embeddings
    else:
        hf = transformers.DeiTModel(transformers.DeiTConfig(**hf_config)).embeddings
    table = PatchPositionEmbedding((4, 4), 16, prefix=prefix)
    with torch.no_grad():
        hf.position_embeddings.copy_(table.weight)
    H, W = size
    new_grid = (H // 8, W // 8)
    got = table.table(new_grid)
    want = hf.interpolate_pos_encoding(torch.zeros(1, prefix + new_grid[0] * new_grid[1], 16), H, W)
    assert got.shape == want.shape == (1, prefix + new_grid[0] * new_grid[1], 16)
    assert_close_scaled(got, want, FP32_OP)
    assert torch.equal(got[:, :prefix], table.weight[:, :prefix])          # the prefix rows are kept
    assert interpolate_grid_table(table.weight, prefix, (4, 4), (4, 4)) is table.weight


@pytest.mark.parametrize("size", [None, (48, 48), (40, 24)], ids=["trained size", "48x48", "40x24"])
def test_vit_for_image_classification_equals_transformers(size, tmp_path):
    """transformers' ViTForImageClassification saved, loaded by attnlab: the same logits; at another
    image size both resize their position tables (interpolate_pos_encoding=True)."""
    hf = _hf(transformers.ViTForImageClassification)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is VisionTransformer and ours.config.num_labels == 5
    x = _pixels(3, 3, *(size or (32, 32)), seed=1)
    flag = dict(interpolate_pos_encoding=True) if size else {}
    with torch.no_grad():
        want = hf(pixel_values=x, **flag).logits
        assert_close_scaled(ours(x, **flag), want, FP32)
        ours.train(False)
        back = transformers.ViTForImageClassification.from_pretrained(ours.save_pretrained(tmp_path / "back")).eval()
        assert_close_scaled(back(pixel_values=x, **flag).logits, want, FP32)


def test_vit_model_equals_transformers_with_its_pooler(tmp_path):
    hf = _hf(transformers.ViTModel)
    hf.save_pretrained(tmp_path)
    ours = attnlab.from_pretrained(tmp_path)
    assert type(ours) is ViTModel
    x = _pixels(2, 3, 32, 32, seed=2)
    with torch.no_grad():
        out = hf(pixel_values=x)
        hidden = ours(x)
        assert hidden.shape == (2, 1 + 16, 48)
        assert_close_scaled(hidden, out.last_hidden_state, FP32)
        assert_close_scaled(ours.pool(hidden), out.pooler_output, FP32)


def test_mean_pooling_reads_the_patches_mean(tmp_path):
    """pooling="mean": the head reads the mean of the patch rows of the final hidden state, which
    transformers' ViTModel gives with the same weights."""
    model = VisionTransformer(img_size=32, patch_size=8, num_classes=5, embed_dim=48, depth=2, num_heads=4,
                              mlp_ratio=2.0, pooling="mean").eval()
    contract.randomize_(model)
    model.save_pretrained(tmp_path)
    # transformers' bare ViTModel reads the encoder of that checkpoint (its pooler left out: unused here)
    hf = transformers.ViTModel.from_pretrained(tmp_path, add_pooling_layer=False).eval()
    x = _pixels(2, 3, 32, 32, seed=3)
    with torch.no_grad():
        want = F.linear(hf(pixel_values=x).last_hidden_state[:, 1:].mean(1), model.head.weight, model.head.bias)
        assert_close_scaled(model(x), want, FP32)
        back = attnlab.from_pretrained(tmp_path)
        assert back.config.pooling == "mean" and torch.equal(back(x), model(x))


@pytest.mark.parametrize("model_type", ["vit", "deit"])
def test_dyt_takes_the_place_of_every_layernorm_at_the_config_s_alpha_and_round_trips(model_type, tmp_path):
    import json
    fam = attnlab.models.family(model_type)
    config = fam.build_config(image_size=16, patch_size=4, in_channels=3, d_model=32, num_heads=4, num_layers=2,
                              num_labels=3, norm="dyt", dyt_alpha=2.5)
    model = fam.for_kind("image-classifier").build(config).eval()
    norms = [m for m in model.modules() if isinstance(m, (DyT, LayerNorm, torch.nn.LayerNorm))]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, DyT) for m in norms)
    assert all(m.alpha.item() == 2.5 for m in norms)          # built at the config's alpha, not set afterwards
    contract.randomize_(model)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dyt_alpha"] == 2.5
    back = attnlab.from_pretrained(tmp_path)
    x = _pixels(2, 3, 16, 16)
    with torch.no_grad():
        assert (back.config.norm, back.config.dyt_alpha) == ("dyt", 2.5) and torch.equal(back(x), model(x))
    fresh = fam.for_kind("image-classifier").build(back.config)         # the config alone rebuilds the start
    assert all(m.alpha.item() == 2.5 for m in fresh.modules() if isinstance(m, DyT))
    # the paper's 0.5 by default, written nowhere; a LayerNorm model's alpha is nobody's business
    plain = VisionTransformer(img_size=16, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=4, norm="dyt")
    assert {m.alpha.item() for m in plain.modules() if isinstance(m, DyT)} == {0.5}
    assert "dyt_alpha" not in fam.config_to_hf(plain.config)
    assert fam.hf_unsupported(ViTConfig(dyt_alpha=3.0)) is None
    # one alpha per depth: each layer's two norms, then the final one, saved and read back as a list
    deep = fam.for_kind("image-classifier").build(fam.build_config(
        image_size=16, patch_size=4, in_channels=3, d_model=32, num_heads=4, num_layers=2, num_labels=3, norm="dyt",
        dyt_alpha=[4, 2, 0.5]))
    assert [m.alpha.item() for m in deep.modules() if isinstance(m, DyT)] == [4, 4, 2, 2, 0.5]
    deep.save_pretrained(tmp_path / "deep")
    assert attnlab.from_pretrained(tmp_path / "deep").config.dyt_alpha == [4.0, 2.0, 0.5]
    with pytest.raises(ValueError, match="ViTConfig: dyt_alpha must be a positive number or 13 of them"):
        ViTConfig(norm="dyt", dyt_alpha=0)
    with pytest.raises(ValueError, match="got \\[1.0, 2.0\\]"):
        ViTConfig(norm="dyt", dyt_alpha=[1.0, 2.0])


def test_an_image_of_another_size_is_refused_without_interpolation():
    model = VisionTransformer(img_size=16, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=4)
    with pytest.raises(ValueError, match="VisionTransformer: a 24x24 image, the model's is 16x16; pass "
                                         "interpolate_pos_encoding=True"):
        model(_pixels(1, 3, 24, 24))
    assert model(_pixels(1, 3, 24, 24), interpolate_pos_encoding=True).shape == (1, 3)
    with pytest.raises(ValueError, match="ViTConfig: norm must be one of \\('layernorm', 'dyt'\\), got 'rms'"):
        ViTConfig(norm="rms")


def test_class_token_and_positions_do_not_decay():
    model = VisionTransformer(img_size=16, patch_size=4, num_classes=3, embed_dim=32, depth=1, num_heads=4)
    decay, no_decay = ({n for n, _ in group} for group in split_decay(model))
    assert {"cls_token", "position.weight"} <= no_decay
    assert "patch_embed.proj.weight" in decay and "head.weight" in decay


def test_the_presets_have_transformers_sizes():
    for preset in ("vit-base-patch16-224", "vit-small-patch16-224"):
        config = attnlab.models.family("vit").preset(preset)
        hf_config = transformers.ViTConfig(**attnlab.models.family("vit").config_to_hf(config))
        with torch.device("meta"):
            ours = VisionTransformer.from_config(config)
            theirs = transformers.ViTForImageClassification(hf_config)
        assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert sum(p.numel() for p in ours.parameters()) == 22_050_664          # ViT-S/16, 1000 classes


@pytest.mark.parametrize("model_type, flags", [("vit", ["--norm", "dyt", "--pooling", "mean", "--tokenizer", "conv"]),
                                               ("deit", [])])
def test_the_image_task_trains_the_family_with_its_options(model_type, flags, tmp_path, capsys):
    import numpy as np
    from PIL import Image
    from attnlab.cli import main
    from attnlab.tasks import open_run
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(10):
            x = rng.integers(0, 90, (16, 16, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(tmp_path / "data" / label / f"{i}.png")
    run = tmp_path / "run"
    assert main(["train", "image", "--model", model_type, "--data", str(tmp_path / "data"), "--out", str(run),
                 "--steps", "4", "--image-size", "16", "--patch-size", "4", "--d-model", "32", "--heads", "2",
                 "--layers", "1", "--batch-size", "8", "--no-progress", *flags]) == 0
    capsys.readouterr()
    config = open_run(run).config
    assert (config["norm"], config["pooling"], config.get("tokenizer", "patch")) == (
        ("dyt", "mean", "conv") if flags else ("layernorm", "cls", "patch"))
    # transformers has no DyT, mean pooling or conv tokeniser and would run its defaults on the weights: refused
    code = main(["export", str(run), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    if flags:
        assert code == 2 and "norm='dyt', pooling='mean', tokenizer='conv' has no transformers counterpart" in err, err
    else:
        assert code == 0 and (tmp_path / "hf" / "preprocessor_config.json").is_file(), err
