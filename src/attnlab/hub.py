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
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .models.convert import (IDENTITY, TRANSPOSE, Fuse, ModelSpec, Op, PermuteRope, Rule, convert, permute_rope,
                             register_model, registered_model_types, spec_for, spec_for_type,
                             unpermute_rope)

__all__ = ["Op", "IDENTITY", "TRANSPOSE", "Fuse", "PermuteRope", "permute_rope", "unpermute_rope", "Rule",
           "ModelSpec", "register_model", "registered_model_types", "to_hf_state_dict", "from_hf_state_dict",
           "from_pretrained", "save_pretrained", "load_tokenizer"]


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
    spec = spec_for(model) if rules is None else None
    own, _ = _own_tensors(model)
    out, _, unmatched, missing = convert(own, list(rules or spec.weight_map), model.config, to_hf=True)
    if unmatched or missing:
        raise ValueError(f"{type(model).__name__}: the weight map does not cover "
                         f"{sorted(unmatched) + sorted(missing)}")
    return out


def from_hf_state_dict(model: nn.Module, hf: dict[str, Tensor], rules: list[Rule] | None = None,
                       ignore: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """Hugging Face tensors -> our state dict, strictly: raises ValueError listing unexpected
    checkpoint keys, missing ones (by their HF names) and shape mismatches."""
    spec = spec_for(model) if rules is None else None
    rules = list(rules or spec.weight_map)
    skip = [re.compile(p) for p in (ignore or (spec.ignore_on_load if spec else ()))]
    hf = {k: v for k, v in hf.items() if not any(p.search(k) for p in skip)}
    ours, sources, unmatched, incomplete = convert(hf, rules, model.config, to_hf=False)
    own, aliases = _own_tensors(model)
    unexpected = sorted(unmatched) + sorted(k for key in ours if key not in own and key not in aliases
                                            for k in sources[key])
    absent = {k: v for k, v in own.items() if k not in ours}
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
    spec = spec_for_type(hf_config.get("model_type"), str(path / "config.json"))
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
    spec = spec_for(model)
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
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:                     # tokenizers raises a bare Exception on a bad file
        raise ValueError(f"{file}: not a readable Hugging Face tokenizer.json: {e}{_attnlab_file_hint(file)}") from None


def _attnlab_file_hint(file: Path) -> str:
    """A pointer to the other loader when ``file`` is one of attnlab's own tokenizer files."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return ""
    if isinstance(data, dict) and "type" in data and "model" not in data:
        return " (this is an attnlab tokenizer file: load it with attnlab.tokenizer.load_tokenizer)"
    return ""
