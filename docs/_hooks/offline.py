"""MkDocs hook: the site carries everything it draws with, so it reads the same with no network.

KaTeX (the math) comes from Debian's ``libjs-katex`` package, installed by scripts/setup.sh, and is
copied into ``site/assets/katex/`` by the build rather than committed, so the repository holds no
third-party bundle. Code is coloured at build time by Pygments (``pymdownx.highlight``), whose
stylesheet this hook writes as ``assets/pygments.css``; the theme's own highlighter would fetch a
script from a CDN, so mkdocs.yml turns it off.

``ATTNLAB_KATEX_DIR`` points the build at another KaTeX folder (one holding katex.min.js,
katex.min.css, fonts/ and contrib/auto-render.min.js or auto-render.js).
"""
from __future__ import annotations

import os
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

KATEX_DIRS = (Path("/usr/share/javascript/katex"),)
# what the pages load (mkdocs.yml's extra_css / extra_javascript) and the fonts katex.min.css names
WANTED = ("katex.min.js", "katex.min.css", "contrib/auto-render.js")


def katex_dir() -> Path:
    candidates = [Path(os.environ["ATTNLAB_KATEX_DIR"])] if os.environ.get("ATTNLAB_KATEX_DIR") else list(KATEX_DIRS)
    for folder in candidates:
        if all((folder / name).is_file() for name in WANTED) and (folder / "fonts").is_dir():
            return folder
    raise PluginError(f"KaTeX is missing ({', '.join(map(str, candidates))} has no katex.min.js, fonts/ and "
                      "contrib/auto-render.js): run scripts/setup.sh, or 'apt-get install libjs-katex'")


def pygments_css() -> str:
    from pygments.formatters import HtmlFormatter
    return HtmlFormatter(style="default").get_style_defs(".highlight")


def on_files(files: Files, config) -> Files:
    folder = katex_dir()
    for name in WANTED:
        files.append(File.generated(config, f"assets/katex/{name}", abs_src_path=str(folder / name)))
    for font in sorted((folder / "fonts").iterdir()):    # a symlink into /usr/share/fonts on Debian
        if font.suffix in (".woff2", ".woff", ".ttf"):
            files.append(File.generated(config, f"assets/katex/fonts/{font.name}", abs_src_path=str(font.resolve())))
    files.append(File.generated(config, "assets/pygments.css", content=pygments_css()))
    return files
