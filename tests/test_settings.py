"""Typed settings per task (attnlab.tasks.settings): each task's settings are a dataclass of its
options, typed and validated as they are set, with a wrong key an error where the settings are
defined; they are saved to config.yaml as a plain mapping and restored from it unchanged."""
import dataclasses
import typing

import pytest
import yaml

from attnlab.tasks import get_task, registered_tasks
from attnlab.tasks.settings import Settings


@pytest.mark.parametrize("name", sorted(registered_tasks()))
def test_every_task_has_a_dataclass_of_its_options(name):
    task = get_task(name)
    s = task.defaults()
    assert isinstance(s, Settings) and dataclasses.is_dataclass(s)
    options = {o.name: o for o in task.all_options()}
    assert [f.name for f in dataclasses.fields(s)] == list(options)
    hints = typing.get_type_hints(type(s))
    assert all(hints[n] == (o.type | None) for n, o in options.items())
    assert s.to_dict() == {n: o.default for n, o in options.items()}
    assert task.settings_class() is type(s)              # made once per set of options


def test_a_wrong_key_is_an_error_where_the_settings_are_defined():
    image = get_task("image")
    with pytest.raises(ValueError, match=r"^'d_modle' is not an option of 'attnlab train image'$"):
        image.settings(d_modle=16)
    s = image.settings(d_model=16)
    with pytest.raises(KeyError, match="'d_modle' is not an option of 'attnlab train image'"):
        s["d_modle"] = 3
    with pytest.raises(KeyError):
        s["d_modle"]
    with pytest.raises(AttributeError, match="'d_modle' is not an option"):
        s.d_modle = 3
    assert s.get("d_modle") is None and "d_modle" not in s


def test_values_are_validated_as_they_are_set():
    s = get_task("image").settings()
    with pytest.raises(ValueError, match=r"^--heads: expected int, got 'x'$"):
        s.heads = "x"
    with pytest.raises(ValueError, match=r"^--channels: 2 is not one of 1, 3$"):
        s["channels"] = 2
    with pytest.raises(ValueError, match=r"^--label-fraction: must be in \(0, 1\]"):
        get_task("image").settings(label_fraction=0.0)
    s.update(heads=2, channels=1)
    assert (s.heads, s["channels"]) == (2, 1)
    with pytest.raises(TypeError, match="keep every option"):
        del s["heads"]


def test_settings_are_saved_and_restored_unchanged():
    mae = get_task("mae")
    s = mae.settings(mask_ratio=0.5, d_model=32, seed=3)
    text = yaml.safe_dump({"task": "mae", "settings": dict(s)})
    back = type(s).from_dict(yaml.safe_load(text)["settings"], where="config.yaml")
    assert back == s and back.to_dict() == s.to_dict() and back is not s
    with pytest.raises(ValueError, match=r"^config.yaml: --mask-ratio: must be in \[0, 1\), got 1.5$"):
        type(s).from_dict({"mask_ratio": 1.5}, where="config.yaml")
    with pytest.raises(ValueError, match=r"^config.yaml: 'old_option' is not an option of 'attnlab train mae'$"):
        type(s).from_dict({"old_option": 1}, where="config.yaml")


def test_the_mae_task_reads_its_settings_as_typed_fields():
    """attnlab.tasks.mae is written against the fields (s.mask_ratio), not string keys."""
    import re
    from pathlib import Path
    import attnlab.tasks.mae as module
    source = Path(module.__file__).read_text()
    assert not re.search(r"\bs\[['\"]", source)
    s = get_task("mae").settings()
    get_task("mae").check(s)
    assert (s.model, s.image_size, s.patch_size) == ("vit_mae", 8, 2)


# ----------------------------------------------------------------------------- the tasks' reads, checked statically
# A task's settings travel as a parameter annotated ``Settings`` or named ``s`` (the tasks' name for them);
# both are scanned, so a helper that takes ``s: dict`` and reads ``s["d_model"]`` is caught as well.
_SETTINGS_NAMES = {"s"}
_TYPED = {"Settings", "EvalSettings"}          # a task's settings; attnlab eval's (evaluate_file)
# what the task definitions' methods take the settings as (TaskDefinition's protocol), by argument position
_TASK_METHODS = {"check": 1, "check_once": 1, "prepare": 1, "train_config": 1, "report": 3, "model_family": 1,
                 "model_in_use": 1, "apply_family_defaults": 1, "family_sizes": 1}


def _annotation(arg) -> str | None:
    import ast
    return ast.unparse(arg.annotation) if arg.annotation is not None else None


def _settings_params(fn, annotation: str = "Settings") -> set[str]:
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return {a.arg for a in args if _annotation(a) == annotation
            or (a.arg in _SETTINGS_NAMES and _annotation(a) not in _TYPED - {annotation})}


def _settings_reads(source: str, filename: str = "<test>", annotation: str = "Settings") -> list[tuple[str, int, str, str]]:
    """(function, line, how, name) of every field or string-key read on a settings parameter (one
    annotated ``annotation``, or named ``s`` and not typed as other settings) in ``source``; ``how``
    is "field" or "key"."""
    import ast
    found = []
    for fn in ast.walk(ast.parse(source, filename)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = _settings_params(fn, annotation)
        names |= {node.targets[0].id for node in ast.walk(fn) if isinstance(node, ast.Assign) and names       # s = settings
                  and isinstance(node.value, ast.Name) and node.value.id in names and isinstance(node.targets[0], ast.Name)}
        for node in ast.walk(fn) if names else ():
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
                found.append((fn.name, node.lineno, "field", node.attr))
            elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in names \
                    and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                found.append((fn.name, node.lineno, "key", node.slice.value))
    return found


def _untyped(source: str, filename: str = "<test>") -> list[str]:
    """Every function of ``source`` that takes the settings untyped: a parameter named ``s`` not
    annotated ``Settings``, or a task method (:data:`_TASK_METHODS`) whose settings argument is not."""
    import ast
    found = []
    for fn in ast.walk(ast.parse(source, filename)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        at = _TASK_METHODS.get(fn.name)
        for i, a in enumerate(args):
            if (a.arg in _SETTINGS_NAMES or i == at and args[0].arg == "self") and _annotation(a) not in _TYPED:
                found.append((fn.lineno, f"line {fn.lineno}: {fn.name}({a.arg}: {_annotation(a)})"))
    return [text for _, text in sorted(found)]


def _task_modules():
    import importlib
    import pkgutil
    import attnlab.tasks as package
    tasks = registered_tasks().values()
    every = set().union(*({o.name for o in t.all_options()} for t in tasks))
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "settings":
            continue
        module = importlib.import_module(f"attnlab.tasks.{info.name}")
        own = [t for t in tasks if type(t).__module__ == module.__name__]
        # a module's helpers may take the settings of any task that uses them (image's for mae's)
        yield module, set().union(*({o.name for o in t.all_options()} for t in own)) if own else every


_MAPPING = {n for n in dir(Settings) if not n.startswith("_")}     # get, update, to_dict, merge, checked, ...


def _misread(module_source: str, options: set, annotation: str = "Settings") -> list[str]:
    return [f"line {line}: {fn}() reads {how} {name!r}"
            for fn, line, how, name in _settings_reads(module_source, annotation=annotation)
            if how == "key" or (name not in options and name not in _MAPPING)]


def test_the_tasks_read_their_settings_as_fields_and_only_their_options():
    """Every function of attnlab/tasks/ and the train command that takes the settings takes them
    typed (``s: Settings``; a task's check, prepare, train_config and report whatever the parameter's
    name), and every read of them is a field (``s.d_model``, no string key) named by an option of
    the module's task: a dict-taking task or a misspelt field fails here, not in a run."""
    import inspect
    from pathlib import Path
    import attnlab.cli.train as train_command
    from attnlab.tasks.base import TRAINING_OPTIONS
    scanned = 0
    # the train command reads only the options every task has
    modules = list(_task_modules()) + [(train_command, {o.name for o in TRAINING_OPTIONS})]
    for module, options in modules:
        source = Path(module.__file__).read_text()
        assert not _untyped(source), (module.__name__, _untyped(source))
        assert not _misread(source, options), (module.__name__, _misread(source, options))
        scanned += len(_settings_reads(source))
    assert scanned > 300                       # the scan sees the tasks' reads (about 370 of them)
    # and at run time, every registered task's methods, wherever they are defined
    for name, task in registered_tasks().items():
        for method, at in _TASK_METHODS.items():
            params = list(inspect.signature(getattr(task, method)).parameters.values())
            assert params[at - 1].annotation in ("Settings", Settings), (name, method, params[at - 1])


def test_the_scan_catches_a_misspelt_field_a_string_key_and_a_dict_taking_task():
    source = ("def prepare(self, s: Settings, resume_from):\n"
              "    width = s.d_modle\n"
              "    return s['heads'], s.get('layers'), s.to_dict()\n")
    assert _misread(source, {"d_model", "heads", "layers"}) == [
        "line 2: prepare() reads field 'd_modle'", "line 3: prepare() reads key 'heads'"]
    assert _untyped(source) == []
    # a task that takes a dict: its methods, its helpers and their string keys are all caught
    source = ("class Old(TaskDefinition):\n"
              "    def prepare(self, settings: dict, resume_from):\n"
              "        return self._data(settings)\n"
              "    def report(self, run_dir, setup, options):\n"
              "        pass\n"
              "def _data(s: dict):\n"
              "    return s['data'], f\"{s['seed']}\"\n")
    assert _untyped(source) == ["line 2: prepare(settings: dict)", "line 4: report(options: None)", "line 6: _data(s: dict)"]
    assert _misread(source, {"data", "seed"}) == ["line 7: _data() reads key 'data'", "line 7: _data() reads key 'seed'"]
    # at run time too: the settings refuse an attribute that is not an option
    s = get_task("lm").settings()
    with pytest.raises(AttributeError, match="'d_modle' is not an option of 'attnlab train lm'"):
        s.d_modle


def test_an_old_run_s_saved_settings_come_back_typed_and_checked_once(tmp_path):
    """config.yaml of a run saved before --optimizer existed: restored as the task's typed settings
    with what it trained with (AdamW), validated as merged (a bad value names the file), and
    checked by the train command so that prepare does not check them again."""
    import re
    from attnlab.cli import build_parser
    from attnlab.cli.train import resolve_settings
    task, out = get_task("translate"), tmp_path / "run"
    out.mkdir()
    args = build_parser().parse_args(["train", "translate", "--resume", "--out", str(out), "--steps", "4"])
    (out / "config.yaml").write_text(yaml.safe_dump({"task": "translate", "settings": {"d_model": 16, "steps": 2}}))
    s, _ = resolve_settings(task, args)
    assert type(s) is task.settings_class() and (s.optimizer, s.d_model, s.steps) == ("adamw", 16, 4)
    assert s.checked
    s.heads = s.heads                                    # the same value: still checked
    assert s.checked
    s.heads = 8                                          # a change: checked again by prepare's check_once
    assert not s.checked
    (out / "config.yaml").write_text(yaml.safe_dump({"task": "translate", "settings": {"d_model": -1}}))
    with pytest.raises(ValueError, match="^" + re.escape(f"{out / 'config.yaml'}: --d-model: must be positive, got -1")):
        resolve_settings(task, args)


# ----------------------------------------------------------------------------- attnlab eval's settings
def test_eval_options_are_typed_settings_with_a_wrong_key_an_error_naming_it():
    from attnlab.tasks.settings import EvalSettings
    for name, task in registered_tasks().items():
        if task.eval_options is None:
            continue
        s = task.eval_settings()
        assert isinstance(s, EvalSettings) and dataclasses.is_dataclass(s)
        assert s.to_dict() == {o.name: o.default for o in task.eval_options}
        with pytest.raises(ValueError, match=rf"^'limt' is not an option of 'attnlab eval' for a {name} run$"):
            task.eval_settings(limt=3)
    s = get_task("translate").eval_settings(beam=4, limit=10)
    assert (s.beam, s.limit, s.skip_malformed) == (4, 10, False)
    with pytest.raises(AttributeError, match="'beem' is not an option of 'attnlab eval' for a translate run"):
        s.beem
    with pytest.raises(ValueError, match=r"^--limit: must be positive, got 0$"):
        get_task("lm").eval_settings(limit=0)
    with pytest.raises(ValueError, match=r"^--quantize: 'int4' is not one of none, int8$"):
        get_task("lm").eval_settings(quantize="int4")


def test_evaluate_file_reads_only_its_eval_options_as_fields():
    """Every task's ``evaluate_file`` reads its ``EvalSettings`` as fields named by its own eval
    options: a misspelt one (or a string key) fails here."""
    import inspect
    from pathlib import Path
    scanned = 0
    for task in registered_tasks().values():
        if task.eval_options is None or "evaluate_file" not in type(task).__dict__:
            continue
        source = Path(inspect.getfile(type(task))).read_text()
        options = {o.name for o in task.eval_options}
        assert not _misread(source, options, "EvalSettings"), (task.name, _misread(source, options, "EvalSettings"))
        scanned += len(_settings_reads(source, annotation="EvalSettings"))
    assert scanned >= 15
    assert _misread("def evaluate_file(self, s: EvalSettings):\n    return s.limt, s['beam']\n", {"limit", "beam"},
                    "EvalSettings") == ["line 2: evaluate_file() reads field 'limt'", "line 2: evaluate_file() reads key 'beam'"]
