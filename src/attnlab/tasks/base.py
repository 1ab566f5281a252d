"""What a task is, the task registry, and the training options every task shares.

A task (translate, lm, and the ones the model families add) is one module that defines a
:class:`TaskDefinition` and registers it with :func:`register_task`. The definition owns:

- its options: a list of :class:`Option` (name, type, default, help), shown by
  ``attnlab train TASK --help`` and nothing else's; recipes and run directories store them
  under the same names. The model families add their own (``register_family(options=...)``,
  each naming the tasks it is for), shown under the family's name and refused with another
  family; a family's defaults for the task's options (``task_defaults``) fill what is not given;
- ``prepare(settings, resume_from)``: data, tokenizers and the model (built through the model
  registry), returned as a :class:`Setup` whose ``task`` is the Trainer's Task;
- ``train_config(settings, setup)``: the Trainer's settings with the task's defaults;
- ``report(run_dir, setup, settings)``: what is printed after training (test scores, a sample);
- ``load(run, device)``: a trained run, ready for inference;
- ``eval_options`` and ``evaluate_file(path, info, data, settings, device)``: what
  ``attnlab eval`` measures on a user's file for a model of this task's kind; its settings are
  typed too (:meth:`TaskDefinition.eval_settings`, an ``EvalSettings`` of the eval options).

Settings are the task's typed settings (:mod:`attnlab.tasks.settings`: one field per option,
each value validated as it is set, an unknown name refused), resolved by the train command from,
in increasing priority: the options' defaults, a recipe (``--config``), the configuration saved
in the run directory (``--resume``), and the flags given. The tasks read them as fields
(``s.d_model``); tests/test_settings.py fails on a field that is not an option of the task. The
checks across options run once (:meth:`TaskDefinition.check_once`), and the schedule is computed
once, in ``prepare`` (:attr:`Setup.schedule`). A default of None means "decided by the task from
the data" (:meth:`TaskDefinition.train_config` says how); an explicit value, 0 included, is
always used as given.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar

from .settings import EvalSettings, Settings

__all__ = ["Option", "TaskDefinition", "Setup", "register_task", "get_task", "registered_tasks", "TRAINING_OPTIONS",
           "positive", "non_negative", "fraction", "beyond_specials", "BUDGET_MEASURE", "BUDGET_STEP_CAP",
           "training_schedule", "family_recipe", "describe_training"]


@dataclass(frozen=True)
class Option:
    """One option of a task: ``--name-with-dashes`` on the command line, ``name`` in recipes.

    ``type`` is int, float, str or bool (bool: ``--flag`` / ``--no-flag``); ``check(value)``
    returns an error message or None; ``group`` titles the section of the help it is shown in.
    ``resumable``: the option may take another value when a run is resumed (how long to train,
    how often to evaluate and save, what is shown). Every other option shapes the model, its
    tokenizers, the data or the optimisation, and ``--resume`` refuses a value that differs
    from the one the run was started with, rather than ignoring it or damaging the run.
    """
    name: str
    type: type = str
    default: Any = None
    help: str = ""
    choices: tuple | None = None
    check: Callable[[Any], str | None] | None = None
    group: str = "options"
    metavar: str | None = None
    resumable: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def validate(self, value: Any) -> None:
        """ValueError naming the option if ``value`` is not acceptable (None always is)."""
        if value is None:
            return
        if self.type is bool and not isinstance(value, bool) or self.type is int and (
                isinstance(value, bool) or not isinstance(value, int)) or self.type is float and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)) \
                or self.type is str and not isinstance(value, str):
            raise ValueError(f"{self.flag}: expected {self.type.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{self.flag}: {value!r} is not one of {', '.join(map(str, self.choices))}")
        problem = self.check(value) if self.check else None
        if problem:
            raise ValueError(f"{self.flag}: {problem}, got {value!r}")


def positive(v) -> str | None:
    return None if v > 0 else "must be positive"


def non_negative(v) -> str | None:
    return None if v >= 0 else "must be >= 0"


def beyond_specials(v) -> str | None:
    return None if v > 4 else "must exceed the 4 special tokens"


def fraction(v) -> str | None:
    return None if 0 <= v < 1 else "must be in [0, 1)"


BUDGET_MEASURE = 20          # steps whose speed predicts how many fit in --time-budget
BUDGET_STEP_CAP = 1_000_000  # --time-budget without --steps: the budget, not this, ends training


# Adafactor's lr is a relative step (torch.optim.Adafactor moves a weight by at most lr x its RMS),
# AdamW's an absolute one, so a task whose own optimizer is AdamW, run with --optimizer adafactor and
# no --lr, takes its AdamW lr times this (about 1 / a typical weight RMS). Measured
# (benchmarks/README.md, "Adafactor on tasks sized for AdamW"): the best multiple was 10-15 for
# the 2017 Transformer, 20 for fine-tuning all-MiniLM-L6-v2, 50 or more for a small GPT; at 1 (the
# AdamW lr itself) Adafactor barely moved (lm perplexity 533 against AdamW's 55 after 300 steps).
ADAFACTOR_LR_SCALE = 15


def training_schedule(s: Settings, d: dict, warmup: Callable[[int, bool], int], eval_every: Callable[[int, bool], int],
                      budget_evals: int) -> dict:
    """The Trainer's length, lr, warmup and evaluation settings (a task's ``train_config`` base)
    from the settings ``s`` and the task's sizes ``d`` (its default ``steps`` and ``lr``); a
    flag given always wins. Without --steps, --time-budget sizes the schedule (``steps`` is then
    only a cap). ``warmup(steps, budget)`` and ``eval_every(steps, budget)`` give the task's
    defaults; ``budget_evals`` evaluations are spread over a budget-sized schedule unless
    --eval-every or --save-every is given. The optimizer (``d["optimizer"]``, default AdamW) and a
    weight decay in ``d`` (a family's recipe, :func:`family_recipe`) are passed on; --optimizer
    adafactor on a task sized for AdamW scales its lr by :data:`ADAFACTOR_LR_SCALE`."""
    budget = s.time_budget is not None and s.steps is None
    own = d.get("optimizer", "adamw")
    optimizer = {"optimizer": s.optimizer or own,
                 **({"weight_decay": d["weight_decay"]} if d.get("weight_decay") is not None else {})}
    lr = d["lr"]
    if optimizer["optimizer"] == "adafactor" and own != "adafactor":
        lr = d["lr"] * ADAFACTOR_LR_SCALE             # the task's AdamW step, made relative
    steps = s.steps if s.steps is not None else (BUDGET_STEP_CAP if budget else d["steps"])
    own_evals = s.eval_every is not None or s.save_every is not None
    return dict(steps=steps, lr=s.lr if s.lr is not None else lr,
                warmup_steps=s.warmup if s.warmup is not None else warmup(steps, budget),
                eval_every=s.eval_every if s.eval_every is not None else eval_every(steps, budget),
                budget_schedule=budget, budget_measure=BUDGET_MEASURE,
                budget_evals=0 if own_evals or not budget else budget_evals, **optimizer)


def family_recipe(s: Settings, model_type: str) -> dict:
    """The model family's own optimizer settings (``Family.training``: T5's Adafactor, its lr, no
    weight decay), for a task's sizes, unless ``--optimizer`` names another optimizer; then {}:
    the task's AdamW defaults stand. Flags given still win over what this returns."""
    from ..models.registry import family
    recipe = family(model_type).training
    return dict(recipe) if s.optimizer in (None, recipe.get("optimizer", "adamw")) else {}


def describe_training(s: Settings, t: dict) -> str:
    """The line ``attnlab train`` prints about the schedule, from the settings ``s`` and the task's
    ``train_config`` ``t``."""
    if t["budget_schedule"]:
        length = (f"as many steps as fit in the {s.time_budget:g}-minute budget at the speed of the last "
                  f"{t['budget_measure']} (planned again whenever it drifts), "
                  + (f"{t['budget_evals']} evaluations" if t["budget_evals"] else f"evaluation every {t['eval_every']}"))
    else:
        length = f"{t['steps']:,} steps, evaluation every {t['eval_every']}" + (
            f", at most {s.time_budget:g} minutes" if s.time_budget is not None else "")
    optimizer = "Adafactor (lr relative to each weight's RMS), " if t.get("optimizer") == "adafactor" else ""
    return (f"training: {optimizer}{s.schedule} schedule, lr {t['lr']:g}, warmup {t['warmup_steps']} steps, "
            f"{length}")


_T, _O = "training", "optimisation"
TRAINING_OPTIONS = [
    Option("data", str, None, "training data file (default: the task's embedded data set)", metavar="FILE", group=_T),
    Option("valid", str, None, "validation data file (default: held out from --data, or the embedded split)",
           metavar="FILE", group=_T),
    Option("out", str, None, "run directory for checkpoints and metrics (default runs/TASK)", metavar="DIR", group=_T,
           resumable=True),
    Option("steps", int, None, "optimizer steps (default: as many as fit in --time-budget if given, else the "
           "task's for its data)", check=positive, group=_T, resumable=True),
    Option("time_budget", float, None, "stop (with a checkpoint) after this many minutes; without --steps the "
           "learning-rate schedule is sized to end with it", check=positive,
           metavar="MIN", group=_T, resumable=True),
    Option("seed", int, 0, "seed of the initial weights, the data order and sampling", group=_T),
    Option("skip_malformed", bool, False, "skip and count malformed data lines instead of stopping", group=_T),
    Option("progress", bool, True, "show a progress bar", group=_T, resumable=True),
    Option("lr", float, None, "peak learning rate (default: the task's)", check=positive, group=_O),
    Option("schedule", str, "cosine", "learning-rate schedule", choices=("noam", "cosine", "constant"), group=_O),
    Option("warmup", int, None, "warmup steps (default: the task's for its data, at most a tenth of "
           "the steps)", check=non_negative, group=_O),
    Option("accum", int, 1, "micro-batches per optimizer step (on --resume under another number of processes: "
           "keep processes x --accum)", check=positive, group=_O, resumable=True),
    Option("clip", float, 1.0, "gradient-norm clipping (0 = off)", check=non_negative, group=_O),
    Option("weight_decay", float, None, "decoupled weight decay, never on norms, biases, embeddings (default: "
           "the model family's own, else 0.01)", check=non_negative, group=_O),
    Option("optimizer", str, None, "adamw, or adafactor (no momentum, steps relative to each weight's scale; "
           "--lr caps the relative step, default 15 x the task's AdamW lr, or the family's) (default: the model "
           "family's own, else adamw)",
           choices=("adamw", "adafactor"), group=_O),
    Option("beta2", float, None, "AdamW's second-moment decay (default: the task's)", check=fraction, group=_O),
    Option("precision", str, "auto", "arithmetic precision", choices=("auto", "fp32", "bf16", "fp16"), group=_O,
           resumable=True),
    Option("grad_checkpointing", bool, False, "recompute activations in the backward pass to save memory",
           group=_O, resumable=True),
    Option("shard", bool, False, "under torchrun, shard the weights, gradients and optimizer state over the "
           "processes (FSDP2) and save sharded checkpoints (docs/distributed.md)", group=_O, resumable=True),
    Option("eval_every", int, None, "steps between validations (default: the task's; 0 = only at the end)",
           check=non_negative, group=_O, resumable=True),
    Option("save_every", int, None, "steps between checkpoints (default: --eval-every; 0 = only at the end)",
           check=non_negative, group=_O, resumable=True),
]


@dataclass
class Setup:
    """What ``prepare`` returns: the Trainer's Task and what the report needs."""
    task: Any                                     # has .model, .plan, .loss, .evaluate, .save_assets
    description: list[str] = field(default_factory=list)   # lines printed before training
    extra: dict = field(default_factory=dict)     # anything the task's report uses (test pairs...)
    schedule: dict = field(default_factory=dict)  # training_schedule's result, computed once by prepare


class TaskDefinition:
    """Base of the task definitions (see the module docstring); one instance per task."""
    name: ClassVar[str]
    help: ClassVar[str]
    example: ClassVar[str]
    kind: ClassVar[str]                           # the model kind it trains, as the model registry says it
    options: ClassVar[list[Option]] = []
    eval_options: ClassVar[list[Option] | None] = None     # None: `attnlab eval` does not take this task
    data_paths: ClassVar[tuple[str, ...]] = ("file",)     # what --data / --valid name: "file", "directory"
                                                          # (a directory: its usual file names)
    data_help: ClassVar[str] = "a data file"              # what they hold, for messages

    def all_options(self) -> list[Option]:
        return [self._data_option(o) for o in TRAINING_OPTIONS] + self.options + self.family_options()

    def _data_option(self, o: Option) -> Option:
        """--data / --valid as this task reads them (a file, a directory, or either)."""
        if o.name not in ("data", "valid") or self.data_paths == ("file",):
            return o
        role = "training" if o.name == "data" else "validation"
        return replace(o, metavar="DIR" if self.data_paths == ("directory",) else "FILE|DIR",
                       help=f"{role} data: {self.data_help} {o.help[o.help.index('(default'):]}")

    # ------------------------------------------------------------------ what the model families add
    def _family_owners(self) -> dict[str, list]:
        """Option name -> [(family, FamilyOption)] of the registered families' options for this task."""
        from ..models.registry import families
        own = {o.name for o in TRAINING_OPTIONS + self.options}
        owners: dict[str, list] = {}
        for fam in families():
            for o in fam.options_for(self.name):
                if o.name in own:
                    raise ValueError(f"model family {fam.model_type!r}: its option {o.flag} is already an option of "
                                     f"'attnlab train {self.name}'")
                owners.setdefault(o.name, []).append((fam, o))
        return owners

    def family_options(self) -> list[Option]:
        """The registered families' options for this task, one :class:`Option` per name (families
        may share one), in a help group named after them. The default None stands for the family's
        own, which the help shows and :meth:`family_sizes` writes into the settings."""
        return [_merged_option(found) for found in self._family_owners().values()]

    def family_defaults_of(self, name: str) -> dict[str, Any]:
        """model_type -> the family's default for this task's option ``name`` (``task_defaults``)."""
        from ..models.registry import families
        return {f.model_type: f.task_defaults[self.name][name] for f in families()
                if name in f.task_defaults.get(self.name, {})}

    def model_family(self, settings: Settings) -> str | None:
        """The model_type of the family these settings build a model of (whose options apply), or
        None where the model comes from elsewhere (a pretrained checkpoint)."""
        return settings.model

    def model_in_use(self, settings: Settings) -> str:
        """The model the settings name, as an error message says it."""
        return f"--model {settings.model}"

    def apply_family_defaults(self, settings: Settings) -> None:
        """Fill the task's options that are not given with the model family's defaults for this
        task (``task_defaults``), before the task's own defaults; ValueError naming a bad one."""
        from ..models.registry import family
        name = self.model_family(settings)
        if name is None:
            return
        known = {o.name: o for o in self.options}
        for option, value in family(name).task_defaults.get(self.name, {}).items():
            if option not in known:
                raise ValueError(f"model family {name!r}: its task_defaults name {option!r}, which is not an option "
                                 f"of 'attnlab train {self.name}'")
            if settings[option] is None:
                known[option].validate(value)
                settings[option] = value

    def family_sizes(self, settings: Settings, tokenizer=None) -> dict:
        """The sizing builder's keywords that the model family states for this task: its options'
        values (one not given takes the family's default, written into ``settings`` so that
        config.yaml holds what was built) and, with ``tokenizer``, the special ids it takes."""
        from ..models.registry import family
        fam = family(self.model_family(settings))
        sizes = {} if tokenizer is None else fam.token_id_sizes(tokenizer)
        for o in fam.options_for(self.name):
            if settings[o.name] is None:
                settings[o.name] = fam.option_default(o)
            value = settings[o.name]
            problem = o.check(value) if value is not None and o.check else None
            if problem:
                raise ValueError(f"{o.flag}: {problem}, got {value!r}")
            sizes[o.keyword] = value
        return sizes

    def settings_class(self) -> type:
        """The task's typed settings (attnlab.tasks.settings): a dataclass of its options."""
        from .settings import settings_class
        return settings_class(self)

    def defaults(self):
        """Every option at its default, as the task's typed settings."""
        return self.settings_class()()

    def settings(self, **overrides):
        """The task's defaults with ``overrides``, each validated as it is set (an unknown name is a
        ValueError naming it): what ``prepare`` takes from Python."""
        return self.settings_class().from_dict(overrides)

    def eval_settings(self, **values):
        """The ``attnlab eval`` options (``eval_options``) at their defaults with ``values``, typed
        and each validated as it is set (an unknown name is a ValueError naming it): what
        ``evaluate_file`` takes."""
        from .settings import eval_settings_class
        return eval_settings_class(self).from_dict(values)

    def validate(self, settings: dict) -> None:
        known = {o.name: o for o in self.all_options()}
        for name, value in settings.items():
            if name not in known:
                raise ValueError(f"'{name}' is not an option of 'attnlab train {self.name}'")
            known[name].validate(value)

    def check(self, settings: Settings) -> None:
        """Checks across options of complete settings (the model family exists, an option applies
        to it), run before any data is read; ValueError naming the option. The base refuses a
        family's option given with a model of another family; tasks extend it."""
        using = self.model_family(settings)
        for name, found in self._family_owners().items():
            owners = [f.model_type for f, _ in found]
            if settings[name] is not None and using not in owners:
                raise ValueError(f"{found[0][1].flag} applies to --model {' or '.join(owners)}, not "
                                 f"{self.model_in_use(settings)}")

    def check_family_of_kind(self, settings: Settings) -> None:
        """For a task whose models are any registered family of its ``kind``: ``--model`` defaults to
        the kind's default family, and a name that is not one of them is refused naming those that are."""
        from ..models.registry import default_family, families
        known = [f.model_type for f in families(kind=self.kind)]
        settings.model = settings.model or default_family(self.kind)
        if settings.model not in known:
            raise ValueError(f"--model: {settings.model!r} is not a registered family of kind {self.kind} "
                             f"({', '.join(known) or 'none registered'})")

    def check_once(self, settings: Settings) -> None:
        """:meth:`check`, unless these settings passed it and no value changed since: the train
        command checks them before any data is read, and ``prepare`` (which Python callers call
        directly) then does not check them again."""
        if not settings.checked:
            self.check(settings)
            settings.mark_checked()

    def prepare(self, settings: Settings, resume_from: Path | None) -> Setup:
        raise NotImplementedError

    def train_config(self, settings: Settings, setup: Setup):
        raise NotImplementedError

    def report(self, run_dir: Path, setup: Setup, settings: Settings) -> None:
        """Print what the user should see after training (default: nothing)."""

    def load(self, run, device: str | None = None, dtype: str = "auto"):
        """The run's model for inference; ``dtype`` as ``--dtype`` (see attnlab.nn.prepare_for_inference)."""
        raise NotImplementedError

    def evaluate_file(self, path: str, info, data: str, settings: EvalSettings, device: str | None = None,
                      dtype: str = "auto") -> None:
        """Score the model at ``path`` (``info``: :func:`attnlab.tasks.inspect_path`'s) on ``data``
        and print the result; ``settings``: the ``eval_options`` as typed fields (:meth:`eval_settings`)."""
        raise NotImplementedError


def _merged_option(found: list) -> Option:
    """One task option for a family option that ``found`` families ([(family, FamilyOption)]) state."""
    first, names = found[0][1], [f.model_type for f, _ in found]
    if any(o.type is not first.type for _, o in found):
        raise ValueError(f"{first.flag}: the families {', '.join(names)} state it with different types")
    defaults = {f.model_type: f.option_default(o) for f, o in found}
    if len(set(map(repr, defaults.values()))) > 1:
        shown = " (default: " + ", ".join(f"{n} {v}" for n, v in defaults.items()) + ")"
    else:
        value = next(iter(defaults.values()))
        shown = "" if value is None else f" (default: {value})"
    same_check = all(o.check is first.check for _, o in found)     # else each family's own, when built
    return Option(first.name, first.type, None, first.help + shown, choices=first.choices,
                  check=first.check if same_check else None, group=f"--model {' or '.join(names)}",
                  metavar=first.metavar)


_TASKS: dict[str, TaskDefinition] = {}


def register_task(definition: TaskDefinition) -> TaskDefinition:
    """Make ``attnlab train NAME`` and the inference commands know a task."""
    names = {o.name for o in definition.all_options()}
    if len(names) != len(definition.all_options()):
        raise ValueError(f"task {definition.name!r}: an option name is used twice")
    _TASKS[definition.name] = definition
    return definition


def registered_tasks() -> dict[str, TaskDefinition]:
    """Every registered task; the task modules register themselves when the attnlab.tasks package
    is imported (which importing this module does first)."""
    return dict(_TASKS)


def get_task(name: str) -> TaskDefinition:
    tasks = registered_tasks()
    if name not in tasks:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(sorted(tasks))}")
    return tasks[name]
