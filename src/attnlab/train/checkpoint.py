"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of a run directory (``TrainConfig.out_dir``)::

    latest                  text file: the name of the newest complete checkpoint
    step-0000100/           one checkpoint (the last ``keep_last`` are kept)
        model.safetensors       weights; tied tensors stored once (pitfall 21)
        optimizer.safetensors   every optimizer state tensor, key "state.<param index>.<name>"
        trainer_state.json      step, epoch, position in the epoch, scheduler, optimizer
                                param groups, RNG states, GradScaler, best metric, config,
                                metrics so far
        ...                     the task's assets (tokenizers), see Task.save_assets
    best -> best-0000080    a symbolic link to a copy (hard links, no extra space) of the
    best-0000080/           checkpoint with the best validation metric (on a file system
                            without symbolic links, ``best`` is a text file naming it)
    metrics.jsonl, loss.png written by the Trainer

Atomicity: a kill at any instant leaves every pointer naming a complete checkpoint, and a
restart (a new :class:`CheckpointManager`) removes only what no pointer names.

- A checkpoint is written into a hidden sibling ``.tmp-step-...``, every file and the
  directory are fsynced, and the directory is renamed into place; only then is ``latest``
  replaced (write ``.latest.tmp``, fsync, ``os.replace``).
- ``best`` is never replaced by two renames (old away, new in: between them there is no
  best/ at all, and a restart that sweeps temporaries loses it for good). The new best is
  copied to a versioned directory ``best-STEP`` under a temporary name and renamed into
  place, then the link ``best`` is replaced in one ``os.replace`` of a link made under a
  temporary name; the older ``best-*`` directory is removed after that. A run written by an
  older attnlab, whose ``best/`` is a real directory, is converted the same way (its
  directory renamed to a versioned name first; a restart re-creates a missing link from the
  newest ``best-*``).

Files get the permissions of any new file (``0666`` less the umask, as ``open`` gives),
weights included. Loading reads safetensors and JSON only; no pickle is executed anywhere.
"""
from __future__ import annotations

import base64
import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from torch.optim import Optimizer

__all__ = ["CheckpointManager", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "capture_rng_state",
           "restore_rng_state", "resolve_best", "optimizer_state_to_flat", "optimizer_state_from_flat", "FORMAT_VERSION"]

FORMAT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, LATEST, BEST = ("model.safetensors", "optimizer.safetensors",
                                                        "trainer_state.json", "latest", "best")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_BEST_DIR = re.compile(r"^best-(\d+)$")


# ----------------------------------------------------------------------------- RNG state
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict:
    """Python ``random``, NumPy's global generator, torch CPU and the current CUDA device's
    generator (the process's training device), as JSON."""
    version, internal, gauss = random.getstate()
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss],
             "numpy": [kind, key.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": _b64(torch.get_rng_state()), "cuda": []}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # this process's device only
        state["cuda"] = [_b64(torch.cuda.get_rng_state())]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, key, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(_unb64(state["cuda"][0]))


# ----------------------------------------------------------------------------- optimizer state
def optimizer_state_to_flat(optimizer: Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split ``optimizer.state_dict()`` into tensors ("state.<i>.<name>") and a JSON part."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, slots in sd["state"].items():
        for name, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_state_from_flat(optimizer: Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Load what :func:`optimizer_state_to_flat` produced into ``optimizer``."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, slots in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(slots)
    current = optimizer.param_groups
    if len(current) != len(meta["param_groups"]):
        raise ValueError(f"checkpoint has {len(meta['param_groups'])} optimizer param groups, "
                         f"the optimizer has {len(current)}")
    groups = []
    for saved, now in zip(meta["param_groups"], current):  # JSON turned tuples (betas) into lists
        groups.append({k: (tuple(v) if isinstance(now.get(k), tuple) else v) for k, v in saved.items()})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ----------------------------------------------------------------------------- atomic files
def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


def _file_mode() -> int:
    """The mode ``open`` gives a new file: 0666 less the process's umask (read without changing it
    where Linux exposes it, else by setting and restoring it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _as_new_file(path: Path) -> None:
    """safetensors writes weights mode 0600; give them the mode of every other file written
    (a colleague reading a shared run must be able to read its weights as well as its JSON)."""
    os.chmod(path, _file_mode())


def _rename_into_place(tmp: Path, final: Path) -> None:
    """Rename the complete directory ``tmp`` to the new name ``final`` (which must not exist:
    directories are never replaced, pointers are)."""
    os.rename(tmp, final)
    _fsync_path(final.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers see the old or the new content, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _point_link(link: Path, target_name: str) -> None:
    """Make ``link`` name the sibling ``target_name`` in one ``os.replace``: a symbolic link, or
    on a file system without them a one-line text file (loaders follow either)."""
    tmp = link.with_name(f".{link.name}.tmp-link")
    if tmp.is_symlink() or tmp.exists():
        os.unlink(tmp)
    try:
        os.symlink(target_name, tmp)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
            raise
        with open(tmp, "w") as f:
            f.write(target_name + "\n")
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, link)
    _fsync_path(link.parent)


def _pointed(link: Path) -> str | None:
    """The name ``link`` (see :func:`_point_link`) points at; None if it is not a pointer."""
    if link.is_symlink():
        return os.readlink(link)
    if link.is_file():
        return link.read_text().strip() or None
    return None


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer | None, state: dict,
                    assets: Callable[[Path], None] | None = None) -> Path:
    """Write one checkpoint directory atomically (see the module docstring); returns ``path``.

    ``model`` must be the plain module (not a DDP wrapper). ``state`` must be JSON-serialisable;
    the optimizer's param groups and non-tensor state are added under "optimizer".
    ``assets(directory)`` may write extra files (tokenizers) into the checkpoint.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = dict(state, format=FORMAT_VERSION)
    save_model(model, str(tmp / MODEL_FILE))
    _as_new_file(tmp / MODEL_FILE)
    if optimizer is not None:
        tensors, meta = optimizer_state_to_flat(optimizer)
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        _as_new_file(tmp / OPTIMIZER_FILE)
        state["optimizer"] = meta
    with open(tmp / STATE_FILE, "w") as f:
        f.write(json.dumps(state))
    if assets is not None:
        assets(tmp)
    _fsync_tree(tmp)
    if final.exists():                  # a step written again (after a resume): its old copy goes first
        shutil.rmtree(final)
    _rename_into_place(tmp, final)
    return final


def resolve_checkpoint(path: str | Path) -> Path | None:
    """A checkpoint directory from ``path``: the directory itself if it holds trainer_state.json,
    else the one its ``latest`` file names; None if there is neither."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if not name:
            raise FileNotFoundError(f"{pointer}: empty (it should name the newest checkpoint, e.g. step-0000100); "
                                    "write the name of a complete step-* directory into it, or delete it")
        target = path / name
        if not (target / STATE_FILE).is_file():
            raise FileNotFoundError(f"{pointer} names {name}, which is not a complete checkpoint "
                                    f"(no {target / STATE_FILE})")
        return target
    return None


def resolve_best(path: str | Path) -> Path | None:
    """The best checkpoint of a run directory: ``best`` (a link, or an older attnlab's
    directory), else the newest ``best-*`` copy (an instant of converting an older run's best/,
    repaired by the next :class:`CheckpointManager`); None if there is none."""
    path = Path(path)
    if (path / BEST).is_dir():
        return path / BEST
    name = _pointed(path / BEST)
    if name is not None and _BEST_DIR.match(name) and (path / name / STATE_FILE).is_file():
        return path / name
    copies = sorted((int(m.group(1)), p) for p in path.glob(f"{BEST}-*")
                    if (m := _BEST_DIR.match(p.name)) and (p / STATE_FILE).is_file())
    return copies[-1][1] if copies else None


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: Optimizer | None = None) -> dict:
    """Load weights (strict) and optionally optimizer state; returns the trainer state dict."""
    ckpt = resolve_checkpoint(path)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint at {path} (no {STATE_FILE} and no {LATEST} file)")
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{ckpt / STATE_FILE}: not readable JSON ({e})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{ckpt / STATE_FILE}: expected a JSON object, found {type(state).__name__}")
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(f"{ckpt / STATE_FILE}: checkpoint format {state.get('format')}, expected {FORMAT_VERSION}")
    _read_safetensors(ckpt / MODEL_FILE, lambda f: load_model(model, f, strict=True))
    if optimizer is not None:
        if not (ckpt / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{ckpt}: no {OPTIMIZER_FILE} to resume the optimizer from")
        tensors = _read_safetensors(ckpt / OPTIMIZER_FILE, load_file)
        optimizer_state_from_flat(optimizer, tensors, state["optimizer"])
    state["path"] = str(ckpt)
    return state


def _read_safetensors(file: Path, read: Callable[[str], Any]) -> Any:
    """``read(str(file))``, with a damaged or truncated file (or weights of another model)
    reported as one line naming the file: safetensors raises its own error types, without it."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file")
    try:
        return read(str(file))
    except OSError:
        raise
    except Exception as e:                              # SafetensorError, RuntimeError of a key mismatch
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{file}: cannot be loaded: truncated, damaged or of another model ({first})") from None


# ----------------------------------------------------------------------------- the run directory
def _step_of(ckpt: Path) -> int:
    try:
        return int(json.loads((ckpt / STATE_FILE).read_text()).get("step", 0))
    except (OSError, ValueError, AttributeError):
        return 0


class CheckpointManager:
    """Saves ``step-XXXXXXX`` checkpoints into ``out_dir``, keeps the last ``keep_last`` and a copy
    of the best one in ``best/``, and maintains the ``latest`` pointer. Only rank 0 uses it."""

    def __init__(self, out_dir: str | Path, keep_last: int = 3):
        if keep_last < 1:
            raise ValueError(f"CheckpointManager: keep_last must be >= 1, got {keep_last}")
        self.out_dir, self.keep_last = Path(out_dir), keep_last
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._recover()

    def _recover(self) -> None:
        """After a crash: re-create a missing ``best`` link, then remove what no pointer names
        (half-written temporaries, superseded ``best-*`` copies, an older attnlab's trash)."""
        best = self.best_dir
        copies = self.best_dirs()
        if _pointed(best) is None and not best.is_dir() and copies:
            _point_link(best, copies[-1][1].name)      # killed between renaming a legacy best/ and linking
        for leftover in [*self.out_dir.glob(".tmp-*"), *self.out_dir.glob(".trash-*")]:
            shutil.rmtree(leftover, ignore_errors=True)
        for name in (f".{BEST}.tmp-link", f".{LATEST}.tmp"):
            if (self.out_dir / name).is_symlink() or (self.out_dir / name).is_file():
                os.unlink(self.out_dir / name)
        current = _pointed(best)
        for _, p in copies:
            if p.name != current and (current is not None or best.is_dir()):
                shutil.rmtree(p, ignore_errors=True)

    def step_dirs(self) -> list[tuple[int, Path]]:
        found = [(int(m.group(1)), p) for p in self.out_dir.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def latest(self) -> Path | None:
        return resolve_checkpoint(self.out_dir) if (self.out_dir / LATEST).is_file() else None

    def best_dirs(self) -> list[tuple[int, Path]]:
        found = [(int(m.group(1)), p) for p in self.out_dir.iterdir()
                 if (m := _BEST_DIR.match(p.name)) and p.is_dir() and not p.is_symlink()]
        return sorted(found)

    @property
    def best_dir(self) -> Path:
        return self.out_dir / BEST

    def save(self, step: int, model: nn.Module, optimizer: Optimizer | None, state: dict,
             assets: Callable[[Path], None] | None = None, is_best: bool = False) -> Path:
        path = save_checkpoint(self.out_dir / f"step-{step:07d}", model, optimizer, state, assets)
        write_text_atomic(self.out_dir / LATEST, path.name + "\n")
        if is_best:
            self._copy_to_best(path)
        self._prune(keep=path)
        return path

    def discard_after(self, step: int) -> None:
        """Remove checkpoints newer than ``step`` (left by a run that is being resumed from ``step``)."""
        for s, p in self.step_dirs():
            if s > step:
                shutil.rmtree(p)

    def _copy_to_best(self, path: Path) -> None:
        """Copy ``path`` to ``best-STEP`` and point ``best`` at it (see the module docstring)."""
        step = int(_STEP_DIR.match(path.name).group(1))
        final = self.out_dir / f"{BEST}-{step:07d}"
        best = self.best_dir
        if best.is_dir() and not best.is_symlink():        # an older attnlab's best/: give it a versioned name
            legacy = self.out_dir / f"{BEST}-{_step_of(best):07d}"
            if legacy.exists():
                shutil.rmtree(legacy)
            os.rename(best, legacy)
            _point_link(best, legacy.name)
        previous = _pointed(best)
        if previous == final.name:                         # the same step again: keep it, it is complete
            return
        tmp = self.out_dir / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:  # files are never modified in place, so hard links are safe and cost no space
            shutil.copytree(path, tmp, copy_function=os.link)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(path, tmp)
        _fsync_tree(tmp)
        if final.exists():                                  # left by a crash before the link moved
            shutil.rmtree(final)
        _rename_into_place(tmp, final)
        _point_link(best, final.name)
        if previous is not None and _BEST_DIR.match(previous):
            shutil.rmtree(self.out_dir / previous, ignore_errors=True)

    def _prune(self, keep: Path) -> None:
        dirs = self.step_dirs()
        for _, p in dirs[: max(0, len(dirs) - self.keep_last)]:
            if p != keep:
                shutil.rmtree(p, ignore_errors=True)
