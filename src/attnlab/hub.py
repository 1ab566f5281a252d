"""Hugging Face directories in and out: ``from_pretrained``, ``save_pretrained``, ``load_tokenizer``.

Each model file registers itself with :func:`register_model`: its ``model_type`` (as in the
HF config.json), its config dataclass and model class, the two config translators, and a
declarative two-way **weight map**: a list of :class:`Rule` (our key template, HF key
template, :class:`Op`). This module knows no model by name; it only runs the maps.

Key templates name their variable parts in braces, ``"layers.{i}.self_attn.q_proj.{p}"``;
a field matches one dotted component. A field present only in our templates (``{e}``, the
expert index) is *stacked*: our tensors for e = 0, 1, ... become one HF tensor along dim 0
(Mixtral's fused experts), and back. An op turns our tensors (one per template of ``ours``)
into the HF tensors (one per template of ``theirs``) and has the exact inverse:

    IDENTITY       same tensor                      TRANSPOSE   w.T (GPT-2's Conv1D is (in, out))
    Fuse(dim, n)   cat along dim / chunk into n     PermuteRope(heads_attr)  q/k rows between
                                                    the interleaved and half-split RoPE layouts

Loading is strict: checkpoint keys no rule claims, model tensors no key provides and shape
mismatches raise one ValueError listing them (a model's declared ``ignore_on_load`` patterns,
non-persistent buffers such as GPT-2's ``attn.bias``, are skipped). Tied weights are stored
once: a tied output head is omitted on save and, if present in a checkpoint, ignored on load.
Weights are read from safetensors (single file or shards with an index) or from a
``pytorch_model.bin`` with ``torch.load(weights_only=True)``; they are written as safetensors.
"""
from __future__ import annotations

import json
import pickle
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "ModelSpec", "register_model", "registered_model_types", "to_hf_state_dict", "from_hf_state_dict",
           "from_pretrained", "save_pretrained", "load_tokenizer"]


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


def _convert(tensors: dict[str, Tensor], rules: list[Rule], config, to_hf: bool):
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
    from . import models  # noqa: F401  (importing the model files registers them)


def registered_model_types() -> list[str]:
    _load_registry()
    return sorted(_BY_TYPE)


def _spec_for(model: nn.Module) -> ModelSpec:
    _load_registry()
    spec = _BY_CLASS.get(type(model))
    if spec is None:
        raise ValueError(f"{type(model).__name__} is not registered for Hugging Face conversion; registered: "
                         f"{', '.join(sorted(c.__name__ for c in _BY_CLASS))}")
    return spec


# ----------------------------------------------------------------------------- state dicts
def _own_tensors(model: nn.Module) -> tuple[dict[str, Tensor], set[str]]:
    """The model's state dict without tied aliases, and the alias names."""
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unique = {n for n, _ in model.named_parameters()}
    aliases = every - unique
    return {k: v for k, v in model.state_dict().items() if k not in aliases}, aliases


def to_hf_state_dict(model: nn.Module, rules: list[Rule] | None = None) -> dict[str, Tensor]:
    """The model's weights under Hugging Face names (tied weights once). ``rules`` defaults to
    the model's registered weight map."""
    spec = _spec_for(model) if rules is None else None
    own, _ = _own_tensors(model)
    out, _, unmatched, missing = _convert(own, list(rules or spec.weight_map), model.config, to_hf=True)
    if unmatched or missing:
        raise ValueError(f"{type(model).__name__}: the weight map does not cover "
                         f"{sorted(unmatched) + sorted(missing)}")
    return out


def from_hf_state_dict(model: nn.Module, hf: dict[str, Tensor], rules: list[Rule] | None = None,
                       ignore: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Hugging Face tensors -> our state dict, strictly: raises ValueError listing unexpected
    checkpoint keys, missing ones (by their HF names) and shape mismatches."""
    spec = _spec_for(model) if rules is None else None
    rules = list(rules or spec.weight_map)
    skip = [re.compile(p) for p in (ignore or (spec.ignore_on_load if spec else ()))]
    hf = {k: v for k, v in hf.items() if not any(p.search(k) for p in skip)}
    ours, sources, unmatched, incomplete = _convert(hf, rules, model.config, to_hf=False)
    own, aliases = _own_tensors(model)
    unexpected = sorted(unmatched) + sorted(k for key in ours if key not in own and key not in aliases
                                            for k in sources[key])
    absent = {k: v for k, v in own.items() if k not in ours}
    absent_hf, _, unnamed, partial = _convert(absent, rules, model.config, to_hf=True) if absent else ({}, {}, [], [])
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
    return {k: v for k, v in ours.items() if k in own}


# ----------------------------------------------------------------------------- files
_SAFE, _SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def _read_shards(path: Path, index_file: str, read: Callable[[Path], dict]) -> dict[str, Tensor]:
    index = json.loads((path / index_file).read_text())
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{path / index_file}: no 'weight_map' object")
    tensors: dict[str, Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise ValueError(f"{path / index_file} names the shard {shard}, which is missing")
        tensors.update(read(path / shard))
    absent = sorted(set(weight_map) - set(tensors))
    if absent:
        raise ValueError(f"{path / index_file}: keys listed in the index are in no shard: {', '.join(absent)}")
    return tensors


def _read_bin(file: Path) -> dict[str, Tensor]:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{file}: not a plain tensor checkpoint; refusing to execute its pickled code "
                         f"({str(e).splitlines()[0]})") from None


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a HF directory: model.safetensors, sharded safetensors (index json),
    pytorch_model.bin (weights_only) or sharded .bin, in that order of preference."""
    path = Path(path)
    if (path / _SAFE).is_file():
        return load_file(path / _SAFE)
    if (path / _SAFE_INDEX).is_file():
        return _read_shards(path, _SAFE_INDEX, load_file)
    if (path / _BIN).is_file():
        return _read_bin(path / _BIN)
    if (path / _BIN_INDEX).is_file():
        return _read_shards(path, _BIN_INDEX, _read_bin)
    raise ValueError(f"{path}: no weights found (expected {_SAFE}, {_SAFE_INDEX} with its shards, {_BIN} "
                     f"or {_BIN_INDEX})")


def _dtype(value, hf_config: dict) -> torch.dtype | None:
    if value == "auto":
        value = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"from_pretrained: unknown dtype {value!r}")
    return dtype


def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None) -> nn.Module:
    """Load a Hugging Face model directory (config.json + weights) as the matching attnlab model.

    The model class is chosen by config.json's ``model_type``; weights are converted through the
    model's registered map, strictly (see :func:`from_hf_state_dict`). ``dtype``: None keeps
    float32, "auto" uses the config's dtype, or a torch dtype / its name. Returns the model in
    eval mode.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a Hugging Face model directory)")
    hf_config = json.loads((path / "config.json").read_text())
    _load_registry()
    model_type = hf_config.get("model_type")
    spec = _BY_TYPE.get(model_type)
    if spec is None:
        raise ValueError(f"{path / 'config.json'}: unsupported model_type {model_type!r}; supported: "
                         f"{', '.join(sorted(_BY_TYPE))}")
    config = spec.config_from_hf(hf_config)
    tensors = read_weights(path)
    if spec.base_prefix and not any(k.startswith(spec.base_prefix) for k in tensors):
        tensors = {spec.base_prefix + k: v for k, v in tensors.items()}
    model = spec.model_cls(config)
    state = from_hf_state_dict(model, tensors)
    model.load_state_dict(state, strict=False)       # completeness was checked above; tied aliases excluded
    target = _dtype(dtype, hf_config)
    if target is not None:
        model.to(target)
    return model.eval()


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    """Write ``path``/config.json and ``path``/model.safetensors, a directory that
    ``transformers.AutoModelForCausalLM.from_pretrained`` (and :func:`from_pretrained`) loads."""
    spec = _spec_for(model)
    tensors = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format)
               for k, v in to_hf_state_dict(model).items()}
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    config = dict(spec.config_to_hf(model.config), model_type=spec.model_type, architectures=[spec.architecture],
                  dtype=str(dtype).removeprefix("torch."))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / _SAFE), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def load_tokenizer(path: str | Path):
    """The ``tokenizers.Tokenizer`` of a Hugging Face model directory (its tokenizer.json)."""
    file = Path(path)
    file = file / "tokenizer.json" if file.is_dir() else file
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json (only the fast-tokenizer format is supported)")
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(file))
