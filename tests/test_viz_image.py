"""Attention over an image (attnlab.viz.image, ``attnlab viz RUN --image``): the rollout and the
class token's per-head rows against a hand computation from transformers' ``output_attentions``
on the same weights, for ViT and DeiT; the PNG's size; a Swin run's PNG per stage; the command's
one-line refusals."""
import numpy as np
import pytest
import torch

import attnlab
import contract
from _tolerance import FP32, assert_close_scaled
from attnlab.cli import main
from attnlab.processors import ImageProcessor
from attnlab.viz.image import attention_rollout, class_token_maps, draw_image_attention, figure_layout, image_attention

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")

SIZES = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48, num_attention_heads=4,
             num_hidden_layers=3, intermediate_size=96, num_labels=5)


def _pair(tmp_path, family: str):
    """(transformers model with eager attention, attnlab's from the same directory)."""
    config_cls, model_cls = {
        "vit": (transformers.ViTConfig, transformers.ViTForImageClassification),
        "deit": (transformers.DeiTConfig, transformers.DeiTForImageClassificationWithTeacher)}[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**SIZES))
    contract.randomize_(hf, 0)
    hf.save_pretrained(tmp_path / family)
    hf = model_cls.from_pretrained(tmp_path / family, attn_implementation="eager").eval()
    return hf, attnlab.from_pretrained(tmp_path / family)


def _hand_rollout(attentions: list[np.ndarray]) -> np.ndarray:
    """Abnar and Zuidema's rollout written out: mean of heads, plus identity, rows renormalised,
    multiplied from the first layer up."""
    T = attentions[0].shape[-1]
    rollout = np.eye(T)
    for a in attentions:                                  # (H, T, T) each
        a = a.mean(0) + np.eye(T)
        a = a / a.sum(-1, keepdims=True)
        rollout = a @ rollout
    return rollout


@pytest.mark.parametrize("family, prefix", [("vit", 1), ("deit", 2)])
def test_rollout_and_head_maps_equal_a_hand_computation_from_transformers(family, prefix, tmp_path):
    hf, ours = _pair(tmp_path, family)
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = [a[0].double().numpy() for a in hf(pixel_values=x, output_attentions=True).attentions]
    weights, grid = image_attention(ours, x)
    assert weights.shape == (3, 4, prefix + 16, prefix + 16) and (grid.rows, grid.cols) == (4, 4)
    assert len(grid.prefix) == prefix
    want = _hand_rollout(theirs)
    assert_close_scaled(attention_rollout(weights), torch.from_numpy(want).float(), FP32)
    rollout, heads = class_token_maps(weights, grid, layer=1)
    assert_close_scaled(rollout, torch.from_numpy(want[0, prefix:].reshape(4, 4)).float(), FP32)
    assert_close_scaled(heads, torch.from_numpy(theirs[1][:, 0, prefix:].reshape(4, 4, 4)).float(), FP32)
    # the patches' columns: a patch at (row 1, col 2) is token prefix + 6
    assert rollout[1, 2] == attention_rollout(weights)[0, prefix + 6]


def test_tokens_without_a_class_token_give_the_mean_row():
    """A classifier that pools its patches (a CCT's sequence pooling): the rollout's and each head's
    mean over the queries, by hand from the weights."""
    from attnlab.viz.labels import PatchGrid
    w = torch.softmax(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)), -1)
    grid = PatchGrid((2, 3), 1, prefix=())
    rollout, heads = class_token_maps(w, grid, layer=0)
    hand = _hand_rollout([a.double().numpy() for a in w]).mean(0)
    assert_close_scaled(rollout, torch.from_numpy(hand).float().reshape(2, 3), FP32)
    assert_close_scaled(heads, w[0].mean(1).reshape(3, 2, 3), FP32)


def test_rollout_rows_stay_distributions_and_one_layer_is_the_mixed_identity():
    w = torch.softmax(torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0)), -1)
    r = attention_rollout(w)
    assert_close_scaled(r, (w[0].mean(0) + torch.eye(5)) / 2, FP32)
    deep = attention_rollout(w.repeat(4, 1, 1, 1))
    assert_close_scaled(deep.sum(-1), torch.ones(5), FP32)
    with pytest.raises(ValueError, match="expected \\(layers, heads, T, T\\)"):
        attention_rollout(w[0])


def _png(path, size=(40, 48), seed=0):
    from PIL import Image
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (*size, 3)).astype(np.uint8)).save(path)
    return path


def test_the_png_has_the_layouts_size_and_the_chosen_layer(tmp_path):
    _, ours = _pair(tmp_path, "vit")
    processor = ImageProcessor(size=32)
    out = draw_image_attention(ours, processor, _png(tmp_path / "cat.png"), tmp_path / "a.png", layer=2)
    from PIL import Image
    with Image.open(out) as img:
        assert img.size == figure_layout(4)[2] == (4 * 240, 2 * 240)      # input, rollout, 4 heads: 2 rows of 4
    assert figure_layout(6)[:2] == (2, 4) and figure_layout(1)[:2] == (1, 3)
    with pytest.raises(ValueError, match="--layer must be in 1..3, got 4"):
        draw_image_attention(ours, processor, tmp_path / "cat.png", tmp_path / "b.png", layer=4)


def test_a_model_without_a_patch_grid_is_refused():
    from attnlab.models import GPT, GPTConfig
    gpt = GPT(GPTConfig(vocab_size=16, n_positions=8, d_model=16, num_heads=2, num_layers=1))
    with pytest.raises(ValueError, match="states no patch size"):
        image_attention(gpt, torch.zeros(1, 3, 8, 8))
    # attention over other tokens than the grid (windows of it, say): a model claiming 4-pixel
    # patches whose attention runs over the 2 x 2 grid of 8-pixel ones
    from types import SimpleNamespace
    from attnlab.models.vit import VisionTransformer

    class Windowed(torch.nn.Module):
        config = SimpleNamespace(patch_size=4)

        def __init__(self):
            super().__init__()
            self.vit = VisionTransformer(img_size=16, patch_size=8, num_classes=2, embed_dim=16, depth=1, num_heads=2)

        def forward(self, x):
            return self.vit(x)
    vit = Windowed()
    with pytest.raises(ValueError, match=r"attends over \(5, 5\) tokens, not the 4x4 patch grid"):
        image_attention(vit, torch.zeros(1, 3, 16, 16))


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    from PIL import Image
    root = tmp_path_factory.mktemp("viz_image")
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (root / "data" / label).mkdir(parents=True)
        for i in range(8):
            x = rng.integers(0, 90, (16, 16, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(root / "data" / label / f"{i}.png")
    run = root / "run"
    assert main(["train", "image", "--model", "vit", "--data", str(root / "data"), "--out", str(run), "--steps", "2",
                 "--image-size", "16", "--patch-size", "4", "--d-model", "32", "--heads", "2", "--layers", "2",
                 "--batch-size", "8", "--no-progress"]) == 0
    return root, run


def _viz_png(root, run, capsys) -> tuple[int, int]:
    """`attnlab viz RUN --image red/3.png`: the size of the PNG it says it wrote into the run."""
    from PIL import Image
    capsys.readouterr()
    assert main(["viz", str(run), "--image", str(root / "data" / "red" / "3.png")]) == 0
    out = run / "attention-3.png"
    assert f"wrote {out}" in capsys.readouterr().out
    with Image.open(out) as img:
        return img.size


def test_viz_image_writes_the_overlay_into_the_run(image_run, capsys):
    root, run = image_run
    assert _viz_png(root, run, capsys) == figure_layout(2)[2]
    chosen = root / "chosen.png"
    assert main(["viz", str(run), "--image", str(root / "data" / "red" / "3.png"), "--layer", "1",
                 "--out", str(chosen)]) == 0 and chosen.is_file()


def test_viz_image_draws_a_swin_run_per_stage(image_run, capsys):
    """A Swin run's PNG: the input, the pooled rollout and one panel per stage (two here)."""
    root, _ = image_run
    run = root / "swin"
    assert main(["train", "image", "--model", "swin", "--data", str(root / "data"), "--out", str(run), "--steps", "1",
                 "--image-size", "16", "--patch-size", "2", "--d-model", "16", "--batch-size", "8",
                 "--no-progress"]) == 0
    assert _viz_png(root, run, capsys) == figure_layout(2)[2]
    assert main(["viz", str(run), "--image", str(root / "data" / "red" / "3.png"), "--layer", "1"]) == 2
    assert "a Swin's PNG draws each stage's last block" in _one_error_line(capsys)


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_bad_image_file_and_an_image_run_without_image_get_one_line(image_run, capsys):
    root, run = image_run
    broken = root / "broken.png"
    broken.write_text("not a picture")
    capsys.readouterr()
    assert main(["viz", str(run), "--image", str(broken)]) == 2
    assert f"{broken}: not an image file that Pillow can read" in _one_error_line(capsys)
    assert main(["viz", str(run), "--image", str(root / "gone.png")]) == 2
    assert "gone.png: no such image file" in _one_error_line(capsys)
    assert main(["viz", str(run)]) == 2
    assert "give the image to look at with --image FILE" in _one_error_line(capsys)
    assert main(["viz", str(run), "--image", str(broken), "--head", "1"]) == 2
    assert "it takes no text, --head or --grid" in _one_error_line(capsys)


def test_a_translation_run_with_image_gets_one_line(tmp_path, capsys):
    pairs = [f"{a} {b}\t{b} {a}" for a in ["one", "two"] for b in ["cat", "dog"]]
    (tmp_path / "pairs.tsv").write_text("\n".join(pairs * 4) + "\n")
    run = tmp_path / "tr"
    assert main(["train", "translate", "--data", str(tmp_path / "pairs.tsv"), "--tokenizer", "word", "--steps", "2",
                 "--out", str(run), "--d-model", "16", "--heads", "2", "--layers", "1", "--d-ff", "32",
                 "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["viz", str(run), "--image", str(_png(tmp_path / "x.png"))]) == 2
    line = _one_error_line(capsys)
    assert "--image" in line and "not an image classifier; --image takes an image run (attnlab train image)" in line
    assert main(["viz", str(run)]) == 2
    assert "give the source sentence" in _one_error_line(capsys)


def test_the_patch_heat_covers_exactly_the_pixels_of_the_picture():
    """imshow centres pixel i on coordinate i, so a picture of width W spans -0.5 .. W - 0.5; the
    patch grid drawn over it must span the same box, else every patch sits half a pixel off."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from attnlab.viz.image import _overlay

    fig, ax = plt.subplots()
    picture = np.zeros((16, 24))
    _overlay(ax, picture, torch.rand(4, 6), "t")
    under, over = ax.get_images()
    assert tuple(over.get_extent()) == tuple(under.get_extent()) == (-0.5, 23.5, 15.5, -0.5)
    plt.close(fig)
