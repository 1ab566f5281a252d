"""attnlab.tasks: one module per task (translate, lm, ...), each owning its options, data
preparation, model construction through the model registry, Trainer task, report and loading
a run for inference; :mod:`attnlab.tasks.run` is the run-metadata format they share.

Every module of this package is imported here, so that a task module registers itself by being
imported: a new task needs no line anywhere else.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import Option, Setup, TaskDefinition, get_task, register_task, registered_tasks
from .run import PathInfo, RunError, RunInfo, find_checkpoint, inspect_path, open_run, read_run

__all__ = ["Option", "Setup", "TaskDefinition", "get_task", "register_task", "registered_tasks", "PathInfo",
           "RunError", "RunInfo", "find_checkpoint", "inspect_path", "open_run", "read_run"]

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
