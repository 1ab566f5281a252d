"""Declarative two-way weight maps: the rule machinery every model file uses.

A weight map is a list of :class:`Rule` (our key template, HF key template, :class:`Op`).
Ops have exact inverses: IDENTITY, TRANSPOSE, Fuse(dim, n or sizes=...), Split(dim, n or sizes=...),
PermuteRope(heads_attr).
:func:`to_hf_state_dict` / :func:`from_hf_state_dict` run a map over a model's tensors.
This module is a leaf (torch and the standard library only): it knows no model, no registry
and no file format, so every model file can import it without pulling anything else in.
"""
from __future__ import annotations

import re
import warnings
from functools import lru_cache
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "Split", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "with_prefix", "split_prefix", "convert", "own_tensors", "unread_tensors", "to_hf_state_dict",
           "from_hf_state_dict"]


# ----------------------------------------------------------------------------- tensor operations
def permute_rope(w: Tensor, heads: int) -> Tensor:
    """Rows of a q/k projection (or its bias), per head, from the interleaved RoPE layout (pairs
    (2i, 2i+1), Meta's original checkpoints) to the half-split one (pairs (i, i + D/2), Hugging
    Face). ``heads`` is the number of heads *of that projection*: the kv-head count for k under
    grouped-query attention (permuting with the query-head count scrambles k). w: (heads * D, ...) -> same shape."""
    rows = w.shape[0]
    if rows % heads or (rows // heads) % 2:
        raise ValueError(f"permute_rope: {rows} rows do not split into {heads} heads of even size")
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def unpermute_rope(w: Tensor, heads: int) -> Tensor:
    """The inverse of :func:`permute_rope`: half-split rows back to the interleaved layout."""
    rows = w.shape[0]
    if rows % heads or (rows // heads) % 2:
        raise ValueError(f"unpermute_rope: {rows} rows do not split into {heads} heads of even size")
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


class Op:
    """A named tensor operation from our tensors to HF tensors, with its inverse."""
    name = "op"

    def to_hf(self, tensors: list[Tensor], config: Any) -> list[Tensor]:
        raise NotImplementedError

    def from_hf(self, tensors: list[Tensor], config: Any) -> list[Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class _Identity(Op):
    name = "identity"

    def to_hf(self, tensors, config):
        return list(tensors)

    from_hf = to_hf


class _Transpose(Op):
    name = "transpose"

    def to_hf(self, tensors, config):
        return [t.t() for t in tensors]

    from_hf = to_hf


IDENTITY, TRANSPOSE = _Identity(), _Transpose()


class Fuse(Op):
    """n of our tensors <-> one HF tensor: ``cat(dim)`` one way, cut along ``dim`` the other.

    ``Fuse(dim, parts)`` cuts into ``parts`` equal pieces (a fused Q/K/V of three equal widths);
    ``Fuse(dim, sizes=(a, b, ...))`` into pieces of those sizes, each an int or the name of a config
    field or property (Mamba's ``x_proj``: Δ's rank, then B's and C's state widths; Mamba-2's
    ``in_proj``: z, x, B, C and Δ), so that one rule serves every size of a family. Both ways check
    the sizes, so each direction is the exact inverse of the other.
    """

    def __init__(self, dim: int, parts: int | None = None, *, sizes: tuple[int | str, ...] | None = None):
        if (parts is None) == (sizes is None):
            raise ValueError("Fuse: give the number of equal parts or their sizes, not both")
        if sizes is not None and (len(sizes) < 2 or not all(isinstance(n, (int, str)) for n in sizes)):
            raise ValueError(f"Fuse: sizes must be two or more ints or config field names, got {sizes!r}")
        self.dim, self.parts, self.sizes = dim, parts if sizes is None else len(sizes), sizes
        self.name = f"{self._kind}(dim={dim}, " + (f"parts={parts})" if sizes is None else f"sizes={tuple(sizes)})")

    _kind = "fuse"

    def _widths(self, total: int, shape, config) -> list[int]:
        """The pieces' sizes along ``dim`` of a fused tensor of ``total`` there (shape for the message)."""
        if self.sizes is None:
            if total % self.parts:
                raise ValueError(f"{self.name}: dim {self.dim} of shape {tuple(shape)} is not divisible by "
                                 f"{self.parts}")
            return [total // self.parts] * self.parts
        widths = [n if isinstance(n, int) else getattr(config, n) for n in self.sizes]
        if sum(widths) != total:
            raise ValueError(f"{self.name}: the sizes {widths} add up to {sum(widths)}, but dim {self.dim} of "
                             f"shape {tuple(shape)} has {total}")
        return widths

    def to_hf(self, tensors, config):
        if len(tensors) != self.parts:
            raise ValueError(f"{self.name}: expected {self.parts} tensors to fuse, got {len(tensors)}")
        given = [t.shape[self.dim] for t in tensors]
        want = self._widths(sum(given), tensors[0].shape, config)
        if given != want:                 # cut back, they would not come out as they went in
            raise ValueError(f"{self.name}: the tensors have sizes {given} along dim {self.dim}, the rule {want}")
        return [torch.cat(tensors, dim=self.dim)]

    def from_hf(self, tensors, config):
        (t,) = tensors
        return list(t.split(self._widths(t.shape[self.dim], t.shape, config), dim=self.dim))


class Split(Fuse):
    """One of our tensors <-> n HF tensors: :class:`Fuse` the other way round (our fused Q/K/V
    projection, HF BERT's separate query, key and value), with the same ``parts`` or ``sizes``."""

    _kind = "split"

    def to_hf(self, tensors, config):
        return super().from_hf(tensors, config)

    def from_hf(self, tensors, config):
        return super().to_hf(tensors, config)


class PermuteRope(Op):
    """q/k rows between our RoPE layout and Hugging Face's half-split one.

    ``heads_attr`` names the config field with the projection's head count ("num_heads" for q,
    "num_kv_heads" for k). A model whose ``config.rope_interleaved`` is False already uses the
    half-split layout, so this is the identity; otherwise :func:`permute_rope` on the way out
    and :func:`unpermute_rope` on the way in.
    """

    def __init__(self, heads_attr: str):
        self.heads_attr, self.name = heads_attr, f"permute_rope({heads_attr})"

    def _heads(self, config) -> int:
        return getattr(config, self.heads_attr)

    def to_hf(self, tensors, config):
        if not getattr(config, "rope_interleaved", False):
            return list(tensors)
        return [permute_rope(t, self._heads(config)) for t in tensors]

    def from_hf(self, tensors, config):
        if not getattr(config, "rope_interleaved", False):
            return list(tensors)
        return [unpermute_rope(t, self._heads(config)) for t in tensors]


# ----------------------------------------------------------------------------- rules
_FIELD = re.compile(r"\{(\w+)\}")


@lru_cache(maxsize=None)
def _compile(template: str) -> re.Pattern:
    parts = _FIELD.split(template)          # literal, field, literal, field, ...
    body = "".join(re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^.]+)" for i, p in enumerate(parts))
    return re.compile(f"^{body}$")


def _fields(template: str) -> set[str]:
    return set(_FIELD.findall(template))


@dataclass(frozen=True)
class Rule:
    """Our key templates <-> HF key templates through ``op`` (see the module docstring).

    ``ours`` / ``theirs``: one template or a tuple of them (``op`` maps the tuple of our tensors
    to the tuple of HF tensors). ``stack`` is the field only our side has, if any. ``when``: a
    predicate on the model's config; the rule applies only where it holds (one checkpoint name
    that means different modules in two variants of a family, such as T5's ``wo``, the output of
    its ReLU or of its gated feed-forward).
    """
    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    op: Op = IDENTITY
    when: Callable[[Any], bool] | None = None

    def __post_init__(self):
        ours = (self.ours,) if isinstance(self.ours, str) else tuple(self.ours)
        theirs = (self.theirs,) if isinstance(self.theirs, str) else tuple(self.theirs)
        mine, hers = _fields(ours[0]), _fields(theirs[0])
        if any(_fields(t) != mine for t in ours) or any(_fields(t) != hers for t in theirs):
            raise ValueError(f"Rule {ours} <-> {theirs}: templates on one side must share their fields")
        if not hers <= mine or len(mine - hers) > 1:
            raise ValueError(f"Rule {ours} <-> {theirs}: HF fields must be ours, with at most one stacked field")
        object.__setattr__(self, "ours", ours)
        object.__setattr__(self, "theirs", theirs)

    @property
    def stack(self) -> str | None:
        return next(iter(_fields(self.ours[0]) - _fields(self.theirs[0])), None)


def with_prefix(rules, prefix: str) -> list[Rule]:
    """The rules with ``prefix`` put before every HF template (a base model's keys as they sit
    inside a model with a head, e.g. "transformer." in GPT2LMHeadModel)."""
    return [replace(r, theirs=tuple(prefix + t for t in r.theirs)) for r in rules]


def split_prefix(rules, prefix: str) -> tuple[list[Rule], list[Rule]]:
    """(the rules whose HF templates all start with ``prefix``, with it removed: the base's
    rules; the other rules: the head's). The inverse of :func:`with_prefix` on a whole map."""
    base = [r for r in rules if all(t.startswith(prefix) for t in r.theirs)]
    head = [r for r in rules if not all(t.startswith(prefix) for t in r.theirs)]
    return [replace(r, theirs=tuple(t.removeprefix(prefix) for t in r.theirs)) for r in base], head


def convert(tensors: dict[str, Tensor], rules: list[Rule], config, to_hf: bool):
    """Run the rules one way. Returns (converted, sources: out key -> source keys, unmatched
    source keys, missing source keys of incomplete groups)."""
    rules = [r for r in rules if r.when is None or r.when(config)]
    groups: dict[tuple, dict[tuple, str]] = {}
    unmatched = []
    for key in tensors:
        for r, rule in enumerate(rules):
            src = rule.ours if to_hf else rule.theirs
            hit = next(((t, m) for t, tmpl in enumerate(src) if (m := _compile(tmpl).match(key))), None)
            if hit is not None:
                t, m = hit
                f = m.groupdict()
                shared = tuple(sorted((k, v) for k, v in f.items() if k != rule.stack))
                groups.setdefault((r, shared), {})[(t, f.get(rule.stack))] = key
                break
        else:
            unmatched.append(key)
    out, sources, missing = {}, {}, []
    for (r, shared), members in groups.items():
        rule, fields = rules[r], dict(shared)
        src, dst = (rule.ours, rule.theirs) if to_hf else (rule.theirs, rule.ours)
        stacked = to_hf and rule.stack is not None
        index = [str(s) for s in range(1 + max(int(s) for _, s in members))] if stacked else [None]
        absent = [src[t].format(**fields, **({rule.stack: s} if stacked else {}))
                  for t in range(len(src)) for s in index if (t, s) not in members]
        if absent:
            missing += absent
            continue
        inputs = [torch.stack([tensors[members[(t, s)]] for s in index]) if stacked else tensors[members[(t, None)]]
                  for t in range(len(src))]
        outputs = rule.op.to_hf(inputs, config) if to_hf else rule.op.from_hf(inputs, config)
        used = tuple(members.values())
        for tmpl, tensor in zip(dst, outputs):
            pieces = enumerate(tensor.unbind(0)) if (not to_hf and rule.stack) else [(None, tensor)]
            for s, piece in pieces:
                key = tmpl.format(**fields, **({rule.stack: s} if s is not None else {}))
                if key in out:        # two layouts of one tensor (say prefixed and bare): neither may win silently
                    raise ValueError(f"{key} is given twice, by {', '.join(sources[key])} and by {', '.join(used)}")
                out[key], sources[key] = piece, used
    return out, sources, unmatched, missing


# ----------------------------------------------------------------------------- state dicts
def warn_unread(model: nn.Module, names: list[str]) -> None:
    """Say which tensors a checkpoint lacked that no output reads (:func:`unread_tensors`)."""
    warnings.warn(f"{type(model).__name__}: the checkpoint has no {', '.join(names)}; no output of the model "
                  f"reads them, so they keep their initial values", stacklevel=5)


def own_tensors(model: nn.Module) -> tuple[dict[str, Tensor], set[str]]:
    """The model's state dict without tied aliases, and the alias names."""
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unique = {n for n, _ in model.named_parameters()}
    aliases = every - unique
    return {k: v for k, v in model.state_dict().items() if k not in aliases}, aliases


def unread_tensors(model: nn.Module) -> set[str]:
    """The state-dict keys of the tensors that no output of the model's forward reads, as the
    modules holding them declare in an ``unread_weights()`` method (names relative to the module;
    the bare encoders' kept pooler). A checkpoint may lack them: loading warns and keeps their
    initial values, as transformers does; every other tensor is required."""
    found = set()
    for prefix, module in model.named_modules():
        declare = getattr(module, "unread_weights", None)
        if callable(declare):
            found.update(f"{prefix}.{name}" if prefix else name for name in declare())
    return found


def to_hf_state_dict(model: nn.Module, rules: list[Rule]) -> dict[str, Tensor]:
    """The model's weights under the names ``rules`` give them (tied weights once)."""
    own, _ = own_tensors(model)
    out, _, unmatched, missing = convert(own, list(rules), model.config, to_hf=True)
    if unmatched or missing:
        raise ValueError(f"{type(model).__name__}: the weight map does not cover "
                         f"{sorted(unmatched) + sorted(missing)}")
    return out


def from_hf_state_dict(model: nn.Module, hf: dict[str, Tensor], rules: list[Rule],
                       ignore: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Checkpoint tensors -> our state dict, strictly: raises ValueError listing unexpected
    checkpoint keys, missing ones (by their checkpoint names) and shape mismatches. ``ignore``:
    regexes of checkpoint keys to skip (non-persistent buffers some writers store). Tensors of
    :func:`unread_tensors` may be missing: a warning names them and they are not returned."""
    rules = list(rules)
    skip = [re.compile(p) for p in ignore]
    hf = {k: v for k, v in hf.items() if not any(p.search(k) for p in skip)}
    ours, sources, unmatched, incomplete = convert(hf, rules, model.config, to_hf=False)
    own, aliases = own_tensors(model)
    unexpected = sorted(unmatched) + sorted(k for key in ours if key not in own and key not in aliases
                                            for k in sources[key])
    absent = {k: v for k, v in own.items() if k not in ours}
    unread = {k: absent.pop(k) for k in sorted(unread_tensors(model) & set(absent))}
    absent_hf, _, unnamed, partial = convert(absent, rules, model.config, to_hf=True) if absent else ({}, {}, [], [])
    missing = sorted(set(incomplete) | set(absent_hf) | set(unnamed) | set(partial))
    shapes = [f"{k}: checkpoint {tuple(ours[k].shape)} vs model {tuple(v.shape)}"
              for k, v in own.items() if k in ours and ours[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches: {'; '.join(shapes)}")
    if problems:
        raise ValueError(f"{type(model).__name__}: checkpoint does not match the model: " + "; ".join(problems))
    if unread:
        warn_unread(model, sorted(convert(unread, rules, model.config, to_hf=True)[0]) or sorted(unread))
    return {k: v for k, v in ours.items() if k in own}
