"""The vision page's figures (docs/vision.md), for scripts/figures.py: a digit cut into patches,
MAE's masking of it (both computed in a second), and two measured from one trained digits ViT,
the position-similarity maps of its learned table and the class token's attention over held-out
digits (``--vision-run DIR``, else the run of :data:`VISION_COMMAND` trained here, about three
minutes on one idle core; the same seed gave the same manifest entries and PNG bytes on
retraining on this project's CPU)."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib
import numpy as np
import torch

from figure_common import plt, save_figure as _save, save_plain as _save_plain

ROOT = Path(__file__).resolve().parent.parent


def _digit(index: int = 0, size: int = 16) -> tuple[torch.Tensor, int]:
    """A digit of the embedded set, enlarged to ``size`` pixels by repeating each pixel."""
    from attnlab.data.digits import digit_images
    images, labels = digit_images()
    img = images[index, 0].float() / 255.0
    r = size // img.size(0)
    return img.repeat_interleave(r, 0).repeat_interleave(r, 1), int(labels[index])


def data_patches() -> dict:
    """Section 5.3: a 16 x 16 digit cut into 4 x 4 patches (attnlab's patch order, the one
    PatchEmbedding's convolution lays out), each patch flattened to 16 numbers."""
    from attnlab.models.mae import patchify
    img, _ = _digit(0)
    return {"image": img.numpy(), "patches": patchify(img[None, None], 4)[0].numpy()}    # (16, 16)


def data_mae_masking() -> dict:
    """Section 5.5: MAE's random masking (attnlab.models.mae.random_masking, ratio 0.75, seeded
    noise) of the 16 x 16 digit in 2 x 2 patches: which 16 of the 64 patches the encoder sees."""
    from attnlab.models.mae import patchify, random_masking
    img, _ = _digit(0)
    patches = patchify(img[None, None], 2)                                  # (1, 64, 4)
    noise = torch.rand(1, 64, generator=torch.Generator().manual_seed(0))
    kept, mask, _ = random_masking(patches, 0.75, noise)
    return {"image": img.numpy(), "mask": mask[0].reshape(8, 8).numpy(), "kept": kept[0].numpy()}



def draw_patches(data, path):
    img, patches = data["image"], data["patches"]
    p, n = 4, patches.shape[0]
    fig = plt.figure(figsize=(9, 3.4))
    ax = fig.add_axes([0.02, 0.08, 0.3, 0.84])
    ax.imshow(img, cmap="gray", vmin=0, vmax=1)
    for t in range(0, img.shape[0] + 1, p):
        ax.axhline(t - 0.5, color="tab:orange", lw=1)
        ax.axvline(t - 0.5, color="tab:orange", lw=1)
    for i in range(n):
        r, c = divmod(i, img.shape[1] // p)
        ax.text(c * p + 0.2, r * p + 1.0, str(i + 1), color="tab:orange", fontsize=7)
    ax.set_title("16 x 16 digit, 4 x 4 patches", fontsize=9)
    ax.set_axis_off()
    width = 0.62 / (n + 1)
    for j in range(n + 1):
        tile = fig.add_axes([0.35 + j * width, 0.45, width * 0.9, width * 0.9 * 9 / 3.4])
        if j == 0:
            tile.imshow(np.full((p, p), 0.5), cmap="Blues", vmin=0, vmax=1)
            tile.set_title("CLS", fontsize=6)
        else:
            tile.imshow(patches[j - 1].reshape(p, p), cmap="gray", vmin=0, vmax=1)
            tile.set_title(str(j), fontsize=6)
        tile.set_xticks([])
        tile.set_yticks([])
    fig.text(0.35, 0.25, "the sequence: a learned class token, then the patches in row-major order;\n"
             "each patch's 16 pixels -> one linear map -> a vector of embed_dim, plus its position's row",
             fontsize=8)
    _save_plain(fig, path)


def draw_mae_masking(data, path):
    img, mask = data["image"], data["mask"]
    hidden = np.kron(mask, np.ones((2, 2))).astype(bool)                     # per pixel: dropped?
    fig, axes = plt.subplots(1, 3, figsize=(7.5, 2.8))
    seen = np.where(hidden, np.nan, img)
    panels = ((img, "the image: 64 patches of 2 x 2"),
              (seen, f"the encoder sees {int((1 - mask).sum())} (25 %)"),
              (np.where(hidden, img, np.nan), f"the decoder paints {int(mask.sum())} back"))
    for ax, (picture, title) in zip(axes, panels):
        cmap = matplotlib.colormaps["gray"].copy()
        cmap.set_bad("#4a78b0")
        ax.imshow(picture, cmap=cmap, vmin=0, vmax=1)
        ax.set_title(title, fontsize=9)
        ax.set_axis_off()
    _save(fig, path)



# --------------------------------------------------------------------------- vision (measured)

# --ema 0: an average of the weights at decay 0.999 (the digits' default) lags a run of 800 steps (82 % held out)
VISION_COMMAND = ["train", "image", "--steps", "800", "--seed", "0", "--image-size", "16", "--patch-size", "2",
                  "--ema", "0", "--no-progress"]
OVERLAY_DIGITS = (0, 3, 7)             # which held-out digits the class-token figure shows (one each)
_VISION = {}


def _vision_run(run: Path | None) -> tuple[Path, str]:
    """The digits ViT both vision figures read: ``--vision-run DIR``, else one trained here."""
    if "run" in _VISION:
        return _VISION["run"]
    if run is None:
        run = Path(tempfile.mkdtemp(prefix="attnlab-figures-")) / "vit"
        subprocess.run([sys.executable, "-m", "attnlab.cli", *VISION_COMMAND, "--out", str(run)], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    _VISION["run"] = run, "attnlab " + " ".join(VISION_COMMAND)
    return _VISION["run"]


def _vision_model(run: Path):
    from attnlab.tasks.run import inspect_path, load_model, load_processors
    info = inspect_path(str(run))
    model, processor = load_model(info.run).eval(), load_processors(info.run)["image"]
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"eval"' in line]
    return model, processor, max(e["accuracy"] for e in evals)


def position_similarity_data(model) -> dict:
    """Cosine similarity of every patch's learned position row to every other's, (P, P), and the
    mean over 4-neighbours against over patches at least half the grid apart (Chebyshev)."""
    rows, cols = model.config.image_size // model.config.patch_size, model.config.image_size // model.config.patch_size
    table = model.position.weight.detach()[0, 1:]                          # (P, E): the grid rows
    unit = torch.nn.functional.normalize(table, dim=-1)
    sim = (unit @ unit.T).numpy()
    r, c = np.divmod(np.arange(rows * cols), cols)
    dist = np.maximum(np.abs(r[:, None] - r[None]), np.abs(c[:, None] - c[None]))
    manhattan = np.abs(r[:, None] - r[None]) + np.abs(c[:, None] - c[None])
    return {"similarity": sim, "grid": (rows, cols), "neighbours": float(sim[manhattan == 1].mean()),
            "far": float(sim[dist >= rows // 2].mean())}


def position_similarity(path: Path, run: Path | None = None) -> dict:
    run, source = _vision_run(run)
    model, _, accuracy = _vision_model(run)
    d = position_similarity_data(model)
    rows, cols = d["grid"]
    fig, axes = plt.subplots(rows, cols, figsize=(0.95 * cols + 1.2, 0.95 * rows))
    for i, ax in enumerate(axes.flat):
        im = ax.imshow(d["similarity"][i].reshape(rows, cols), cmap="viridis", vmin=-1, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(im, ax=axes, fraction=0.03, pad=0.02, label="cosine similarity")
    fig.suptitle(f"each patch's position row against every other's (a ViT trained on the digits, "
                 f"{accuracy:.1f} % held out)", fontsize=8)
    _save_plain(fig, path)
    return {"source": source, "held_out_accuracy": accuracy, "neighbour_similarity": round(d["neighbours"], 4),
            "far_similarity": round(d["far"], 4)}


def class_attention(path: Path, run: Path | None = None) -> dict:
    """The class token's attention over held-out digits: rollout and the last layer's heads,
    from attnlab's per-call records (attnlab.viz.image, what `attnlab viz --image` draws)."""
    from attnlab.data.digits import digits_split
    from attnlab.viz.image import class_token_maps, image_attention
    run, source = _vision_run(run)
    model, processor, _ = _vision_model(run)
    images, labels = digits_split()["valid"]
    picks = [int((labels == d).nonzero()[0]) for d in OVERLAY_DIGITS]
    heads = model.config.num_heads
    fig, axes = plt.subplots(len(picks), 2 + heads, figsize=(1.6 * (2 + heads), 1.7 * len(picks)))
    on_digit, area = [], []
    for row, i in zip(axes, picks):
        shown = processor.resized(images[i, 0].numpy())                  # (C, H, W) bytes, as the model reads
        weights, grid = image_attention(model, processor.finish(shown)[None])
        rollout, per_head = class_token_maps(weights, grid)
        picture = shown[0].numpy()
        ph, pw = grid.patch_size
        bright = torch.from_numpy(picture).float().reshape(grid.rows, ph, grid.cols, pw).mean((1, 3)) > 64
        on_digit.append(float(rollout[bright].sum() / rollout.sum()))     # the rollout's share on ink patches
        area.append(float(bright.float().mean()))                         # those patches' share of the grid
        maps = [("input", None), ("rollout", rollout)] + [(f"last layer, head {h + 1}", per_head[h])
                                                          for h in range(heads)]
        for ax, (title, heat) in zip(row, maps):
            ax.imshow(picture, cmap="gray")
            if heat is not None:
                heat = heat / heat.max().clamp_min(1e-12)
                ax.imshow(heat.numpy(), cmap="inferno", alpha=0.6, extent=(-0.5, picture.shape[1] - 0.5, picture.shape[0] - 0.5, -0.5),
                          interpolation="nearest", vmin=0, vmax=1)
            ax.set_title(f"{title}" if heat is not None else f"digit {int(labels[i])}", fontsize=7)
            ax.set_axis_off()
    _save(fig, path)
    return {"source": source, "digits": [int(labels[i]) for i in picks],
            "rollout_on_digit": [round(v, 4) for v in on_digit], "digit_area": [round(v, 4) for v in area]}


# --------------------------------------------------------------------------- the explorer's image view (measured)

SCREENSHOT_DIGIT = 3                   # the held-out digit whose page the screenshot shows
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")   # Debian's, scripts/setup.sh
BROWSER_FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1000,900",
                 "--hide-scrollbars"]


def _screenshot(page: Path, path: Path, profile: Path) -> None:
    """Open ``page`` in headless Chromium (through Selenium and its chromedriver, both Debian's)
    and save the window once the image view has drawn its first overlay."""
    import time
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        raise SystemExit(f"explorer_image_view needs {CHROMIUM} and {CHROMEDRIVER} (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in BROWSER_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(page.as_uri())
        end = time.time() + 30
        while not driver.execute_script("return document.getElementById('image-canvas')?.dataset.query ?? null"):
            if time.time() > end:
                raise RuntimeError(f"{page}: the image view never drew")
            time.sleep(0.05)
        # the page opens on every head; the figure (and the numbers the page quotes) is head 1 alone
        driver.execute_script("document.querySelector('#heads button[data-head=\"0\"]')"
                              ".dispatchEvent(new MouseEvent('dblclick', {bubbles: true}))")
        time.sleep(0.3)
        driver.save_screenshot(str(path))
    finally:
        driver.quit()


def explorer_image_view(path: Path, run: Path | None = None) -> dict:
    """A screenshot of the explorer page (`attnlab viz RUN --image digit.png --html page.html`)
    of the trained digits ViT on a held-out digit: its image view as it opens, the class token's
attention in layer 1, head 1."""
    from attnlab.data.digits import digits_split
    from attnlab.viz.explorer import write_page
    from attnlab.viz.image_views import image_views
    run, source = _vision_run(run)
    model, processor, accuracy = _vision_model(run)
    images, labels = digits_split()["valid"]
    i = int((labels == SCREENSHOT_DIGIT).nonzero()[0])
    views = image_views(model, processor, images[i, 0].numpy())
    row = views[0].weights[0, 0, 0]                  # layer 1, head 1, the class token's row: what is drawn
    with tempfile.TemporaryDirectory(prefix="attnlab-figures-") as tmp:
        page = write_page(views, Path(tmp) / "digit.html", title=f"a held-out {SCREENSHOT_DIGIT}")
        _screenshot(page, path, Path(tmp) / "profile")
    return {"source": source, "held_out_accuracy": accuracy, "digit": SCREENSHOT_DIGIT,
            "brightest_patch": round(float(row[1:].max()), 4), "to_class_token": round(float(row[0]), 4)}
