"""Model directories in and out: config.json plus weights, for every registered architecture.

``from_pretrained(dir)`` reads config.json's ``model_type`` (the family) and ``architectures``
(the model class; the family's default when absent) and converts the weights through that
architecture's rules; ``save_pretrained(model, dir)`` writes the model's own architecture.
A Hugging Face family's directory is one transformers loads; an attnlab-native family's holds
our config fields and state-dict keys. It lives in attnlab.models (attnlab.hub is its public
face) so that ``model.save_pretrained(dir)`` needs nothing above the models layer.

Loading is strict: checkpoint keys no rule claims, model tensors no key provides and shape
mismatches raise one ValueError listing them (an architecture's ``ignore_on_load`` patterns,
non-persistent buffers such as GPT-2's ``attn.bias``, are skipped). The one exception is what
the model declares that no output reads (:func:`attnlab.models.convert.unread_tensors`, the bare
encoders' kept pooler): a checkpoint without it loads with a warning naming it. Tied weights are stored
once: a tied output head is omitted on save and, if present in a checkpoint, ignored on load.
Weights are read from safetensors (single file or shards with an index) or from a
``pytorch_model.bin`` with ``torch.load(weights_only=True)``; they are written as safetensors.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save
from torch import Tensor, nn

from ..nn.linear import optimize_for_inference
from . import convert
from .registry import Architecture, architecture_of, family

__all__ = ["to_hf_state_dict", "from_hf_state_dict", "read_weights", "read_config", "from_pretrained",
           "save_pretrained", "SavePretrained"]


# ----------------------------------------------------------------------------- state dicts
def to_hf_state_dict(model: nn.Module, rules=None) -> dict[str, Tensor]:
    """The model's weights under its architecture's checkpoint names (tied weights once).
    ``rules`` overrides the registered weight map."""
    rules = architecture_of(model).weight_map if rules is None else rules
    if rules is None:                             # native: our own keys
        own, _ = convert.own_tensors(model)
        return own
    return convert.to_hf_state_dict(model, rules)


def from_hf_state_dict(model: nn.Module, tensors: dict[str, Tensor], rules=None,
                       ignore: tuple[str, ...] | None = None) -> dict[str, Tensor]:
    """Checkpoint tensors -> our state dict, strictly (see the module docstring). ``rules``
    default to the model's registered architecture's loading rules, its key names
    (:meth:`~attnlab.models.registry.Architecture.checkpoint_keys`) and then ``ignore`` to its
    skipped keys; explicit rules take the keys as they are and skip nothing unless told."""
    arch = architecture_of(model) if rules is None else None
    rules = arch.load_rules if arch is not None else rules
    if arch is not None:
        tensors = arch.checkpoint_keys(tensors)
    if ignore is None:
        ignore = arch.skip_on_load if arch is not None else ()
    if rules is None:
        return _native_state_dict(model, tensors)
    return convert.from_hf_state_dict(model, tensors, rules, ignore)


def _native_state_dict(model: nn.Module, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    own, aliases = convert.own_tensors(model)
    given = {k: v for k, v in tensors.items() if k not in aliases}
    unread = sorted(convert.unread_tensors(model) & (set(own) - set(given)))
    problems = []
    if missing := sorted(set(own) - set(given) - set(unread)):
        problems.append(f"missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected := sorted(set(given) - set(own)):
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    if shapes := [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in given.items() if k in own and v.shape != own[k].shape]:
        problems.append(f"shape mismatches: {'; '.join(shapes)}")
    if problems:
        raise ValueError(f"{type(model).__name__}: checkpoint does not match the model: " + "; ".join(problems))
    if unread:
        convert.warn_unread(model, unread)
    return given


# ----------------------------------------------------------------------------- files
_SAFE, _SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def _read_json(file: Path) -> dict:
    """A JSON object from ``file``; ValueError naming the file otherwise."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def _read_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(file)
    except OSError:
        raise
    except Exception as e:                  # safetensors' own error types do not name the file
        raise ValueError(f"{file}: not a readable safetensors file, truncated or damaged "
                         f"({(str(e).splitlines() or [''])[0]})") from None


def _read_shards(path: Path, index_file: str, read: Callable[[Path], dict]) -> dict[str, Tensor]:
    index = _read_json(path / index_file)
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
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{file}: not a plain tensor checkpoint; refusing to execute its pickled code "
                         f"({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError) as e:
        raise ValueError(f"{file}: not a readable PyTorch checkpoint, truncated or damaged "
                         f"({(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in data.items()):
        raise ValueError(f"{file}: expected a dict of tensor names to tensors, found {type(data).__name__}")
    return data


def read_weights(path: str | Path) -> dict[str, Tensor]:
    """All tensors of a model directory: model.safetensors, sharded safetensors (index json),
    pytorch_model.bin (weights_only) or sharded .bin, in that order of preference."""
    path = Path(path)
    if (path / _SAFE).is_file():
        return _read_safetensors(path / _SAFE)
    if (path / _SAFE_INDEX).is_file():
        return _read_shards(path, _SAFE_INDEX, _read_safetensors)
    if (path / _BIN).is_file():
        return _read_bin(path / _BIN)
    if (path / _BIN_INDEX).is_file():
        return _read_shards(path, _BIN_INDEX, _read_bin)
    raise ValueError(f"{path}: no weights found (expected {_SAFE}, {_SAFE_INDEX} with its shards, {_BIN} "
                     f"or {_BIN_INDEX})")


def read_config(path: str | Path) -> tuple[Architecture, object, dict]:
    """(architecture, our config, the raw config.json dict) of a model directory."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no config.json (not a model directory)")
    raw = _read_json(file)
    fam = family(raw.get("model_type"), str(file))
    names = raw.get("architectures") or [None]
    if not isinstance(names, list):
        raise ValueError(f"{file}: 'architectures' must be a list of class names, got {names!r}")
    arch = fam.architecture(names[0], str(file))
    return arch, fam.config_from_json(raw, str(file)), raw


def _dtype(value, raw: dict) -> torch.dtype | None:
    if value == "auto":
        value = raw.get("dtype") or raw.get("torch_dtype")
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"from_pretrained: unknown dtype {value!r}")
    return dtype


def from_pretrained(path: str | Path, dtype: torch.dtype | str | None = None) -> nn.Module:
    """Load a model directory (config.json + weights) as the attnlab model of its architecture.

    ``dtype``: None keeps float32, "auto" uses the config's dtype, or a torch dtype / its name.
    Returns the model in eval mode, ready for fast inference: its ``nn.Linear`` layers are
    :class:`attnlab.nn.InferenceLinear` (:func:`attnlab.nn.optimize_for_inference`), which share
    the same parameters and state-dict keys, run oneDNN's faster matmul for large fp32 weights
    when no gradient is needed, and are exactly ``nn.Linear`` whenever one is: ``model.train()``
    trains as a model built from its config would.
    """
    arch, config, raw = read_config(path)
    tensors = read_weights(path)
    model = arch.build(config)
    state = from_hf_state_dict(model, tensors)       # the architecture's rules, skips and key names
    model.load_state_dict(state, strict=False)       # completeness was checked above; tied aliases excluded
    target = _dtype(dtype, raw)
    if target is not None:
        model.to(target)
    return optimize_for_inference(model).eval()


def save_pretrained(model: nn.Module, path: str | Path) -> Path:
    """Write ``path``/config.json and ``path``/model.safetensors for the model's architecture: for a
    Hugging Face family, a directory transformers' class of that name loads."""
    arch = architecture_of(model)
    tensors = {k: v.detach().to("cpu").clone(memory_format=torch.contiguous_format)
               for k, v in to_hf_state_dict(model).items()}
    dtype = next((t.dtype for t in tensors.values() if t.is_floating_point()), torch.float32)
    config = dict(arch.family.config_to_json(model.config), model_type=arch.model_type, architectures=[arch.name],
                  dtype=str(dtype).removeprefix("torch."))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # through open(), not save_file (which creates the file mode 0600): weights readable like config.json
    (path / _SAFE).write_bytes(save(tensors, metadata={"format": "pt"}))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


class SavePretrained:
    """``model.save_pretrained(dir)``, as transformers' models have it, for every model class: the
    base every registered model class lists beside ``nn.Module``, so that a model file knows
    nothing of directories and file formats (:func:`save_pretrained` does that, through the
    registry)."""

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``path``/config.json and ``path``/model.safetensors (see :func:`save_pretrained`);
        returns ``path``."""
        return save_pretrained(self, path)

    def input_limits(self) -> dict:
        """What inputs this model takes, as its family states them, once (``register_family(limits=)``,
        :meth:`attnlab.models.registry.Family.input_limits`): what generation and the commands check."""
        return architecture_of(self).family.input_limits(self.config)
