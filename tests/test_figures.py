"""The walk-through's figures are current: scripts/figures.py's data, recomputed from attnlab
now, matches the fingerprints docs/figures/manifest.json was written with; every PNG is the one
the manifest names and is embedded in the page that teaches it; and what the pages read off the
figures holds for the numbers."""
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"


def _script():
    return load_script("scripts/figures.py", "attnlab_figures")


figures = _script()
MANIFEST = json.loads((FIGURES / "manifest.json").read_text())


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_manifest_lists_exactly_the_script_s_figures():
    assert set(MANIFEST) == set(figures.FIGURES_BY_PAGE) | set(figures.MEASURED)
    assert {p.stem for p in FIGURES.glob("*.png")} == set(MANIFEST), "a PNG without a manifest entry, or missing"


@pytest.mark.parametrize("name", sorted(figures.FIGURES_BY_PAGE))
def test_figure_data_is_current(name):
    data = getattr(figures, f"data_{name}")()
    now, then = np.array(figures.fingerprint(data)), np.array(MANIFEST[name]["fingerprint"])
    assert now.shape == then.shape and np.allclose(now, then, rtol=1e-4, atol=1e-6), (
        f"docs/figures/{name}.png shows numbers attnlab no longer gives: run scripts/figures.py {name}")


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_png_is_the_manifest_s_and_its_page_embeds_it(name):
    png = FIGURES / f"{name}.png"
    assert hashlib.sha256(png.read_bytes()).hexdigest() == MANIFEST[name]["png_sha256"], (
        f"{png.name} was not written by the run that wrote the manifest: run scripts/figures.py {name}")
    page = ROOT / "docs" / MANIFEST[name]["page"]
    assert f"](figures/{name}.png)" in page.read_text(encoding="utf-8"), f"{page.name} does not embed {png.name}"


def test_fingerprint_sees_a_changed_number():
    data = figures.data_masks()
    changed = {k: v.copy() for k, v in data.items()}
    changed["causal"][4, 0] = 0.0
    assert figures.fingerprint(data) != figures.fingerprint(changed)


def test_what_the_pages_read_off_the_figures():
    s = figures.data_scaling()
    at512 = list(s["d_k"]).index(512)
    assert s["unscaled"][at512] > 0.9 and s["scaled"][at512] < 0.5       # attention.md: saturation
    assert np.all(np.diff(s["unscaled"][1:]) > 0) and s["unscaled"][-1] > s["unscaled"][0] + 0.4
    assert np.ptp(s["scaled"][1:]) < 0.05                                  # scaled: flat in d_k
    hand = figures.data_hand_example()["weights"]
    assert np.allclose(hand.sum(-1), 1.0, atol=1e-6)
    g = figures.data_norm_gradients()                                     # norms.md
    assert g["pre_norm"][-1] < g["pre_norm"][0], "Pre-Norm: smaller gradients towards the output"
    assert g["post_norm"][-1] > g["pre_norm"][-1]
    r = figures.data_rope()                                               # positions.md
    assert r["ones"][0] == pytest.approx(64.0, rel=1e-5) and r["ones"][100] < 0.7 * r["ones"][0]
    w = figures.data_warmup()
    peak = w["step"][np.argmax(w["w4000"])]
    assert abs(peak - 4000) <= 50, "the noam schedule peaks at its warmup step"


def test_what_the_walk_through_pages_read_off_their_new_figures():
    """attention.md (soft lookup), multi-head-attention.md (heads), bert.md (80/10/10),
    causal-lm.md (the cache's score entries), t5.md (buckets), vision.md (patches)."""
    s = figures.data_soft_lookup()
    assert np.allclose(s["weights"], [0.299, 0.533, 0.168], atol=1e-3) and s["hard"].tolist() == [0, 1, 0]
    assert np.allclose(s["soft_out"], [0.467, 0.701], atol=1e-3) and s["hard_out"].tolist() == [0, 1]
    w = figures.data_heads()["weights"]
    assert w.shape == (4, 6, 6) and np.allclose(w.sum(-1), 1.0, atol=1e-6)
    assert np.allclose(w[:, 0], w[:, 4], atol=1e-6) and np.allclose(w[:, :, 0], w[:, :, 4], atol=1e-6)
    assert np.abs(w[0] - w[1]).max() > 0.05, "the heads' weights differ"
    m = figures.data_mlm_masking()
    assert abs(m["selected"][0] - 0.15) < 0.005
    assert np.allclose(m["shares"], [0.8, 0.1, 0.1], atol=0.01) and m["shares"].sum() == pytest.approx(1.0)
    assert [round(100 * v, 1) for v in (m["selected"][0], *m["shares"])] == [14.9, 80.5, 10.3, 9.2]
    k = figures.data_kv_cache()
    assert k["cached"].tolist() == [16.0] + [float(s) for s in range(5, 28)]          # one query per step
    assert k["recomputed"].tolist() == [float(s * s) for s in range(4, 28)]           # the whole prefix again
    assert k["cached"].sum() == 384 and k["recomputed"].sum() == 6916
    b = figures.data_t5_buckets()
    rel, bi, causal = b["relative"], b["bidirectional"], b["causal"]
    near = np.abs(rel) < 8
    assert np.array_equal(bi[near & (rel <= 0)], -rel[near & (rel <= 0)])              # exact near the query
    assert set(bi[rel <= -128]) == {15} and set(bi[rel >= 128]) == {31} and set(causal[rel <= -128]) == {31}
    assert set(causal[rel > 0]) == {0} and np.all(np.diff(bi[rel <= 0][::-1]) >= 0)
    p = figures.data_patches()
    assert p["image"].shape == (16, 16) and p["patches"].shape == (16, 16)
    assert np.array_equal(p["patches"][1].reshape(4, 4), p["image"][0:4, 4:8]), "patch 2 is row 0, column 1"
    mae = figures.data_mae_masking()                                       # vision.md: 16 seen, 48 painted
    assert mae["mask"].shape == (8, 8) and mae["mask"].sum() == 48 and mae["kept"].shape == (16, 4)
    visible = {tuple(mae["image"][2 * r:2 * r + 2, 2 * c:2 * c + 2].ravel()) for r, c in zip(*np.nonzero(mae["mask"] == 0))}
    assert {tuple(row) for row in mae["kept"]} <= visible, "the encoder's rows are the unmasked patches"
    x = figures.data_extrapolation()                                       # positions.md: 0, 12 %, >= 37 %, 40 %
    pos, out = x["position"], x["outside"]
    assert out[pos < 512].max() == 0 and 0.10 < out[pos == 512][0] < 0.15
    assert out[pos >= 600].min() >= 0.37 and abs(out[pos == 1024][0] - 0.40) < 0.005


def test_the_vision_page_quotes_its_measured_figures():
    """The position-similarity and class-attention figures come from one trained digits ViT; the
    manifest keeps what the run measured, and docs/vision.md states those numbers and what
    they show: a patch's position row is most like its neighbours', and the class token's rollout
    sits on the ink more than its share of the grid."""
    sim, att = MANIFEST["position_similarity"], MANIFEST["class_attention"]
    assert sim["source"] == att["source"] == "attnlab " + " ".join(figures.VISION_COMMAND)
    assert sim["neighbour_similarity"] > sim["far_similarity"] + 0.2
    assert all(on > area for on, area in zip(att["rollout_on_digit"], att["digit_area"]))
    page = (ROOT / "docs" / "vision.md").read_text(encoding="utf-8")
    on, area = np.mean(att["rollout_on_digit"]), np.mean(att["digit_area"])
    for claim in (f"{sim['held_out_accuracy']:.1f} % of the 200 held-out digits",
                  f"{sim['neighbour_similarity']:.2f} on average for the four adjacent patches against "
                  f"{sim['far_similarity']:.2f}",
                  f"{100 * on:.0f} % of its mass on the patches with ink, which are {100 * area:.0f} % of the grid"):
        assert " ".join(claim.split()) in " ".join(page.split()), f"vision.md does not say {claim!r}"



def test_the_vision_page_reads_the_explorer_screenshot():
    """docs/vision.md's sentence under the explorer's screenshot quotes what the manifest kept of
    the page's drawn row (layer 1, head 1, the class token) and of the run."""
    shot = MANIFEST["explorer_image_view"]
    assert shot["source"] == "attnlab " + " ".join(figures.VISION_COMMAND)
    assert 0 < shot["to_class_token"] < shot["brightest_patch"] <= 1
    page = " ".join((ROOT / "docs" / "vision.md").read_text(encoding="utf-8").split())
    for claim in (f"a held-out {shot['digit']}", f"{shot['held_out_accuracy']:.1f} % held out",
                  f"puts {shot['brightest_patch']:.3f} of its weight on one patch",
                  f"and {shot['to_class_token']:.2f} on itself"):
        assert claim in page, f"vision.md does not say {claim!r}"

def test_position_similarity_is_read_from_the_model_s_own_table():
    """The measured figure's numbers come from position_similarity_data, checked here on a model
    whose table is known: a table built from the patches' coordinates is most like its neighbours."""
    from attnlab.models.vit import VisionTransformer
    vit = VisionTransformer(img_size=8, patch_size=2, num_classes=3, embed_dim=8, depth=1, num_heads=2)
    r, c = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    freqs = torch.tensor([0.5, 1.0])
    coords = torch.cat([torch.sin(r.flatten()[:, None] * freqs), torch.cos(r.flatten()[:, None] * freqs),
                        torch.sin(c.flatten()[:, None] * freqs), torch.cos(c.flatten()[:, None] * freqs)], dim=1)
    with torch.no_grad():
        vit.position.weight[0, 1:] = coords
    d = figures.position_similarity_data(vit)
    assert d["similarity"].shape == (16, 16) and np.allclose(np.diag(d["similarity"]), 1.0, atol=1e-6)
    assert d["neighbours"] > d["far"]


def test_what_the_pages_read_off_the_figures_of_the_sections_that_had_none():
    """encoder-decoder.md (3.2), feed-forward.md (3.4), positions.md (4.6), trainer.md (8.4),
    summary.md (9), index.md (A1), classification.md (A5), masks.md (A6)."""
    off = ~np.eye(6, dtype=bool)
    e = figures.data_encoder_influence()              # every input reaches every output; causal: none above
    assert e["encoder"][off].min() > 0.03 and e["causal"][np.triu_indices(6, 1)].max() == 0
    assert e["causal"][np.tril_indices(6, -1)].min() > 0.03
    f = figures.data_ffn_width()                      # 8 -> 32 -> 8, about half the hidden units zero, diagonal
    assert f["hidden"].shape == (6, 32) and f["out"].shape == (6, 8) and 0.4 < (f["hidden"] == 0).mean() < 0.65
    assert f["influence"][off].max() == 0 and np.allclose(np.diag(f["influence"]), 1.0)
    p = figures.data_position_offset()                # offset=t gives the full forward's rows; none gives row 0
    assert np.array_equal(p["offset"], p["full"]) and np.array_equal(p["no_offset"], np.tile(p["full"][:1], (8, 1)))
    a = figures.data_accumulation()                   # 4 x 2 accumulated = one batch of 8; mean of means drifts
    rel = {k: np.abs(a[k] - a["one_batch"]) / a["one_batch"] for k in ("accumulated", "mean_of_means")}
    assert rel["accumulated"].max() < 1e-5 and rel["mean_of_means"].min() > 1e-4 and rel["mean_of_means"].max() > 1e-2
    assert a["one_batch"][-1] < a["one_batch"][0] - 0.5
    kept = a["saved_bytes"]                           # batch 8, micro-batch 2, each checkpointed: a quarter, less
    assert kept[0] == 4 * kept[1] and kept[2] == 4 * kept[3] and kept[2] < kept[1] < kept[0]
    assert [round(v / 1024) for v in kept] == [1203, 301, 227, 57]
    c = figures.data_parameter_budget()["count"]      # 63.1 M; feed-forward 40 %, attention 30 %, embeddings 30 %
    assert c.sum() == 63_082_496 and round(100 * (c[2] + c[5]) / c.sum()) == 40
    assert round(100 * (c[1] + c[3] + c[4]) / c.sum()) == 30 and round(100 * c[0] / c.sum()) == 30
    s = figures.data_shapes()["shapes"]                # (B, H, T, S) weights between (B, T, E) ends
    assert s[5].tolist() == [2, 4, 5, 7] and s[0].tolist() == s[-1].tolist() == [2, 5, 32, 0]
    b = figures.data_block_stream()                   # Post-Norm: RMS 1 after each norm; Pre-Norm keeps the spread
    assert np.abs(b["post_norm"][[2, 4]] - 1).max() < 1e-3 and b["post_norm"][0].max() > 4 > 0.5 > b["post_norm"][0].min()
    assert b["pre_norm"][-1].max() / b["pre_norm"][-1].min() > 8
    t = figures.data_torch_parity()                   # converted: round-off; unconverted: another answer
    assert t["inverted"].max() < 1e-5 and t["as_is"].min() > 0.3


# ------------------------------------------------------------------ figures that read

def _inside(fig, boxes, texts) -> list[str]:
    """Texts whose drawn extent leaves the box they belong to (in display pixels), laid out as
    the saved PNG is (tight_layout, then drawn)."""
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for box, group in zip(boxes, texts):
        b = box.get_window_extent(renderer)
        for text in group:
            t = text.get_window_extent(renderer)
            if t.x0 < b.x0 or t.x1 > b.x1 or t.y0 < b.y0 or t.y1 > b.y1:
                out.append(text.get_text())
    return out


def test_the_heads_figure_has_a_colour_bar_on_a_scale_that_fits_its_weights():
    """heads.png: one colour scale for the four heads, from 0 to the weights' largest rounded up to
    0.05 (the untrained heads' weights are 0.06-0.31: a 0-1 scale left them all dark), with its bar."""
    import matplotlib.pyplot as plt
    data = figures.data_heads()
    fig, top, bar = figures.heads_figure(data)
    w = data["weights"]
    assert w.max() <= top < w.max() + 0.05 + 1e-9 and top < 0.5
    images = [a.images[0] for a in fig.axes if a.images]
    assert len(images) == w.shape[0] and all(im.get_clim() == (0.0, top) for im in images)
    assert bar.mappable.get_clim() == (0.0, top) and "weight" in bar.ax.get_ylabel()
    cells = [t for a in fig.axes for t in a.texts]
    assert len(cells) == w.size                                         # every weight written in its cell
    plt.close(fig)


def test_the_shapes_figure_keeps_its_text_inside_its_boxes():
    import matplotlib.pyplot as plt
    fig, boxes, texts = figures.shapes_figure(figures.data_shapes())
    assert len(boxes) == 8 and not _inside(fig, boxes, texts)
    plt.close(fig)


def test_the_architecture_figure_names_the_model_s_modules_and_fits_its_boxes():
    """architecture.png (section 3.1): each block is labelled with the EncoderLayer / DecoderLayer
    module that holds it and its parameter count, read from attnlab's Transformer; every label
    lies inside its box; and what encoder-decoder.md reads off it holds."""
    import matplotlib.pyplot as plt
    from attnlab.nn.block import DecoderLayer, EncoderLayer
    data = figures.data_architecture()
    enc, dec = EncoderLayer(512, 8, 2048), DecoderLayer(512, 8, 2048)
    for layer, blocks, counts in ((enc, figures.ENCODER_BLOCKS, data["encoder"]),
                                  (dec, figures.DECODER_BLOCKS, data["decoder"])):
        assert [sum(p.numel() for p in getattr(layer, name).parameters()) for _, name, _ in blocks] == list(counts)
    fig, boxes, texts = figures.architecture_figure(data)
    assert len(boxes) == 4 + 6 + 2 + 1 and not _inside(fig, boxes, texts)   # blocks, embeddings, output layer
    labels = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert all(name in labels for _, name, _ in figures.DECODER_BLOCKS) and "6 x\nDecoderLayer" in labels
    plt.close(fig)
    e, d = data["encoder"], data["decoder"]
    assert round(3 * (e[0] / e.sum())) == 1 and round(3 * (e[2] / e.sum())) == 2          # a third, two thirds
    assert abs((d[0] + d[2]) - d[4]) / d[4] < 0.01                                       # decoder: half and half
    assert round(data["ends"][2] / 1e6, 1) == 19.0 and round(6 * d[4] / 1e6, 1) == 12.6
