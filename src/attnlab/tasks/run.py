"""One run-metadata format for every task, and finding what a path on disk holds.

Every checkpoint directory the Trainer writes for a task holds, beside the Trainer's own
files (model.safetensors, optimizer.safetensors, trainer_state.json):

    run.json          {"format": 3, "task": "lm", "model_type": "gpt2", "architecture": "GPT2LMHeadModel",
                       "config": the model config's fields,
                       "processors": {"text": {"modality": "text", "file": "tokenizer.json"}},
                       "task_options": what the task needs to use the model (e.g. its context)}
    processor files   named in "processors", one per input role: a tokenizer (attnlab's JSON, any
                      kind of attnlab.tokenizer), an image processor or a feature extractor of sound
                      (preprocessor_config.json)

Format 2 named only tokenizers (``"tokenizers": {"text": "tokenizer.json"}``); its runs are read
as runs whose processors are those tokenizers, and resume as they are. The first format
(``lm.json`` / ``translation.json``, before run.json) is refused with a message saying so.

:func:`inspect_path` says what a path is (an attnlab run or checkpoint, a Hugging Face model
directory, or nothing attnlab reads), so that every command can dispatch on the recorded task
or architecture and name the command that takes a checkpoint of another kind.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from torch import Tensor, nn

from ..tokenizer import Tokenizer
from ..train.checkpoint import (BEST, OPTIMIZER_FILE, CheckpointDamaged, CheckpointWarning, resolve_best,
                                resolve_checkpoint, resolve_resume, verify_checkpoint)

__all__ = ["RUN_FILE", "FORMAT", "RunInfo", "PathInfo", "model_context", "write_run", "read_run", "find_checkpoint",
           "open_run",
           "resume_point", "inspect_path", "resolve_device", "build_model", "architecture_for", "load_model",
           "load_tokenizers", "load_processors",
           "RunError"]

RUN_FILE, FORMAT = "run.json", 3
PROCESSOR_MODALITIES = ("text", "image", "audio")     # attnlab.processors.PROCESSOR_FILES' keys
_READABLE = (2, 3)
_FORMAT_1_FILES = ("lm.json", "translation.json")


class RunError(ValueError):
    """A path that is not what a command needs; the message is one line for the user."""


@dataclass
class RunInfo:
    """The parsed run.json of one checkpoint directory."""
    path: Path                       # the checkpoint directory
    task: str
    model_type: str
    architecture: str
    config: dict
    processors: dict[str, dict]      # role -> {"modality": "text" | "image", "file": name inside ``path``}
    task_options: dict

    @property
    def tokenizers(self) -> dict[str, str]:
        """role -> tokenizer file, for the roles whose processor is a tokenizer."""
        return {role: p["file"] for role, p in self.processors.items() if p["modality"] == "text"}


def resolve_device(device=None):
    """The torch.device to run a model on: ``device`` (a name such as "cpu", "cuda:1" or a
    torch.device), checked, or CUDA when available, else the CPU. RunError naming the device
    for a name torch does not know or a device this machine lacks."""
    import torch
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise RunError(f"--device {device}: not a device name (cpu, cuda, cuda:1, mps, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RunError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RunError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise RunError(f"--device {device}: MPS is not available on this machine (use --device cpu)")
    elif dev.type not in ("cpu", "cuda", "mps", "meta") and not hasattr(torch, dev.type):
        raise RunError(f"--device {device}: not available in this PyTorch build")
    return dev


def build_model(model_type: str, config: dict, architecture: str | None = None) -> nn.Module:
    """A fresh model of a registered family and architecture (None: the family's default) from
    its config's fields."""
    from ..models.registry import family
    fam = family(model_type, "run.json")
    return fam.architecture(architecture or None, "run.json").build(fam.config_cls(**config))


def architecture_for(model_type: str | None, architectures: tuple[str, ...] | list[str], where: str):
    """The registered architecture a Hugging Face config.json names (its first "architectures"
    entry, else the family's default)."""
    from ..models.registry import family
    return family(model_type, where).architecture(architectures[0] if architectures else None, where)


def write_run(directory: Path, task: str, model: nn.Module, processors: dict,
              task_options: dict | None = None) -> None:
    """Write run.json and the processors (role -> a tokenizer or an image processor) into a
    checkpoint directory (a Task's ``save_assets``). A processor shared by several roles is written once."""
    from ..processors import PROCESSOR_FILES, save_processor
    directory = Path(directory)
    files: dict[str, dict] = {}
    written: dict[int, str] = {}
    for role, proc in processors.items():
        if id(proc) not in written:
            usual = PROCESSOR_FILES[proc.modality]
            taken = set(written.values())
            name = usual if usual not in taken else f"{role}_{usual}"
            written[id(proc)] = save_processor(proc, directory, name)
        files[role] = {"modality": proc.modality, "file": written[id(proc)]}
    from ..models.registry import architecture_of
    arch = architecture_of(model)
    model_type, architecture = arch.model_type, arch.name
    config = asdict(model.config) if is_dataclass(model.config) else dict(model.config)
    meta = {"format": FORMAT, "task": task, "model_type": model_type, "architecture": architecture,
            "config": config, "processors": files, "task_options": dict(task_options or {})}
    (directory / RUN_FILE).write_text(json.dumps(meta, indent=1))


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{file}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise RunError(f"{file}: expected a JSON object, found {type(data).__name__}")
    return data


def read_run(ckpt: str | Path) -> RunInfo:
    """The metadata of a checkpoint directory (run format 2 or 3); RunError if it has none."""
    ckpt = Path(ckpt)
    if not (ckpt / RUN_FILE).is_file():
        old = next((f for f in _FORMAT_1_FILES if (ckpt / f).is_file()), None)
        if old:
            raise RunError(f"{ckpt}: an attnlab run of the first format ({old}, before run.json), which this attnlab "
                           f"no longer reads (it reads run formats {' and '.join(map(str, _READABLE))}): train it again")
        raise RunError(f"{ckpt}: not an attnlab checkpoint (no {RUN_FILE})")
    m = _read_json(ckpt / RUN_FILE)
    if m.get("format") not in _READABLE:
        raise RunError(f"{ckpt / RUN_FILE}: run format {m.get('format')!r}; this attnlab reads run formats "
                       f"{' and '.join(map(str, _READABLE))}")
    roles = "processors" if m["format"] == 3 else "tokenizers"
    missing = [k for k in ("task", "model_type", "architecture", "config", roles) if k not in m]
    if missing:
        raise RunError(f"{ckpt / RUN_FILE}: missing {', '.join(missing)}")
    processors = m[roles] if m["format"] == 3 else {r: {"modality": "text", "file": f} for r, f in m[roles].items()}
    if not isinstance(processors, dict) or not all(
            isinstance(p, dict) and p.get("modality") in PROCESSOR_MODALITIES and isinstance(p.get("file"), str)
            for p in processors.values()):
        raise RunError(f"{ckpt / RUN_FILE}: '{roles}' must map each input role to its modality and file")
    return RunInfo(ckpt, m["task"], m["model_type"], m["architecture"], m["config"], processors,
                   m.get("task_options", {}))


def _has_meta(d: Path) -> bool:
    return (d / RUN_FILE).is_file() or any((d / f).is_file() for f in _FORMAT_1_FILES)


def _verified(ckpt: Path) -> Path:
    """``ckpt``, its files (all but the optimizer state, which inference does not read) checked
    against its manifest; RunError naming the damaged file."""
    try:
        verify_checkpoint(ckpt, skip=(OPTIMIZER_FILE,))
    except CheckpointDamaged as e:
        raise RunError(str(e)) from None
    return ckpt


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint a run directory stands for: the directory itself if it is one, else its
    best checkpoint (:func:`attnlab.train.checkpoint.resolve_best`), else the one its ``latest`` file
    names, else its newest other ``step-*``; None if there is none. Each is checked against its
    manifest: a checkpoint named directly must be intact (RunError), while a run directory whose
    best is damaged or missing gives the next intact one with a :class:`CheckpointWarning` saying
    which and why (RunError if none is intact)."""
    path = Path(path)
    if _has_meta(path):
        return _verified(path)
    order: list[Path | str] = []           # in the order of preference; a str says why one is unusable
    best = resolve_best(path)
    if best is not None:
        order.append(best)
    elif (path / BEST).is_symlink() or (path / BEST).exists():
        order.append(f"{path / BEST} names no complete checkpoint")
    try:
        order.append(resolve_checkpoint(path))
    except FileNotFoundError as e:
        order.append(str(e))
    order += sorted((p for p in path.glob("step-*") if p.is_dir()), reverse=True) if path.is_dir() else []
    problems, damaged = [], []
    for candidate in dict.fromkeys(c for c in order if c is not None):
        if isinstance(candidate, str):
            problems.append(candidate)
            continue
        if not _has_meta(candidate):
            continue
        try:
            _verified(candidate)
        except RunError as e:
            problems.append(str(e))
            damaged.append(str(e))
            continue
        if problems:
            warnings.warn(f"{'; '.join(problems)}; using {candidate} instead", CheckpointWarning)
        return candidate
    if damaged:
        raise RunError(f"{damaged[0]}; {path} holds no intact checkpoint")
    return None


def open_run(path: str | Path) -> RunInfo:
    """The run a path stands for (see :func:`find_checkpoint`); FileNotFoundError if none."""
    path = Path(path)
    if path.is_file() and path.suffix.lower() == ".gguf":      # a model, its tokenizer and chat template in one file
        from ..gguf import gguf_architecture
        model_type, architecture = gguf_architecture(path)
        return PathInfo("gguf", path, model_type=model_type, architectures=(architecture,))
    ckpt = find_checkpoint(path) if path.is_dir() else None
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint at {path}")
    return read_run(ckpt)


def resume_point(run_dir: str | Path, task: str) -> RunInfo | None:
    """The checkpoint ``--resume`` continues from (the one ``latest`` names, not best/), or None
    for a directory without one. RunError if it is another task's run or of the old format."""
    try:
        ckpt, _ = resolve_resume(run_dir)          # damaged checkpoints passed over: the Trainer says which
    except (FileNotFoundError, CheckpointDamaged) as e:
        raise RunError(str(e)) from None
    if ckpt is None:
        return None
    run = read_run(ckpt)
    if run.task != task:
        raise RunError(f"{run_dir}: holds an attnlab '{run.task}' run; it cannot be resumed as '{task}'")
    return run


@dataclass
class PathInfo:
    """What a path holds: an attnlab run ("run", with ``run``), a Hugging Face model directory
    ("huggingface", with its config.json's model_type and architectures) or a GGUF file ("gguf",
    the same two read off its metadata)."""
    kind: str
    path: Path
    run: RunInfo | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "run":
            return f"an attnlab '{self.run.task}' run ({self.run.model_type})"
        if self.kind == "gguf":
            return f"a GGUF {'/'.join(self.architectures) or self.model_type} file"
        return f"a Hugging Face {'/'.join(self.architectures) or self.model_type} directory"


def inspect_path(path: str | Path) -> PathInfo:
    """Classify ``path``; FileNotFoundError if it does not exist, RunError if attnlab reads nothing there."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if path.is_file() and path.suffix.lower() == ".gguf":      # a model, its tokenizer and chat template in one file
        from ..gguf import gguf_architecture
        model_type, architecture = gguf_architecture(path)
        return PathInfo("gguf", path, model_type=model_type, architectures=(architecture,))
    ckpt = find_checkpoint(path) if path.is_dir() else None
    if ckpt is not None:
        return PathInfo("run", path, run=read_run(ckpt))
    if path.is_dir() and (path / "config.json").is_file():
        config = _read_json(path / "config.json")
        archs = config.get("architectures") or []
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise RunError(f"{path / 'config.json'}: 'architectures' must be a list of class names")
        return PathInfo("huggingface", path, model_type=config.get("model_type"), architectures=tuple(archs))
    raise RunError(f"{path}: neither an attnlab run or checkpoint (no {RUN_FILE}) nor a Hugging Face model "
                   "directory (no config.json)")


def model_context(model: nn.Module) -> int | None:
    """The longest input a text model takes, as its family states it (its position table's
    length), None if it has no limit (relative positions)."""
    from ..models.registry import input_limits
    return input_limits(model)["context"]


def load_model(run: RunInfo) -> nn.Module:
    """The run's model with its trained weights (strict), in train mode on the CPU."""
    from safetensors.torch import load_file
    model = build_model(run.model_type, run.config, run.architecture)
    lora = run.task_options.get("lora")
    if lora:                                     # a LoRA run: its adapters go on before its weights load
        from ..adapters import add_lora
        add_lora(model, lora["target_modules"], int(lora["r"]), float(lora["lora_alpha"]),
                 float(lora.get("lora_dropout", 0.0)))
    file = run.path / "model.safetensors"
    if not file.is_file() and (run.path / "shards").is_dir():     # a sharded run's (--shard): gathered here
        from ..train.sharded import load_gathered
        _verified(run.path)
        load_gathered(run.path, model)
        return model
    if not file.is_file():
        raise RunError(f"{run.path}: no model.safetensors")
    _verified(run.path)                          # already hashed if find_checkpoint chose it: not again
    try:
        state = load_file(str(file))
    except Exception as e:                    # safetensors raises its own error types on a damaged file
        raise RunError(f"{file}: not a readable safetensors file ({e})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied: dict[int, set[str]] = {}               # a tied weight is stored under one of its names
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), set()).add(name)
    missing = [k for k in missing if not any(k in names and names & state.keys() for names in tied.values())]
    if missing or unexpected:
        raise RunError(f"{file}: weights do not match the recorded model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    return model


def load_processors(run: RunInfo, needs: dict[str, str] | None = None) -> dict:
    """The run's processors by role (tokenizers, image processors); a file shared by roles is loaded once.
    ``needs``: role -> what it is called ({"image": "image processor", "text": "tokenizer"}); a run that
    records none of some of them is refused naming them all (RunError)."""
    from ..processors import load_processor
    if needs and not set(needs) <= set(run.processors):
        raise RunError(f"{run.path}: the run records no {' and '.join(needs.values())}")
    loaded: dict[str, object] = {}
    out = {}
    for role, p in run.processors.items():
        if p["file"] not in loaded:
            try:
                loaded[p["file"]] = load_processor(run.path / p["file"], p["modality"])
            except FileNotFoundError:
                raise RunError(f"{run.path / p['file']}: the run's {role} processor is missing") from None
        out[role] = loaded[p["file"]]
    return out


def load_tokenizers(run: RunInfo) -> dict[str, Tokenizer]:
    """The run's tokenizers by role (its processors of text)."""
    return {role: proc for role, proc in load_processors(run).items() if proc.modality == "text"}
