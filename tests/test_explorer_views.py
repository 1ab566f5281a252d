"""The explorer's colour scale and legend, its values on hover, the neuron view, PNG export at a
chosen resolution and the notebook display, in Debian's Chromium (the browser fixture and the
helpers of tests/test_explorer_browser.py); and the queries and keys the neuron view draws,
checked against the recorded weights without a browser.
"""
import base64
import time

import pytest
import torch

from attnlab.viz.explorer import write_page

from test_explorer_browser import _keep, _lines, _open, _requests, browser  # noqa: E402,F401  (shared fixture)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def neuron_page(tmp_path_factory):
    """A real 2-layer encoder-decoder's views, each carrying its queries and keys."""
    from attnlab.models import Transformer
    from attnlab.viz.views import seq2seq_views
    torch.manual_seed(0)
    model = Transformer(src_vocab_size=20, tgt_vocab_size=20, d_model=32, num_heads=4, num_encoder_layers=2,
                        num_decoder_layers=2, d_ff=64, dropout=0.0).eval()
    views = seq2seq_views(model, [3, 4, 5, 6, 7, 8], [1, 7, 8, 9], "the cat sat on the mat".split(),
                          "<s> die katze saß".split())
    return write_page(views, tmp_path_factory.mktemp("neurons") / "neurons.html", title="neurons"), views


def test_the_model_view_has_one_colour_scale_with_a_legend_and_values_on_hover(browser, neuron_page):
    """Every thumbnail of a view is drawn against the same top (the legend's), not its own maximum:
    a pixel's colour is the colour map at weight / top, and hovering a panel shows the weight."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    page, views = neuron_page
    _open(browser, page)
    browser.find_element(By.ID, "tab-model").click()
    end = time.time() + 10
    while browser.execute_script("return document.getElementById('thumbs').dataset.complete") != "1":
        assert time.time() < end
        time.sleep(0.05)
    legend = browser.find_element(By.ID, "legend")
    assert legend.is_displayed()
    top = float(legend.get_attribute("data-top"))
    w = views[0].weights
    assert 1 / w.shape[-1] <= top <= float(w.max()) + 1e-6
    # the top-left cell (query 0, key 0) of every panel: its colour is the map at w / top, to 2 levels
    err = browser.execute_script("""
        const top = arguments[0], v = attnlabExplorer.view(); let err = 0;
        for (const c of document.querySelectorAll('#thumbs canvas')) {
          const l = +c.dataset.layer, h = +c.dataset.head, px = c.getContext('2d').getImageData(1, 1, 1, 1).data;
          attnlabExplorer.state.layer = l;
          const w = attnlabExplorer.rowVector(h, 0)[0], rgb = attnlabDraw.colormap(w / top);
          for (let i = 0; i < 3; i++) err = Math.max(err, Math.abs(px[i] - rgb[i]));
        }
        attnlabExplorer.state.layer = 0; return err;""", top)
    assert err <= 3, f"a thumbnail is off the view's colour scale by {err} levels"
    thumb = browser.find_elements(By.CSS_SELECTOR, "#thumbs canvas")[5]           # layer 2, head 2
    ActionChains(browser).move_to_element_with_offset(thumb, -30, -30).perform()   # its top-left cell
    tip = browser.find_element(By.ID, "tip")
    assert tip.is_displayed()
    label, value = tip.text.rsplit(": ", 1)
    assert label == "layer 2, head 2: the → the"
    assert abs(float(value) - float(w[1, 1, 0, 0])) <= 0.5 / 255 + 1e-4, (value, float(w[1, 1, 0, 0]))   # a uint8 weight


def test_hovering_a_query_writes_its_weights(browser, neuron_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    page, views = neuron_page
    _open(browser, page)
    token = browser.find_element(By.CSS_SELECTOR, '#head-view text[data-side="q"][data-index="2"]')
    ActionChains(browser).move_to_element(token).perform()
    shown = browser.execute_script(
        "return [...document.querySelectorAll('#values text')].map(t => [+t.dataset.k, +t.textContent])")
    row = views[0].weights[0, 0, 2]                                    # layer 1, the first head shown, "sat"
    assert shown and {k for k, _ in shown} == {k for k in range(6) if row[k] >= 0.005}
    assert all(abs(v - float(row[k])) <= 0.0021 for k, v in shown)   # 3 decimals of a uint8 weight


def test_the_neuron_view_shows_queries_keys_products_and_scores(browser, neuron_page, tmp_path):
    """For a chosen query token and head, the scores the page writes are q . k times 1/sqrt(D) of the
    model's own queries and keys, and its weights their softmax (the recorded attention)."""
    from selenium.webdriver.common.by import By
    page, views = neuron_page
    _open(browser, page)
    browser.find_element(By.ID, "tab-neuron").click()
    browser.find_element(By.CSS_SELECTOR, '#neuron-queries button[data-token="3"]').click()      # "on"
    head = browser.find_element(By.CSS_SELECTOR, '#heads button[data-head="2"]')
    browser.execute_script("arguments[0].dispatchEvent(new MouseEvent('dblclick', {bubbles: true}))", head)
    got = browser.execute_script("""return [[...document.querySelectorAll('#neuron-svg text.score')].map(t => +t.textContent),
        [...document.querySelectorAll('#neuron-svg text.weight')].map(t => +t.textContent),
        [...document.querySelectorAll('#neuron-svg rect.qk')].length,
        [...document.querySelectorAll('#neuron-svg rect.q')].map(r => +r.dataset.value)]""")
    scores, weights, products, query = got
    v = views[0]
    q, k = v.queries[0, 2, 3], v.keys[0, 2]
    want = (k @ q) * v.score_scale
    assert torch.allclose(torch.tensor(scores), want, atol=6e-4), (scores, want)       # 3 decimals
    assert torch.allclose(torch.tensor(weights), torch.softmax(want, -1), atol=3e-3)  # a uint8 weight
    assert products == 6 * q.numel() and torch.allclose(torch.tensor(query), q, rtol=1e-3, atol=1e-6)
    _keep(browser, "explorer-neuron-view.png", tmp_path)
    urls = browser.execute_async_script("const done = arguments[0]; attnlabExplorer.exportView(3).then(done)")
    png = base64.b64decode(urls["png"].split(",", 1)[1])
    width = browser.execute_script("return document.getElementById('neuron-svg').width.baseVal.value")
    assert int.from_bytes(png[16:20], "big") == round(3 * width)                  # 3x, drawn again


def test_png_export_is_drawn_at_the_chosen_resolution(browser, neuron_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    page, _ = neuron_page
    _open(browser, page)
    sizes = {}
    for scale in ("1", "4"):
        Select(browser.find_element(By.ID, "png-scale")).select_by_value(scale)
        for tab in ("head", "model"):
            browser.find_element(By.ID, f"tab-{tab}").click()
            time.sleep(0.2)
            urls = browser.execute_async_script("const done = arguments[0]; attnlabExplorer.exportView().then(done)")
            png = base64.b64decode(urls["png"].split(",", 1)[1])
            sizes[tab, scale] = (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big"))
    for tab in ("head", "model"):
        assert sizes[tab, "4"] == (4 * sizes[tab, "1"][0], 4 * sizes[tab, "1"][1]), sizes


def test_a_notebook_shows_the_explorer_inline(browser, neuron_page, tmp_path):
    """`show(...)._repr_html_()`, what Jupyter puts in an output cell, is an iframe that runs the page."""
    from attnlab.viz.explorer import ExplorerPage, show
    _, views = neuron_page
    shown = show(views, title="inline <b>", height=500)
    assert isinstance(shown, ExplorerPage) and "attnlab-data" in shown.html
    cell = tmp_path / "notebook.html"
    cell.write_text(f"<!DOCTYPE html><html><body><p>Out[1]:</p>{shown._repr_html_()}</body></html>", encoding="utf-8")
    browser.get_log("performance")
    browser.get(cell.as_uri())
    frame = browser.find_element("css selector", "iframe")
    assert frame.size["height"] == 500 + 2                                  # and its 1-pixel border
    browser.switch_to.frame(frame)
    end = time.time() + 20
    while browser.execute_script("return window.attnlabReady || null") is None:
        assert time.time() < end, "the page inside the notebook cell never drew"
        time.sleep(0.05)
    assert len(_lines(browser)) > 0 and browser.execute_script("return document.title").startswith("inline <b>")
    browser.switch_to.default_content()
    assert not [u for _, u in _requests(browser) if u.split(":", 1)[0] in ("http", "https", "ws", "wss", "ftp")]
    assert shown.save(tmp_path / "saved.html").read_text(encoding="utf-8") == shown.html


def test_the_recorded_queries_and_keys_give_the_recorded_weights_with_rope_and_grouped_heads():
    """What the neuron view draws is what the scores were computed from: a LLaMA (RoPE, 4 query
    heads over 2 key/value heads) through text_views; softmax(q k^T * scale) under the causal mask
    equals the recorded weights to 1e-5 (fp32), and the keys are repeated per query head."""
    from attnlab.models import Llama, LlamaConfig
    from attnlab.viz.views import text_views
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=96, d_model=32, num_heads=4, num_layers=2, d_ff=64, num_kv_heads=2,
                              head_dim=8, max_position_embeddings=64)).eval()
    ids = [5, 17, 5, 8, 3, 9, 11]
    (v,) = text_views(model, ids, [str(i) for i in ids])
    assert v.queries.shape == (2, 4, 7, 8) and v.keys.shape == (2, 4, 7, 8)
    assert torch.equal(v.keys[:, 0], v.keys[:, 1]) and torch.equal(v.keys[:, 2], v.keys[:, 3])   # one k per group
    scores = (v.queries @ v.keys.transpose(-1, -2) * v.score_scale).masked_fill(
        torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(torch.softmax(scores, -1), v.weights, rtol=0, atol=1e-5)
    # token 5 at positions 0 and 2 enters layer 1 as the same vector: only RoPE tells its queries apart
    assert ids[0] == ids[2] and (v.queries[0, :, 0] - v.queries[0, :, 2]).abs().max() > 1e-3
    assert torch.allclose(v.queries[0, :, 0].norm(dim=-1), v.queries[0, :, 2].norm(dim=-1), atol=1e-5)   # a rotation
