"""The docs site builds: `mkdocs build --strict` over docs/ fails on a broken link, a missing
image or a page left out of the navigation, and the navigation follows docs/index.md's order."""
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _nav_pages() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    assert config["strict"] is True, "mkdocs.yml must build strictly so a broken link fails"
    return [next(iter(entry.values())) for entry in config["nav"]]


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
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config = re.sub(r"(?ms)^nav:.*", "nav:\n  - Home: index.md\n", config)
    (tmp_path / "mkdocs.yml").write_text(config, encoding="utf-8")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "--site-dir", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "missing.md" in proc.stdout + proc.stderr
