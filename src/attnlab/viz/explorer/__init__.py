"""The attention explorer: ONE self-contained HTML page (data, script and style inline; it makes
no network request) with a head view, a model view and PNG/SVG export.

    write_page(views, "attention.html", title="the cat sat")

The page's code lives beside this file (page.html, explorer.css, explorer.js) and is inlined when
a page is written. What it draws comes from :func:`payload`, a JSON object::

    {"format": 1, "title": str,
     "images": ["data:image/png;base64,..."],                 (pictures the views below refer to)
     "views": [{"name", "title", "kind": "attention" | "matrix", "scale": float,
                "layers": L, "heads": H, "rows": [T labels], "cols": [S labels],
                "encoding": "dense" | "topk", "k": int (topk only), "rowmax": [...] (image views only),
                "image": {"index", "rows", "cols", "cell": [h, w], "prefix"} (only where the keys
                         tile a picture: images[index], prefix tokens then rows x cols patches
                         of h x w pixels),
                "data": [one base64 string per layer]}]}

Every view is an (L, H, T, S) array read the same way (row t: how much query t takes from each
key), so a new kind of model adds views, not page code: self- and cross-attention per layer stack
now; a "matrix" view (any non-negative (L, H, T, S) array with labels, drawn relative to its
``scale``, such as a state-space model's implicit attention) needs nothing more. Values are
quantised to uint8 (value / scale * 255, rounded): a step of 1/255 of the largest weight, finer
than a colour map or a line's opacity shows.

- "dense": each layer is H*T*S bytes, head-major then row-major.
- "topk" (long inputs, where the dense array would pass ``DENSE_LIMIT`` bytes): each row keeps
  its k strongest keys (``TOP_K``, fewer where the whole would pass ``SPARSE_BUDGET``); per layer,
  H*T*k little-endian uint16 key indices, then H*T*k uint8 values (each row's k strongest keys,
  strongest first), then H*T uint8 of the rest: the mass of the keys not kept, which the page
  shows as one aggregate per row instead of thousands of faint links.

A view over a picture keeps every key, since its overlay tints every patch of a row: dense, or
where that would pass ``DENSE_LIMIT`` and no row has more than a few nonzero weights (Swin's
windows), "topk" with k the largest count of nonzero weights in a row, so that the rest is zero.
Its rows are quantised against their own largest weight (a class token spreads small weights
over hundreds of patches, which 1/255 of 1 would flatten to a few levels): "rowmax" holds, per
layer, base64 of H*T little-endian float32 row maxima, and a byte b of row (h, t) stands for
b / 255 * rowmax[h, t] (times ``scale``). The picture is embedded once, as a data URI, however
many views refer to it.

Every view also has "top": the value its colour scale ends at, the same for all its layers and
heads (the 99.5th percentile of its nonzero weights, at least 1/S, at most the largest): one
legend reads every panel, and a causal model's first row (a weight of 1 on itself) does not
darken the rest. A view that carries its queries and keys (:class:`~attnlab.viz.views.View`)
adds, while they fit ``NEURON_LIMIT`` bytes, "neurons": {"dim": D, "scale": the score's factor,
"q": [per layer base64 of H*T*D little-endian float32], "k": [the same for H*S*D]}, which the
neuron view draws (a query, every key, their elementwise products and the scores).

The page decodes a layer only when a view first needs it. :func:`show` returns an
:class:`ExplorerPage`, which a notebook displays inline (``_repr_html_``, the page in an iframe
of its own, so its script and style touch nothing else) and which saves itself as a file.
"""
from __future__ import annotations

import base64
import html
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from ..views import View

__all__ = ["payload", "page", "write_page", "show", "ExplorerPage", "serve", "DENSE_LIMIT", "TOP_K", "NEURON_LIMIT"]

DENSE_LIMIT = 2_500_000      # bytes of one view's dense payload, beyond which rows keep their top k
TOP_K = 12
# bytes of one view's top-k payload (before base64's 4/3): a longer input keeps fewer keys per row,
# down to MIN_K, so that a 6 x 12-head page over 2,048 tokens stays under 5 MB
SPARSE_BUDGET, MIN_K = 3_500_000, 4
NEURON_LIMIT = 2_000_000     # bytes of one view's queries and keys (float32), beyond which they are left out


def _quantise(x: torch.Tensor) -> np.ndarray:
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def _b64(*parts: np.ndarray) -> str:
    return base64.b64encode(b"".join(np.ascontiguousarray(p).tobytes() for p in parts)).decode("ascii")


def _view_payload(view: View, dense_limit: int, k: int) -> dict:
    w = view.weights / view.scale
    L, H, T, S = w.shape
    out = {"name": view.name, "title": view.title, "kind": view.kind, "scale": view.scale, "layers": L,
           "heads": H, "rows": view.rows, "cols": view.cols, "top": _top(w)}
    if view.queries is not None and 4 * L * H * (T + S) * view.queries.size(-1) <= NEURON_LIMIT:
        out["neurons"] = {"dim": view.queries.size(-1), "scale": view.score_scale,
                          "q": [_b64(view.queries[i].numpy().astype("<f4")) for i in range(L)],
                          "k": [_b64(view.keys[i].numpy().astype("<f4")) for i in range(L)]}
    if view.image is not None:            # the overlay tints every patch: no key may be dropped
        k = int((w > 0).sum(-1).max())
        dense_limit = dense_limit if 3 * k < S else L * H * T * S
        # and a class token's weights over hundreds of patches are all small: each row is
        # quantised against its own largest weight, which the page multiplies back
        rowmax = w.amax(-1).clamp_min(1e-30)                                   # (L, H, T)
        w = w / rowmax[..., None]
        out["rowmax"] = [_b64(rowmax[i].numpy().astype("<f4")) for i in range(L)]
    if L * H * T * S <= dense_limit or S <= k:
        out.update(encoding="dense", data=[_b64(_quantise(w[i])) for i in range(L)])
        return out
    if view.image is None:
        k = max(MIN_K, min(k, (SPARSE_BUDGET // (L * H * T) - 1) // 3))   # 2 + 1 bytes per kept key, 1 for the rest
    data = []
    for i in range(L):
        values, index = w[i].topk(k, dim=-1)                                  # (H, T, k), strongest first
        rest = (w[i].sum(-1) - values.sum(-1)).clamp_min(0)                  # (H, T)
        data.append(_b64(index.numpy().astype("<u2"), _quantise(values), _quantise(rest)))
    out.update(encoding="topk", k=k, data=data)
    return out


def _top(w: torch.Tensor) -> float:
    """Where the view's colour scale ends, as a fraction of its ``scale`` (module docstring)."""
    nonzero = w[w > 0]
    if nonzero.numel() == 0:
        return 1.0
    sample = nonzero[torch.linspace(0, nonzero.numel() - 1, min(nonzero.numel(), 1_000_000)).long()]
    top = torch.quantile(sample.sort().values, 0.995).item()
    return float(min(max(top, 1.0 / w.shape[-1]), nonzero.max().item()))


def payload(views: list[View], title: str = "", *, dense_limit: int = DENSE_LIMIT, k: int = TOP_K) -> dict:
    """The page's data (module docstring) for ``views``."""
    if not views:
        raise ValueError("explorer: no views to show")
    if any(max(len(v.cols), 1) > 65535 for v in views):
        raise ValueError("explorer: a view has more than 65,535 keys, beyond the page's uint16 indices")
    images: list[bytes] = []
    out = []
    for v in views:
        out.append(_view_payload(v, dense_limit, k))
        if v.image is not None:
            if v.image.png not in images:
                images.append(v.image.png)
            g = v.image
            out[-1]["image"] = {"index": images.index(g.png), "rows": g.rows, "cols": g.cols, "cell": list(g.cell),
                                "prefix": g.prefix}
    return {"format": 1, "title": title, "images": ["data:image/png;base64," + base64.b64encode(p).decode("ascii")
                                                    for p in images], "views": out}


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def page(views: list[View], title: str = "", **options) -> str:
    """The whole HTML page as a string."""
    data = json.dumps(payload(views, title, **options), separators=(",", ":"), ensure_ascii=True)
    # the JSON sits inside a <script> element, which "</script>" or "<!--" in a label would end
    # or derail: no "<" is left in it (JSON reads the escape as the same character)
    data = data.replace("<", "\\u003c")
    # the colour scale and the neuron view define themselves first; the explorer uses them
    # (one script element)
    parts = {"TITLE": _escape(title or "attention"), "STYLE": _asset("explorer.css"), "DATA": data,
             "SCRIPT": "\n".join(_asset(n) for n in ("draw.js", "neuron.js", "explorer.js"))}
    # one pass, so that a placeholder inside the inserted text (a token label) stays as it is
    return re.sub(r"/\*@([A-Z]+)@\*/", lambda m: parts[m.group(1)], _asset("page.html"))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_page(views: list[View], path: str | Path, title: str = "", **options) -> Path:
    """Write the page to ``path`` (its folder made if missing); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page(views, title, **options), encoding="utf-8")
    return path


class ExplorerPage:
    """What :func:`show` returns: the page as ``html``; a notebook shows it inline (an iframe whose
    document is the page, so nothing is fetched and nothing outside it is touched); ``save(path)``
    writes it."""

    def __init__(self, text: str, title: str = "", height: int = 640):
        self.html, self.title, self.height = text, title, height

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" title="{html.escape(self.title or "attention")}" '
                f'style="width: 100%; height: {int(self.height)}px; border: 1px solid #ddd" '
                f'sandbox="allow-scripts allow-downloads"></iframe>')

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html, encoding="utf-8")
        return path

    def __repr__(self) -> str:
        return f"ExplorerPage({self.title!r}, {len(self.html):,} characters)"


def show(views: list[View], title: str = "", *, height: int = 640, **options) -> ExplorerPage:
    """The explorer for ``views`` as an object a notebook displays inline (``_repr_html_``)."""
    return ExplorerPage(page(views, title, **options), title, height)


def serve(path: str | Path, port: int = 0) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 (``port`` 0: a free one, see ``server.server_address``) that
    answers "/" and "/NAME" with the page at ``path`` and nothing else; the caller runs
    ``serve_forever()``. The page needs nothing but itself, so no other file is exposed."""
    body = Path(path).read_bytes()
    name = "/" + Path(path).name

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path.split("?")[0] not in ("/", name):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):        # library code never prints
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Page)
