"""The walk-through's figures are current: scripts/figures.py's data, recomputed from attnlab
now, matches the fingerprints docs/figures/manifest.json was written with; every PNG is the one
the manifest names and is embedded in the page that teaches it; and what the pages read off the
figures holds for the numbers."""
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"


def _script():
    spec = importlib.util.spec_from_file_location("attnlab_figures", ROOT / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
