"""The docs site builds: `mkdocs build --strict` over docs/ fails on a broken link, a missing
image or a page left out of the navigation, and the navigation follows docs/index.md's order.

The built site is then opened in Debian's Chromium: the math is typeset by the KaTeX copied into
the site (docs/_hooks/offline.py), code is coloured by Pygments at build time, and no request
leaves the machine (no CDN)."""
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True, "mkdocs.yml must build strictly so a broken link fails"
    pages = []
    for entry in config["nav"]:              # a group is a list of {title: page}
        value = next(iter(entry.values()))
        pages += [next(iter(e.values())) for e in value] if isinstance(value, list) else [value]
    return pages


def test_nav_follows_the_reading_order_of_the_index():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    order = index.split("## Reading order", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\s*\d+\. \[[^\]]+\]\(([\w./-]+\.md)\)", order, re.MULTILINE)
    nav = [p for p in _nav_pages() if p != "index.md"]
    assert [p for p in nav if p in listed] == listed, "mkdocs.yml's nav must follow docs/index.md"


def test_site_builds_strictly(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "attention" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# x\n\n[gone](missing.md)\n", encoding="utf-8")
    for folder in ("_hooks", "assets"):                 # the build's own hook and styles
        shutil.copytree(ROOT / "docs" / folder, docs / folder)
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - Home: index.md\n", config)
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "missing.md" in proc.stdout + proc.stderr


def test_nav_is_grouped_by_the_chapter_parts():
    """The top menu holds a handful of groups (it wrapped onto five lines with 21 flat items)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert len(config["nav"]) <= 7, "the top navigation must stay on one line: group the pages"
    assert all(isinstance(next(iter(e.values())), list) for e in config["nav"][1:]), "groups after Home"


# ------------------------------------------------------------------ the built site in Chromium

from test_explorer_browser import ARTIFACTS, browser  # noqa: E402,F401  (the shared Chromium fixture)

# a page of display formulas, one of inline ones in tables, one of both with highlighted code
SITE_PAGES = ("attention", "positions", "state-space")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def _load(driver, page: Path) -> int:
    driver.get_log("performance")
    driver.get(page.as_uri())
    end = time.time() + 20
    while time.time() < end:
        typeset = driver.execute_script("return document.documentElement.dataset.mathTypeset || null")
        if typeset is not None:
            return int(typeset)
        time.sleep(0.05)
    raise AssertionError(f"{page}: the math was never typeset; console: {driver.get_log('browser')}")


@pytest.mark.browser
@pytest.mark.parametrize("name", SITE_PAGES)
def test_pages_typeset_their_math_offline(browser, built_site, name, tmp_path):  # noqa: F811
    page = built_site / name / "index.html"
    formulas = len(re.findall(r'class="arithmatex"', page.read_text(encoding="utf-8")))
    assert formulas >= 3, f"{name}: the page has no formulas to typeset"
    typeset = _load(browser, page)
    assert typeset == formulas, f"{name}: {typeset} of {formulas} formulas typeset"
    # KaTeX drew them with its own fonts (loaded from the site), and none failed to parse
    assert browser.execute_script("return document.querySelectorAll('.katex-error').length") == 0
    assert browser.execute_script(
        "return document.fonts.check('16px KaTeX_Main') && [...document.fonts].some("
        "f => f.family.includes('KaTeX') && f.status === 'loaded')")
    # code is coloured (Pygments' spans) with no script from elsewhere
    assert browser.execute_script("return document.querySelectorAll('.highlight span.k, .highlight span.kn').length") > 0
    sent = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            sent.append(message["params"]["request"]["url"])
    assert any(u.endswith("katex.min.js") for u in sent) and any(".woff2" in u for u in sent), sent
    away = [u for u in sent if not u.startswith(("file:", "data:"))]
    assert not away, f"{name}: requests left the machine: {away}"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"site-{name}.png"))


@pytest.mark.browser
def test_no_formula_on_any_page_fails_to_parse(browser, built_site):  # noqa: F811
    broken = {}
    for page in sorted(built_site.glob("*/index.html")):
        if 'class="arithmatex"' not in page.read_text(encoding="utf-8"):
            continue
        _load(browser, page)
        errors = browser.execute_script(
            "return [...document.querySelectorAll('.katex-error')].map(e => e.title || e.textContent)")
        if errors:
            broken[page.parent.name] = errors
    assert not broken, broken


@pytest.mark.browser
def test_the_coverage_table_fits_its_column(browser, built_site):  # noqa: F811
    """The home page's tables wrap inside the text column at a laptop's width (they overflowed)."""
    browser.set_window_size(1280, 900)
    _load(browser, built_site / "index.html")
    widths = browser.execute_script(
        "const column = document.querySelector('.col-md-9').clientWidth;"
        "return [...document.querySelectorAll('.col-md-9 table')].map(t => [t.scrollWidth, t.clientWidth, column])")
    assert widths and all(scroll <= client <= column for scroll, client, column in widths), widths


def test_lesson_pages_carry_no_machine_dependent_timings():
    """Timings and per-CPU results go stale: they live in benchmarks/results/ and the pages link there.
    A CPU's name, a time in ms, or 'N s of CPU' on a lesson page fails this test."""
    stale = re.compile(r"\b(Xeon|EPYC|Ryzen|Core i[3579])\b|\b\d[\d,.]*\s?ms\b(?! of audio)|\b\d[\d,.]*\s?s of (CPU|its|wall)\b"
                       r"|\btokens/s\b|\bload average\b", re.IGNORECASE)
    found = [f"docs/{page.name}:{n}: {line.strip()[:80]}"
             for page in sorted((ROOT / "docs").glob("*.md"))
             for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if stale.search(line)]
    assert not found, "machine-dependent figures on lesson pages (move them to benchmarks/results/):\n" + "\n".join(found)
    for name in ("vision.md", "state-space.md", "explorer.md", "lessons.md"):
        assert (ROOT / "benchmarks" / "results" / name).is_file(), f"benchmarks/results/{name} is missing"


# a CPU model, or a time in ms / us, in the library's docstrings and comments
# ("N ms of audio", a stretch of sound such as a frame's hop, is no timing)
_STALE_IN_CODE = re.compile(r"\b(Xeon|EPYC|Ryzen|Zen \d|Core i[3579])\b|\b\d[\d,.]*\s?(ms|us|µs)\b(?! of audio)"
                            r"|\b\d[\d,.]*\s?GB/s\b|\d\s?k?\s?tokens/s\b")


def test_the_library_s_docstrings_and_comments_carry_no_machine_dependent_timings():
    """The same rule for src/attnlab: docstrings and comments state the rule a measurement chose and
    point to benchmarks/results/code.md, where the figures and the CPU they were measured on are."""
    src = ROOT / "src" / "attnlab"
    found = [f"{f.relative_to(src)}:{n}: {line.strip()[:80]}" for f in sorted(src.rglob("*.py"))
             for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if _STALE_IN_CODE.search(line)]
    assert not found, "machine-dependent figures in the code (move them to benchmarks/results/code.md):\n" + \
        "\n".join(found)
    assert _STALE_IN_CODE.search("took 8.1 ms on an Intel Xeon") and not _STALE_IN_CODE.search("--max-ms 5")
    assert _STALE_IN_CODE.search("a step takes 20 ms") and not _STALE_IN_CODE.search("a hop of 20 ms of audio")
    assert (ROOT / "benchmarks" / "results" / "code.md").is_file()
