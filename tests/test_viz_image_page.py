"""The explorer's image view, from Python (attnlab.viz.image_views; the browser side is in
tests/test_explorer_browser.py): ViT's and DeiT's views are transformers' ``output_attentions``
and the rollout of them; Swin's window attention put back on each stage's map equals
transformers' per-window weights placed by hand (roll and windows written out here), with the
crop of a padded map; the pooled rollout equals a hand composition; the PNG of a Swin draws those
stage maps as the attention each patch receives; the page embeds the picture
once and encodes the views without loss; ``attnlab viz RUN --image X --html FILE`` writes it."""
import base64
import io

import numpy as np
import pytest
import torch

import attnlab
import contract
from _tolerance import FP32, assert_close_scaled
from attnlab.cli import main
from attnlab.processors import ImageProcessor
from attnlab.viz.explorer import payload, write_page
from attnlab.viz.image import attention_rollout
from attnlab.viz.image_views import image_views, swin_rollout, swin_stage_weights

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")

VIT = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=48, num_attention_heads=4,
           num_hidden_layers=3, intermediate_size=96, num_labels=5)
# a 40-pixel image in 4-pixel patches: a 10 x 10 map, not a multiple of the 4-token window (padded
# to 12 x 12); the second stage's 5 x 5 map is padded to 8 x 8
SWIN = dict(image_size=40, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
            window_size=4, num_labels=3)


def _pair(tmp_path, family: str):
    config_cls, model_cls, sizes = {
        "vit": (transformers.ViTConfig, transformers.ViTForImageClassification, VIT),
        "deit": (transformers.DeiTConfig, transformers.DeiTForImageClassificationWithTeacher, VIT),
        "swin": (transformers.SwinConfig, transformers.SwinForImageClassification, SWIN)}[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**sizes))
    contract.randomize_(hf, 0)
    hf.save_pretrained(tmp_path / family)
    hf = model_cls.from_pretrained(tmp_path / family, attn_implementation="eager").eval()
    return hf, attnlab.from_pretrained(tmp_path / family)


def _picture(size, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (size, size, 3)).astype(np.uint8)


def _pixels(processor, picture):
    return processor.finish(processor.resized(picture))[None]


@pytest.mark.parametrize("family, prefix", [("vit", 1), ("deit", 2)])
def test_vit_and_deit_views_are_transformers_attentions_and_their_rollout(family, prefix, tmp_path):
    hf, ours = _pair(tmp_path, family)
    processor = ImageProcessor(size=32)
    picture = _picture(32)
    with torch.no_grad():
        theirs = torch.stack([a[0] for a in hf(pixel_values=_pixels(processor, picture),
                                               output_attentions=True).attentions])
    attention, rollout = image_views(ours, processor, picture)
    assert attention.weights.shape == (3, 4, prefix + 16, prefix + 16)
    assert_close_scaled(attention.weights, theirs, FP32, "recorded self-attention against transformers")
    assert_close_scaled(rollout.weights[0, 0], attention_rollout(theirs), FP32, "rollout of transformers' weights")
    grid = attention.image
    assert (grid.rows, grid.cols, grid.cell, grid.prefix) == (4, 4, (8, 8), prefix) and rollout.image is grid
    assert attention.cols[:prefix] == ["[CLS]", "[DIST]"][:prefix] and attention.cols[prefix + 6] == "(1, 2)"
    from PIL import Image
    shown = np.asarray(Image.open(io.BytesIO(grid.png)))
    assert np.array_equal(shown, processor.resized(picture).permute(1, 2, 0).numpy())     # what the model read


def _by_hand(windows: torch.Tensor, rows: int, cols: int, M: int, shift: int) -> torch.Tensor:
    """transformers' (windows, H, M², M²) weights of a map padded to multiples of M and rolled by
    -shift, put at each token's place in the unrolled map, one loop per query and key."""
    Hp, Wp = -(-rows // M) * M, -(-cols // M) * M
    per_row = Wp // M

    def place(w: int, a: int) -> int | None:
        r = (w // per_row * M + a // M + shift) % Hp            # rolled by -shift: slot i holds token i + shift
        c = (w % per_row * M + a % M + shift) % Wp
        return r * cols + c if r < rows and c < cols else None

    H = windows.size(1)
    full = torch.zeros(H, rows * cols, rows * cols)
    for w in range(windows.size(0)):
        for a in range(M * M):
            for b in range(M * M):
                q, k = place(w, a), place(w, b)
                if q is not None and k is not None:
                    full[:, q, k] = windows[w, :, a, b]
    return full


def test_swin_stage_maps_are_transformers_windows_put_back_by_hand(tmp_path):
    hf, ours = _pair(tmp_path, "swin")
    processor = ImageProcessor(size=40)
    pixels = _pixels(processor, _picture(40))
    with torch.no_grad():
        theirs = hf(pixel_values=pixels, output_attentions=True).attentions    # each stage's last block
    stages = swin_stage_weights(ours, pixels)
    assert [(tuple(w.shape), grid) for w, grid in stages] == [((2, 2, 100, 100), (10, 10)),
                                                               ((2, 4, 25, 25), (5, 5))]
    # each stage's last block is the shifted one (by 2), on a padded map
    for (w, (rows, cols)), want in zip(stages, theirs, strict=True):
        assert_close_scaled(w[-1], _by_hand(want, rows, cols, 4, 2), FP32, "window weights")
    first = stages[0][0]
    # a query sees its window alone: token (0, 0) of the unshifted first block, the 4 x 4 corner
    seen = first[0, :, 0].reshape(2, 10, 10) > 0
    assert seen[:, :4, :4].all() and not seen[:, 4:].any() and not seen[:, :, 4:].any()
    # keys of the padding are left out: a border window's rows sum to less than 1, an inner one's to 1
    sums = first[0].sum(-1)
    assert_close_scaled(sums[:, 0], torch.ones(2), FP32) and (sums[:, 99] < 0.999).all()



def test_swin_png_draws_the_pooled_rollout_and_what_each_stage_s_patches_receive(tmp_path):
    """`attnlab viz RUN --image X` for a Swin: the PNG's stage maps are transformers' last-block
    windows put back by hand, averaged over heads and queries; its rollout is the page's."""
    from PIL import Image
    from attnlab.viz.image import draw_image_attention, figure_layout, swin_panels
    hf, ours = _pair(tmp_path, "swin")
    processor = ImageProcessor(size=40)
    picture = _picture(40)
    pixels = _pixels(processor, picture)
    with torch.no_grad():
        theirs = hf(pixel_values=pixels, output_attentions=True).attentions      # each stage's last block
    panels = swin_panels(ours, pixels)
    assert [(t.split(",")[0], tuple(m.shape), cell) for t, m, cell in panels] == [
        ("rollout of the pooled output", (10, 10), 4), ("stage 1 (10x10)", (10, 10), 4), ("stage 2 (5x5)", (5, 5), 8)]
    assert_close_scaled(panels[0][1].flatten(), swin_rollout(swin_stage_weights(ours, pixels)), FP32, "rollout")
    for (_, got, _), want, (rows, cols) in zip(panels[1:], theirs, [(10, 10), (5, 5)], strict=True):
        received = _by_hand(want, rows, cols, 4, 2).mean(0).mean(0)
        assert_close_scaled(got.flatten(), received, FP32, "attention received per patch")
    out = draw_image_attention(ours, processor, picture, tmp_path / "swin.png")
    with Image.open(out) as img:
        assert img.size == figure_layout(2)[2]                      # input, rollout, two stages: one row of 4
    with pytest.raises(ValueError, match="a Swin's PNG draws each stage's last block"):
        draw_image_attention(ours, processor, picture, tmp_path / "b.png", layer=1)

def test_swin_pooled_rollout_is_the_stages_rollouts_through_averaging_merges():
    g = torch.Generator().manual_seed(0)
    one = torch.softmax(torch.randn(2, 3, 16, 16, generator=g), -1)           # a 4 x 4 map, 2 blocks
    two = torch.softmax(torch.randn(1, 2, 4, 4, generator=g), -1)             # merged: 2 x 2
    merge = np.zeros((4, 16))
    for r in range(4):
        for c in range(4):
            merge[(r // 2) * 2 + c // 2, r * 4 + c] = 0.25
    want = (attention_rollout(two).double().numpy() @ merge @ attention_rollout(one).double().numpy()).mean(0)
    got = swin_rollout([(one, (4, 4)), (two, (2, 2))])
    assert_close_scaled(got, torch.from_numpy(want).float(), FP32, "pooled rollout")
    assert abs(float(got.sum()) - 1) < 1e-5


def test_the_page_embeds_the_picture_once_and_loses_no_weight(tmp_path):
    _, ours = _pair(tmp_path, "swin")
    views = image_views(ours, ImageProcessor(size=40), _picture(40))
    assert [v.name for v in views] == ["stage1/self", "stage2/self", "rollout"]
    data = payload(views, "swin", dense_limit=10_000)       # small enough that stage 1 must be sparse
    assert len(data["images"]) == 1 and data["images"][0].startswith("data:image/png;base64,")
    assert all(v["image"]["index"] == 0 for v in data["views"])
    stage1 = data["views"][0]
    # the padded border windows hold fewer tokens; no row has more than one window's 16 keys
    assert stage1["encoding"] == "topk" and stage1["k"] == 16
    raw = base64.b64decode(stage1["data"][0])
    n = 2 * 100 * 16
    index = np.frombuffer(raw[:2 * n], "<u2").reshape(2, 100, 16)
    values = np.frombuffer(raw[2 * n:3 * n], np.uint8).reshape(2, 100, 16)
    rest = np.frombuffer(raw[3 * n:], np.uint8)
    rowmax = np.frombuffer(base64.b64decode(stage1["rowmax"][0]), "<f4").reshape(2, 100)
    dense = np.zeros((2, 100, 100))
    np.put_along_axis(dense, index.astype(np.int64), values / 255 * rowmax[..., None], -1)
    want = views[0].weights[0].numpy()
    # every nonzero weight kept, each within half a step of its own row's scale; nothing left over
    assert (np.abs(dense - want) <= rowmax[..., None] / 510 * (1 + 1e-6)).all() and not rest.any()
    assert np.array_equal(rowmax, want.max(-1).astype("<f4"))
    assert data["views"][1]["encoding"] == "dense" and data["views"][1]["image"]["cell"] == [8, 8]
    assert data["views"][2]["rows"] == ["[pooled]"]
    page = write_page(views, tmp_path / "swin.html", title="swin").read_text()
    assert page.count("data:image/png;base64,") == 1


def test_viz_image_html_writes_the_page_of_an_image_run(tmp_path, capsys):
    from PIL import Image
    rng = np.random.default_rng(0)
    for c, label in enumerate(["blue", "red"]):
        (tmp_path / "data" / label).mkdir(parents=True)
        for i in range(4):
            x = rng.integers(0, 90, (16, 16, 3))
            x[..., 2 - 2 * c] += 160
            Image.fromarray(x.astype(np.uint8)).save(tmp_path / "data" / label / f"{i}.png")
    run = tmp_path / "run"
    assert main(["train", "image", "--model", "vit", "--data", str(tmp_path / "data"), "--out", str(run), "--steps",
                 "1", "--image-size", "16", "--patch-size", "4", "--d-model", "16", "--heads", "2", "--layers", "2",
                 "--batch-size", "8", "--no-progress"]) == 0
    capsys.readouterr()
    page = tmp_path / "page.html"
    image = tmp_path / "data" / "red" / "1.png"
    assert main(["viz", str(run), "--image", str(image), "--html", str(page)]) == 0
    assert f"wrote {page}" in capsys.readouterr().out
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 1 and '"image":{"index":0,"rows":4,"cols":4' in text
    assert main(["viz", str(run), "--image", str(image), "--html", str(page), "--layer", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "the page (--html, --serve) has every layer" in err[0]
    assert main(["viz", str(run), "--image", str(image), "--target", "a cat"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "--image reads one image" in err[0]
