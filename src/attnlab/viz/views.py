"""What the PNG figures and the HTML explorer draw: a list of *views*, each one (L, H, T, S) array
of non-negative weights with a label per row (query) and per column (key).

    views = text_views(model, ids, labels)         # one view per layer stack and role that ran
    views[0].name, views[0].weights.shape          # "layers/self", (L, H, T, S)

A view of kind "attention" holds softmax weights (each row sums to 1, or 0 for a query with no
allowed key). A view of kind "matrix" is any other (L, H, T, S) array that reads the same way (a
state-space model's implicit attention, a relevance map): the figures and the page draw it
scaled by its largest value, and nothing else about it needs to be known to them.

An attention view may also carry the queries and keys whose dot products gave its scores
(``queries`` (L, H, T, D), ``keys`` (L, H, S, D), after any rotary position, and ``score_scale``,
the factor the dot product is multiplied by): the explorer's neuron view draws them.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.attention import MultiHeadAttention
from .implicit import has_implicit_attention, implicit_magnitudes
from .record import AttentionRecord, record_attention

__all__ = ["View", "record_views", "text_views", "implicit_views", "seq2seq_views", "record_queries_keys"]

KINDS = ("attention", "matrix")


@dataclass
class View:
    """One drawable array. name: a short unique id ("encoder_layers/self"); title: what a reader
    sees ("encoder self-attention"); weights: (L, H, T, S), float, >= 0; rows: T labels (the
    queries), cols: S labels (the keys); kind: "attention" or "matrix" (module docstring);
    image: for keys that tile a picture, its :class:`attnlab.viz.image_views.ImageGrid` (the
    page then draws the view over the picture too)."""
    name: str
    title: str
    weights: Tensor
    rows: list[str]
    cols: list[str]
    kind: str = "attention"
    image: object = None
    queries: Tensor | None = None
    keys: Tensor | None = None
    score_scale: float | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"View {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        w = torch.as_tensor(self.weights).detach().float().cpu()
        if w.dim() != 4 or w.shape[2:] != (len(self.rows), len(self.cols)):
            raise ValueError(f"View {self.name!r}: weights of shape {tuple(w.shape)} do not match (layers, heads, "
                             f"{len(self.rows)} row labels, {len(self.cols)} column labels)")
        if not torch.isfinite(w).all() or (w < 0).any():
            raise ValueError(f"View {self.name!r}: weights must be finite and >= 0")
        if self.image is not None and self.image.prefix + self.image.rows * self.image.cols != len(self.cols):
            raise ValueError(f"View {self.name!r}: {len(self.cols)} keys, but its image has {self.image.prefix} "
                             f"prefix tokens and {self.image.rows}x{self.image.cols} patches")
        self.weights = w
        if (self.queries is None) != (self.keys is None):
            raise ValueError(f"View {self.name!r}: queries and keys go together")
        if self.queries is not None:
            q, k = (torch.as_tensor(t).detach().float().cpu() for t in (self.queries, self.keys))
            L, H, T, S = w.shape
            if q.dim() != 4 or q.shape[:3] != (L, H, T) or k.shape != (L, H, S, q.size(-1)):
                raise ValueError(f"View {self.name!r}: queries {tuple(q.shape)} and keys {tuple(k.shape)} do not "
                                 f"match the weights' (L, H, T, S) = {(L, H, T, S)}: expected (L, H, T, D), (L, H, S, D)")
            self.queries, self.keys = q, k
            self.score_scale = q.size(-1) ** -0.5 if self.score_scale is None else float(self.score_scale)

    @property
    def scale(self) -> float:
        """What the largest drawn value stands for: 1 for attention, the largest entry of a matrix."""
        return 1.0 if self.kind == "attention" else max(float(self.weights.max()), 1e-12)


def _title(part: str, role: str) -> str:
    """ "encoder_layers", "self" -> "encoder self-attention"; "decoder.layers" -> "decoder ..."; "layers" -> "self-attention"."""
    words = [w for w in part.replace(".", " ").replace("_", " ").split() if w != "layers"]
    return " ".join(words + [f"{role}-attention"])


def record_views(record: AttentionRecord, rows: Sequence[str], cols: Sequence[str], cross_cols: Sequence[str] = (),
                 batch: int = 0, neurons: dict | None = None) -> list[View]:
    """One view per (part, role) that ran, in the order each first ran, from batch row ``batch``:
    queries labelled ``rows``, keys ``cols`` (``cross_cols`` for cross-attention). ``neurons``,
    from :func:`record_queries_keys`, adds each layer's queries and keys to its view."""
    order = list(dict.fromkeys((c.part, c.role) for c in record))
    views = []
    for part, role in order:
        w = record.stack(role, part=part)[:, batch]
        keys = cross_cols if role == "cross" else cols
        qk = _neurons_of(record, part, role, neurons, batch, w.shape) if neurons else {}
        views.append(View(f"{part or 'layer'}/{role}", _title(part, role), w, list(rows), list(keys), **qk))
    return views


def _neurons_of(record: AttentionRecord, part: str, role: str, neurons: dict, batch: int, shape) -> dict:
    """queries/keys/score_scale of the view (part, role): each layer's first call of its module."""
    qs, ks, scales = [], [], set()
    for layer in record.layers(role, part=part):
        module = record.select(part=part, role=role, layer=layer)[0].module
        if not neurons.get(module):
            return {}
        q, k, scale = neurons[module][0]
        qs.append(q[batch]), ks.append(k[batch]), scales.add(scale)
    q, k = torch.stack(qs), torch.stack(ks)
    if len(scales) != 1 or q.shape[:3] != shape[:3] or k.shape[2] != shape[3]:
        return {}                    # a cached or packed call: the weights' rows are not these queries
    return {"queries": q, "keys": k, "score_scale": scales.pop()}


@contextmanager
def record_queries_keys(model: nn.Module) -> Iterator[dict]:
    """Inside the block, every uncached, unpacked call of the model's attention modules adds
    (queries (B, H, T, D), keys (B, H, S, D), score scale) to ``found[module name]``: the
    projections after any rotary position, the keys repeated for grouped-query heads. They are
    projected again from the call's inputs (the module's own `_project` and position transform),
    so the forward and what it returns are untouched."""
    found: dict[str, list] = {}
    handles = []

    def hook(name):
        def grab(module, args, kwargs, output):
            query = args[0] if args else kwargs.get("query")
            if kwargs.get("cache") is not None or kwargs.get("packing") is not None or query is None:
                return
            key = args[1] if len(args) > 1 else kwargs.get("key")
            value = args[2] if len(args) > 2 else kwargs.get("value")
            key = query if key is None else key
            with torch.no_grad():
                q, k, _ = module._project(query, key, key if value is None else value, None)
                if module.position is not None:
                    B, T, S = query.size(0), query.size(1), key.size(1)
                    pos, kpos = module._positions(kwargs.get("positions"), kwargs.get("key_positions"),
                                                  B, T, S, 0, query.device)
                    q, k = module.position.transform(q, k, pos, kpos)
                k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)          # grouped-query heads
            scale = module.scale if module.scale is not None else q.size(-1) ** -0.5
            found.setdefault(name, []).append((q.detach().float().cpu(), k.detach().float().cpu(), float(scale)))
        return grab

    for name, module in model.named_modules():
        if isinstance(module, MultiHeadAttention):
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def _forward_recorded(model: nn.Module, *args) -> tuple[AttentionRecord, dict]:
    if not any(isinstance(m, MultiHeadAttention) for m in model.modules()):
        raise ValueError(f"viz: {type(model).__name__} has no attention layers to draw (it is built without "
                         f"attnlab's MultiHeadAttention, and none of its mixers reports a (T, T) map per head, "
                         f"which is drawn instead)")
    with record_attention(model) as record, record_queries_keys(model) as neurons:
        model(*args)
    return record, neurons


@torch.no_grad()
def implicit_views(model: nn.Module, ids: Sequence[int], labels: Sequence[str]) -> list[View]:
    """One "matrix" view of the magnitude of every mixer's map (attnlab.viz.implicit: a mixer that
    reports a (T, T) map per head, such as Mamba-2's and Mamba-3's implicit attention, whose entries
    can be negative, C · B being a dot product), titled as the mixers say."""
    model.eval()
    device = next(model.parameters()).device
    M, title = implicit_magnitudes(model, torch.tensor([list(ids)], device=device), title=True)
    return [View("layers/implicit", title, M[:, 0], list(labels), list(labels), kind="matrix")]


@torch.no_grad()
def text_views(model: nn.Module, ids: Sequence[int], labels: Sequence[str]) -> list[View]:
    """Views of one text through a model whose forward takes ``input_ids`` (B, T) alone: a causal
    or masked LM, an encoder, a classifier; a Mamba-2 or Mamba-3 gives its implicit attention
    (attnlab.viz.implicit) as a "matrix" view. ``labels``: one per token."""
    if len(ids) != len(labels):
        raise ValueError(f"viz: {len(ids)} token ids but {len(labels)} labels")
    if has_implicit_attention(model):
        return implicit_views(model, ids, labels)
    model.eval()
    device = next(model.parameters()).device
    record, neurons = _forward_recorded(model, torch.tensor([list(ids)], device=device))
    return record_views(record, labels, labels, neurons=neurons)


@torch.no_grad()
def seq2seq_views(model: nn.Module, src: Sequence[int], tgt: Sequence[int], src_labels: Sequence[str],
                  tgt_labels: Sequence[str]) -> list[View]:
    """Encoder self-, decoder self- and cross-attention of ``tgt`` (the decoder input, BOS first)
    given ``src``, for a model with ``encode(src)`` and ``decode(tgt, memory)``: the encoder and
    the decoder are recorded apart, so each view knows which sequence its rows are."""
    model.eval()
    device = next(model.parameters()).device
    s, t = torch.tensor([list(src)], device=device), torch.tensor([list(tgt)], device=device)
    with record_attention(model) as encoder, record_queries_keys(model) as enc_qk:
        memory = model.encode(s)
    with record_attention(model) as decoder, record_queries_keys(model) as dec_qk:
        model.decode(t, memory)
    return (record_views(encoder, src_labels, src_labels, neurons=enc_qk)
            + record_views(decoder, tgt_labels, tgt_labels, src_labels, neurons=dec_qk))
