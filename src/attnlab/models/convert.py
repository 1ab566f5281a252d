"""Declarative two-way weight maps and the model registry (used by attnlab.hub).

Each model file registers itself here with :func:`register_model`: its Hugging Face
``model_type``, config dataclass, model class, the two config translators and a weight map,
a list of :class:`Rule` (our key template, HF key template, :class:`Op`). Ops have exact
inverses: IDENTITY, TRANSPOSE, Fuse(dim, n), PermuteRope(heads_attr). attnlab.hub runs the
maps on files; this module knows no file format, so models never import the hub.
"""
from __future__ import annotations

import re
from functools import lru_cache
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "ModelSpec", "register_model", "registered_model_types", "spec_for", "spec_for_type", "convert"]


# ----------------------------------------------------------------------------- tensor operations
def permute_rope(w: Tensor, heads: int) -> Tensor:
    """Rows of a q/k projection (or its bias), per head, from the interleaved RoPE layout (pairs
    (2i, 2i+1), Meta's original checkpoints) to the half-split one (pairs (i, i + D/2), Hugging
    Face). ``heads`` is the number of heads *of that projection*: the kv-head count for k under
    grouped-query attention (pitfall 7). w: (heads * D, ...) -> same shape."""
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
    """n of our tensors <-> one HF tensor: ``cat(dim)`` / ``chunk(n, dim)`` (equal parts)."""

    def __init__(self, dim: int, parts: int):
        self.dim, self.parts, self.name = dim, parts, f"fuse(dim={dim}, parts={parts})"

    def to_hf(self, tensors, config):
        return [torch.cat(tensors, dim=self.dim)]

    def from_hf(self, tensors, config):
        (t,) = tensors
        if t.shape[self.dim] % self.parts:
            raise ValueError(f"{self.name}: dim {self.dim} of shape {tuple(t.shape)} is not divisible by {self.parts}")
        return list(t.chunk(self.parts, dim=self.dim))


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
    to the tuple of HF tensors). ``stack`` is the field only our side has, if any.
    """
    ours: str | tuple[str, ...]
    theirs: str | tuple[str, ...]
    op: Op = IDENTITY

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


def convert(tensors: dict[str, Tensor], rules: list[Rule], config, to_hf: bool):
    """Run the rules one way. Returns (converted, sources: out key -> source keys, unmatched
    source keys, missing source keys of incomplete groups)."""
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
                out[key], sources[key] = piece, used
    return out, sources, unmatched, missing


# ----------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class ModelSpec:
    """One registered architecture (see :func:`register_model`)."""
    model_type: str
    config_cls: type
    model_cls: type
    config_from_hf: Callable[[dict], Any]
    config_to_hf: Callable[[Any], dict]
    weight_map: tuple[Rule, ...]
    architecture: str
    ignore_on_load: tuple[str, ...] = ()
    base_prefix: str | None = None


_BY_TYPE: dict[str, ModelSpec] = {}
_BY_CLASS: dict[type, ModelSpec] = {}


def register_model(model_type: str, config_cls: type, model_cls: type, config_from_hf: Callable[[dict], Any],
                   config_to_hf: Callable[[Any], dict], weight_map: list[Rule], *, architecture: str,
                   ignore_on_load: tuple[str, ...] = (), base_prefix: str | None = None) -> ModelSpec:
    """Make ``model_type`` loadable and ``model_cls`` savable.

    config_from_hf(HF config dict) -> config_cls instance; config_to_hf(config) -> HF config dict
    (model_type and architectures are added here); ``model_cls(config)`` builds the model.
    ``weight_map``: rules, tried in order (the first claiming a key wins, so a layout that only
    loading should accept comes after the one saving writes). ``architecture``: the HF class name
    written to config.json. ``ignore_on_load``: regexes of checkpoint keys to skip.
    ``base_prefix``: added to every checkpoint key when none has it (GPT-2 checkpoints saved from
    the bare ``GPT2Model`` lack "transformer.").
    """
    if isinstance(ignore_on_load, str):
        raise ValueError(f"register_model({model_type!r}): ignore_on_load must be a tuple of patterns, not a string")
    spec = ModelSpec(model_type, config_cls, model_cls, config_from_hf, config_to_hf, tuple(weight_map),
                     architecture, tuple(ignore_on_load), base_prefix)
    _BY_TYPE[model_type] = spec
    _BY_CLASS[model_cls] = spec
    return spec


def _load_registry() -> None:
    from . import gpt, llama, mixtral  # noqa: F401  (importing the model files registers them)


def registered_model_types() -> list[str]:
    _load_registry()
    return sorted(_BY_TYPE)


def spec_for_type(model_type: str | None, where: str = "config.json") -> ModelSpec:
    """The registered architecture for a Hugging Face ``model_type``; ValueError if none."""
    _load_registry()
    spec = _BY_TYPE.get(model_type)
    if spec is None:
        raise ValueError(f"{where}: unsupported model_type {model_type!r}; supported: {', '.join(sorted(_BY_TYPE))}")
    return spec


def spec_for(model: nn.Module) -> ModelSpec:
    _load_registry()
    spec = _BY_CLASS.get(type(model))
    if spec is None:
        raise ValueError(f"{type(model).__name__} is not registered for Hugging Face conversion; registered: "
                         f"{', '.join(sorted(c.__name__ for c in _BY_CLASS))}")
    return spec
