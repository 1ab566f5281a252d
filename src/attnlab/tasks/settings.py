"""Typed settings of a task: one dataclass per task, made from its options (its own, the training
options every task shares, and the options the registered families add), so that a wrong key is an
error where the settings are defined, not a silent default where they are read.

    image = get_task("image")
    s = image.settings(d_model=16, heads=2)        # an ImageClassificationSettings
    s.d_model, s[name]                             # typed fields; the mapping view for a computed name
    image.settings(d_modle=16)                     # ValueError: 'd_modle' is not an option of ...
    s["d_modle"] = 16; s.d_modle                   # KeyError, AttributeError: the same line
    s.to_dict(), type(s).from_dict(saved)          # what config.yaml holds, and back
    image.eval_settings(limit=100)                 # an EvalSettings: the options of `attnlab eval`

The tasks read fields (``s.d_model``); tests/test_settings.py scans every function of attnlab/tasks
and the train command that takes a ``Settings`` and fails on a field that is not an option of its
task, so a misspelt name fails in the tests, not in a run. Every value is validated by its option
as it is set (its type, choices and check), so a settings object holds valid values only;
``task.check_once`` adds the checks across options, once: a settings object remembers that it
passed them until a value changes (:attr:`Settings.checked`). The class is made once per task and
set of options (a family registered later adds its options to a new class).

``attnlab eval`` takes a task's ``eval_options`` the same way: :func:`eval_settings_class` makes
an :class:`EvalSettings` dataclass of them, parsed and validated once by the eval command, and the
tasks' ``evaluate_file`` reads its fields (the same static scan checks them against
``eval_options``).
"""
from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import field, fields, make_dataclass
from typing import Any, ClassVar

__all__ = ["Settings", "EvalSettings", "settings_class", "eval_settings_class"]

_UNSET = object()


class Settings(MutableMapping):
    """The base of every task's settings class (module docstring): typed fields, one per option,
    and a mapping view with the options' names as its only keys."""

    __slots__ = ("_checked",)            # whether the task's checks passed since the last change
    options: ClassVar[dict] = {}          # name -> Option
    task: ClassVar[str] = ""
    command: ClassVar[str] = ""           # what takes these options, quoted, for the messages

    def _unknown(self, key) -> str:
        return f"'{key}' is not an option of {self.command}"

    def __getitem__(self, key: str) -> Any:
        if key not in self.options:
            raise KeyError(self._unknown(key))
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.options:
            raise KeyError(self._unknown(key))
        setattr(self, key, value)

    def __getattr__(self, key: str) -> Any:          # only for a name that is not a field
        raise AttributeError(self._unknown(key))

    def __setattr__(self, key: str, value: Any) -> None:
        option = self.options.get(key)
        if option is None:
            raise AttributeError(self._unknown(key))
        option.validate(value)
        if getattr(self, key, _UNSET) != value:
            object.__setattr__(self, "_checked", False)
        object.__setattr__(self, key, value)

    @property
    def checked(self) -> bool:
        """Whether the task's checks across options (``TaskDefinition.check_once``) passed on these
        values: any change of a value clears it."""
        return getattr(self, "_checked", False)

    def mark_checked(self) -> None:
        object.__setattr__(self, "_checked", True)

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"settings of {self.command} keep every option; set {key!r} to None instead")

    def __iter__(self):
        return iter(self.options)

    def __len__(self) -> int:
        return len(self.options)

    def __repr__(self) -> str:
        given = ", ".join(f"{k}={v!r}" for k, v in self.items() if v != self.options[k].default)
        return f"{type(self).__name__}({given})"

    def given_or(self, defaults: dict) -> dict:
        """``defaults`` (option name -> value) with each replaced by its option's value where that is
        given (not None); a key that is not an option is a KeyError naming it."""
        return {k: v if self[k] is None else self[k] for k, v in defaults.items()}

    def to_dict(self) -> dict:
        """Every option's value, by name: what a run's config.yaml holds."""
        return {k: getattr(self, k) for k in self.options}

    def copy(self) -> "Settings":
        return type(self).from_dict(self.to_dict())

    def merge(self, values: dict, where: str | None = None) -> "Settings":
        """Set ``values`` (option name -> value), each validated as it is set; ValueError in one line
        naming an unknown key or a bad value (``where``: the file they came from). Returns self."""
        for key, value in values.items():
            try:
                self[key] = value
            except (KeyError, ValueError) as e:
                message = e.args[0] if e.args else str(e)
                raise ValueError(f"{where}: {message}" if where else message) from None
        return self

    @classmethod
    def from_dict(cls, values: dict, where: str | None = None) -> "Settings":
        """The settings with ``values`` over the defaults (:meth:`merge`)."""
        return cls().merge(values, where)


class EvalSettings(Settings):
    """The base of a task's ``attnlab eval`` settings: one field per ``eval_options`` entry."""

    __slots__ = ()


def _annotation(option) -> Any:
    return option.type | None


_CLASSES: dict[tuple, type] = {}


def _dataclass_of(task, options: list, base: type[Settings], suffix: str, command: str) -> type[Settings]:
    """The dataclass (made once per task and set of options) with a field per option, over ``base``."""
    options = {o.name: o for o in options}
    key = (type(task), task.name, base, tuple((o.name, o.type, o.default) for o in options.values()))
    cls = _CLASSES.get(key)
    if cls is None:
        name = "".join(part.title() for part in task.name.replace("-", "_").split("_")) + suffix
        cls = make_dataclass(name, [(n, _annotation(o), field(default=o.default)) for n, o in options.items()],
                             bases=(base,), slots=True, eq=False, repr=False,
                             namespace={"options": options, "task": task.name, "command": command,
                                        "__module__": __name__})
        _CLASSES[key] = cls
    return cls


def settings_class(task) -> type[Settings]:
    """The settings dataclass of ``task`` (a TaskDefinition) for its options as registered now."""
    return _dataclass_of(task, task.all_options(), Settings, "Settings", f"'attnlab train {task.name}'")


def eval_settings_class(task) -> type[EvalSettings]:
    """The dataclass of ``task``'s ``attnlab eval`` options (ValueError if the task has none)."""
    if task.eval_options is None:
        raise ValueError(f"'attnlab eval' does not take a {task.name} run")
    return _dataclass_of(task, task.eval_options, EvalSettings, "EvalSettings",
                        f"'attnlab eval' for a {task.name} run")


def check_fields(cls: type[Settings]) -> None:
    """AssertionError unless ``cls``'s fields are exactly its options (the tests' contract)."""
    assert [f.name for f in fields(cls)] == list(cls.options), cls
