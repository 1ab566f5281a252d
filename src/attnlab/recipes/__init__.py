"""Named training recipes (``attnlab train TASK --config NAME``) and recipe files.

A recipe is a small YAML file::

    task: lm                          # the task it trains
    description: one line for listings
    requires_data: what --data must be, if the recipe has no embedded data set (optional)
    settings:                         # option names of `attnlab train TASK` (dashes or underscores)
      d_model: 384
      ...

The named recipes ship in this package; any other ``FILE.yaml`` of the same form works too.
Flags given on the command line override a recipe's settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

__all__ = ["Recipe", "load_recipe", "named_recipes", "read_yaml"]

_KEYS = {"task", "description", "requires_data", "settings"}


@dataclass
class Recipe:
    name: str
    task: str
    settings: dict
    description: str = ""
    requires_data: str | None = None
    source: str = ""                       # where it was read from, for messages
    extra: dict = field(default_factory=dict)


def named_recipes() -> dict[str, Path]:
    """Name -> file of every recipe shipped with attnlab."""
    root = resources.files(__name__)
    return {Path(f.name).stem: Path(str(f)) for f in root.iterdir() if f.name.endswith(".yaml")}


def read_yaml(path: Path, what: str) -> object:
    """The YAML document in ``path``; ValueError naming the file when it cannot be read or parsed."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: not a readable {what} ({str(e).splitlines()[0]})") from None


def load_recipe(name_or_path: str) -> Recipe:
    """A shipped recipe by name, or a YAML file; ValueError naming the file and the problem."""
    path = Path(name_or_path)
    named = named_recipes()
    if not path.is_file():
        if name_or_path not in named:
            raise ValueError(f"--config: {name_or_path!r} is neither a file nor a named recipe "
                             f"({', '.join(sorted(named))})")
        path = named[name_or_path]
    data = read_yaml(path, "YAML recipe")
    if not isinstance(data, dict) or not isinstance(data.get("task"), str):
        raise ValueError(f"{path}: a recipe is a mapping with a 'task' name and 'settings'")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ValueError(f"{path}: unknown recipe keys {', '.join(unknown)} (allowed: {', '.join(sorted(_KEYS))})")
    settings = data.get("settings") or {}
    if not isinstance(settings, dict):
        raise ValueError(f"{path}: 'settings' must be a mapping of option names to values")
    settings = {str(k).replace("-", "_"): v for k, v in settings.items()}
    return Recipe(path.stem, data["task"], settings, data.get("description", ""), data.get("requires_data"),
                  str(path))
