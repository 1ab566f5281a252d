"""``attnlab train TASK``: one sub-command per registered task, each with only its own options.

The settings of a run come from, in increasing priority: the task's defaults, a recipe
(``--config NAME|FILE.yaml``), the configuration saved in the run directory (``--resume``), and
the flags given. The resolved settings are written to ``RUN_DIR/config.yaml`` before training,
and ``--resume`` starts from them, so a resumed run continues with what it was started with.

On ``--resume`` a flag (or recipe value) that differs from the saved settings is an error
naming the option and both values, unless the option is resumable (how long to train, how
often to evaluate and save, what is shown: :class:`attnlab.tasks.Option`'s ``resumable``):
the model, its tokenizers and the data come from the run, and a silently ignored flag, or a
vocabulary rebuilt from other data, would train something else than asked. The data files'
size and SHA-256 are saved beside the settings, so a data file changed in place is refused too.

One training at a time per directory: from its settings on, a run holds the lock of its
directory (:mod:`attnlab.train.lock`), and a second one into it is refused naming the holder.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:                       # the command's module loads no task until it runs
    from ..tasks.settings import Settings

HELP = "train a model on an embedded default data set or your own files"
EXAMPLE = ("attnlab train translate --steps 400 --out runs/numbers\n"
           "  attnlab train lm --config shakespeare-char --data input.txt --out runs/shakespeare\n"
           "  attnlab train TASK --help          (each task's own options)")
CONFIG_FILE = "config.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..recipes import named_recipes
    from ..tasks import registered_tasks
    sub = parser.add_subparsers(dest="task", metavar="TASK", title="tasks")
    recipes = ", ".join(sorted(named_recipes()))
    for name, task in registered_tasks().items():
        p = sub.add_parser(name, help=task.help, description=f"Train {task.help}.",
                           epilog=f"example:\n  {task.example}", formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", metavar="NAME|FILE.yaml", help=f"a recipe: one of the named recipes ({recipes}) "
                       "or a YAML file; flags given override it")
        p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint, "
                       "with the settings saved there")
        groups: dict[str, argparse._ArgumentGroup] = {}
        for o in task.all_options():             # a model family's own options under its name
            group = groups.get(o.group) or groups.setdefault(o.group, p.add_argument_group(o.group))
            default = "" if o.default is None else f" (default: {o.default})"
            by_family = task.family_defaults_of(o.name)
            if by_family:
                default += " (" + ", ".join(f"--model {f}: {v}" for f, v in by_family.items()) + ")"
            if o.type is bool:
                group.add_argument(o.flag, dest=o.name, action=argparse.BooleanOptionalAction, default=None,
                                   help=o.help + default)
            else:
                group.add_argument(o.flag, dest=o.name, type=o.type, default=None, choices=o.choices,
                                   metavar=o.metavar, help=o.help + default)


def _given(args: argparse.Namespace, task) -> dict:
    return {o.name: getattr(args, o.name) for o in task.all_options() if getattr(args, o.name) is not None}


def resolve_settings(task, args: argparse.Namespace) -> tuple[Settings, Path]:
    """The run's settings and directory (see the module docstring)."""
    from ..recipes import load_recipe
    settings = task.defaults()
    given = _given(args, task)
    recipe = None
    if args.config:
        recipe = load_recipe(args.config)
        if recipe.task != task.name:
            raise ValueError(f"--config {args.config}: a recipe for 'attnlab train {recipe.task}', not '{task.name}'")
        settings.merge(recipe.settings, where=f"--config {args.config}")
    out = Path(given.get("out") or settings.out or f"runs/{task.name}")
    saved_file = out / CONFIG_FILE
    if args.resume:
        saved, files = _read_saved(saved_file, task) if saved_file.is_file() else (None, {})
        if saved is None:
            from ..train.checkpoint import resolve_checkpoint
            if resolve_checkpoint(out) is None:
                raise ValueError(f"--resume: {out} holds no run to resume (no {CONFIG_FILE}, no checkpoint); "
                                 "leave out --resume to start a new run there")
        else:
            _refuse_changes(task, saved, given, recipe, args.config, saved_file)
            _check_files_unchanged(saved, files, saved_file)
            settings.merge(saved, where=str(saved_file))
    settings.merge(given)
    settings.out = str(out)
    if recipe is not None and recipe.requires_data and settings.data is None:
        raise ValueError(f"--config {args.config} trains on {recipe.requires_data}: give it with --data FILE")
    task.check_once(settings)
    return settings, out


def _same(option, a, b) -> bool:
    if option.name in ("data", "valid") and a is not None and b is not None:
        if os.path.isdir(a) and not os.path.isdir(b):   # a directory the run resolved to its split file b
            return os.path.abspath(a) == os.path.dirname(os.path.abspath(b))
        return os.path.abspath(a) == os.path.abspath(b)
    return a == b


def _refuse_changes(task, saved: dict, given: dict, recipe, config: str | None, saved_file: Path) -> None:
    """ValueError naming the first option whose given (or recipe) value differs from the saved one."""
    sources = [(given, "")] + ([(recipe.settings, f" (from --config {config})")] if recipe is not None else [])
    for values, source in sources:
        for o in task.all_options():
            if o.resumable or o.name not in values:
                continue
            before = saved.get(o.name, o.default)
            if not _same(o, values[o.name], before):
                raise ValueError(f"--resume: {o.flag} {values[o.name]}{source} differs from the run's {before} "
                                 f"({saved_file}); a resumed run keeps its model, tokenizers and data: leave "
                                 f"{o.flag} out, or start a new run with another --out")


def _hash_file(path: Path, digest) -> int:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return path.stat().st_size


def _fingerprint(path: str) -> dict:
    """The size and SHA-256 of a data file; of a data directory (an image folder), the number of
    files, their total size and one SHA-256 over every file's relative path and contents in sorted
    order, so that a file added, removed, renamed or edited changes it (hidden files are left out:
    no reader takes them)."""
    root, digest = Path(path), hashlib.sha256()
    if root.is_file():
        return {"bytes": _hash_file(root, digest), "sha256": digest.hexdigest()}
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    total = 0
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0")
        total += _hash_file(f, digest)
    return {"files": len(files), "bytes": total, "sha256": digest.hexdigest()}


def _data_files(settings: Settings) -> dict:
    return {k: _fingerprint(settings[k]) for k in ("data", "valid") if settings[k] and Path(settings[k]).exists()}


def _check_files_unchanged(saved: dict, files: dict, saved_file: Path) -> None:
    for key, was in files.items():
        path = saved.get(key)
        if path is None or not Path(path).exists():
            continue                                   # a missing file is reported with the other paths
        if _fingerprint(path) != was:
            what = "folder" if Path(path).is_dir() else "file"
            how = "its files, their sizes or contents" if what == "folder" else "its size and SHA-256"
            raise ValueError(f"--resume: --{key} {path} has changed since the run started ({how} differ from "
                             f"{saved_file}); the run's tokenizers and data position belong to the old {what}: "
                             "restore it, or start a new run with another --out")


def _read_saved(file: Path, task) -> tuple[dict, dict]:
    from ..recipes import read_yaml
    data = read_yaml(file, "run configuration")
    if not isinstance(data, dict) or not isinstance(data.get("settings"), dict):
        raise ValueError(f"{file}: not the configuration of an attnlab run (a 'task' and its 'settings')")
    if data.get("task") != task.name:
        raise ValueError(f"{file.parent}: holds an attnlab '{data.get('task')}' run; it cannot be resumed as "
                         f"'{task.name}'")
    settings = dict(data["settings"])
    for key, value in _BEFORE.items():      # what a run saved before an option existed trained with
        settings.setdefault(key, value)
    files = data.get("data_files") or {}
    return settings, files if isinstance(files, dict) else {}   # validated as they are merged, naming the file


# an option added since a run was saved, and the value the run trained with: runs from before
# --optimizer all trained with AdamW (not the None that now means "the model family's own")
_BEFORE = {"optimizer": "adamw"}


def _write_saved(out: Path, task, settings: Settings) -> None:
    from ..train.checkpoint import write_text_atomic
    out.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump({"task": task.name, "settings": settings.to_dict(), "data_files": _data_files(settings)},
                          sort_keys=True)
    write_text_atomic(out / CONFIG_FILE, f"# the resolved settings of this run (attnlab train {task.name})\n{text}")


def _check_paths(settings: Settings, task) -> None:
    for key in ("data", "valid"):
        path = settings[key]
        if path is None:
            continue
        if Path(path).is_dir() and "directory" not in task.data_paths:
            raise ValueError(f"--{key} {path}: a directory; give a file")
        if Path(path).is_file() and "file" not in task.data_paths:
            raise ValueError(f"--{key} {path}: a file; give a directory ({task.data_help})")
        if not Path(path).exists():
            raise FileNotFoundError(f"--{key} {path}: no such {' or '.join(task.data_paths)}")
        if not os.access(path, os.R_OK):
            raise PermissionError(f"--{key} {path}: not readable (permission denied)")
    out = Path(settings.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"--out {out}: {above} is a file, not a directory")


def run(args: argparse.Namespace) -> int:
    from ..tasks import get_task
    from ..train.lock import lock_run
    if not args.task:
        raise ValueError("name a task: attnlab train TASK (see attnlab train --help)")
    task = get_task(args.task)
    settings, out = resolve_settings(task, args)
    _check_paths(settings, task)
    # a second run into out is refused here, before it prepares data; under torchrun rank 0 alone holds the lock
    with lock_run(out) if int(os.environ.get("RANK", "0")) == 0 else contextlib.nullcontext():
        return _train(args, task, settings, out)


def _refuse_sharded_resume_alone(out: Path, accum: int) -> None:
    """A run saved with --shard, resumed in one process: --shard came from the saved settings, so
    the message names what the user can give (--no-shard, and the --accum that keeps the global
    batch), not "leave out --shard"."""
    import json
    from ..train.checkpoint import STATE_FILE, resolve_checkpoint
    ckpt = resolve_checkpoint(out)
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
        procs, accum = int(state["world_size"]), int(state["config"]["accum_steps"])
    except (AttributeError, OSError, ValueError, KeyError, TypeError):   # no checkpoint yet, or no such fields
        procs = None
    n = f"{procs}" if procs else "N"
    keep = f"--accum {procs * accum}" if procs else "--accum (the run's processes x its --accum)"
    raise ValueError(f"--resume: {out} was trained sharded (--shard) over {n} processes and this is one process: "
                     f"resume it under torchrun --nproc_per_node {n}, or here with --no-shard {keep} "
                     "(the same global batch)")


def _train(args: argparse.Namespace, task, settings: Settings, out: Path) -> int:
    from ..train import TrainConfig, Trainer
    from ..train.trainer import TrainingInterrupted
    print(f"preparing data ({settings.data or 'the embedded data set'}) ...", file=sys.stderr)
    setup = task.prepare(settings, out if args.resume else None)
    for line in setup.description:
        print(line, file=sys.stderr)
    own = task.train_config(settings, setup)
    eval_every = own.pop("eval_every")
    s = settings
    # the task's (its model family's) optimizer and weight decay unless given; saved resolved
    own["optimizer"] = s.optimizer = s.optimizer or own.get("optimizer", "adamw")
    decay = own.pop("weight_decay", 0.01)
    s.weight_decay = decay if s.weight_decay is None else s.weight_decay
    if args.resume and s.shard and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        _refuse_sharded_resume_alone(out, s.accum)
    config = TrainConfig(
        out_dir=out, weight_decay=s.weight_decay, schedule=s.schedule, clip_norm=s.clip or None,
        accum_steps=s.accum, precision=s.precision, grad_checkpointing=s.grad_checkpointing, shard=s.shard,
        eval_every=eval_every, save_every=s.save_every if s.save_every is not None else eval_every,
        seed=s.seed, progress=s.progress, time_budget_s=None if s.time_budget is None else
        s.time_budget * 60, **own)
    trainer = Trainer(setup.task, config, resume=args.resume)
    if trainer.env.is_main:
        print(f"precision: {trainer.precision} ({trainer.precision_reason})", file=sys.stderr)
    if trainer.env.is_main:
        _write_saved(out, task, settings)
    try:
        summary = trainer.fit()
    except TrainingInterrupted as e:                # the Trainer has saved and said where
        trainer.close()
        if trainer.env.is_main:
            print(f"attnlab train: interrupted; continue with: attnlab train {task.name} --out {out} --resume",
                  file=sys.stderr)
        return e.exit_code
    except BaseException:
        # leave the process group in order before the error is reported and the process ends: left to
        # the interpreter's exit, the group's teardown may find its peer gone and abort (SIGABRT) a rank
        # of a run whose every rank stops on the same error (a sharded checkpoint one rank cannot write)
        trainer.close()
        raise
    trainer.close()
    if trainer.env.is_main:
        task.report(out, setup, settings)
        print(f"metrics: {out}/metrics.jsonl, loss curve: {out}/loss.png, checkpoint: {summary['checkpoint']}")
    return 0
