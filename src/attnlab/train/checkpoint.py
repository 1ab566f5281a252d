"""Checkpoints: safetensors for tensors, JSON for everything else, written atomically.

Layout of a run directory (``TrainConfig.out_dir``)::

    latest                  text file: the name of the newest complete checkpoint
    step-0000100/           one checkpoint (the last ``keep_last`` are kept)
        model.safetensors       weights; tied tensors stored once (safetensors refuses shared storage)
        optimizer.safetensors   every optimizer state tensor, key "state.<param index>.<name>"
        trainer_state.json      step, epoch, position in the epoch, scheduler, optimizer
                                param groups, RNG states, GradScaler, best metric, config,
                                metrics so far
        ...                     the task's assets (tokenizers), see Task.save_assets
        manifest.json           the size and SHA-256 of every other file, written last
        shards/                 a sharded run's (--shard) weights and optimizer state instead, per rank
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

Integrity. Every checkpoint lists the size and SHA-256 of each of its files in ``manifest.json``,
written after them and before the directory is renamed into place, and every load checks the
files it reads against it (:func:`verify_checkpoint`): a flipped byte in the weights is
:class:`CheckpointDamaged` naming the file instead of a model that loads and quietly scores
wrong. Resuming from a run directory whose newest checkpoint is damaged continues from the
newest intact one (:func:`resolve_resume` says which it skipped and why). A checkpoint without
a manifest (written by an older attnlab, or whose manifest was removed to accept a file edited
on purpose) loads unchecked, without a word: there is nothing to check it against, and a
warning on every load of an old run would say nothing its owner can act on. Hashing costs less
than loading (a BERT-base file hashed in about two thirds of the time it took to load;
benchmarks/results/code.md). A file is hashed once per process while it is
unchanged (same inode, size and times), so a loader that checks a checkpoint before choosing it
does not hash it again to load it.

A save that runs out of space (disk full, quota) removes its half-written temporary and raises
:class:`DiskFullError`, one line naming the run directory, the step and the checkpoint that is
still intact; nothing already saved is touched.

Files get the permissions of any new file (``0666`` less the umask, as ``open`` gives),
weights included. Loading reads safetensors and JSON only; no pickle is executed anywhere.
"""
from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model
from torch import nn
from torch.optim import Optimizer

__all__ = ["CheckpointManager", "save_checkpoint", "load_checkpoint", "resolve_checkpoint", "capture_rng_state",
           "restore_rng_state", "resolve_best", "optimizer_state_to_flat", "optimizer_state_from_flat", "FORMAT_VERSION",
           "verify_checkpoint", "resolve_resume", "CheckpointDamaged", "CheckpointWarning", "DiskFullError",
           "read_checkpoint_state", "SHARDS_DIR"]

FORMAT_VERSION = 1
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, LATEST, BEST = ("model.safetensors", "optimizer.safetensors",
                                                        "trainer_state.json", "latest", "best")
MANIFEST = "manifest.json"
SHARDS_DIR = "shards"           # a sharded run's weights and optimizer state, one file per rank (attnlab.train.sharded)
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_STEP_DIR = re.compile(r"^step-(\d+)$")
_BEST_DIR = re.compile(r"^best-(\d+)$")


class CheckpointDamaged(ValueError):
    """A checkpoint file differs from what its manifest recorded; the message is one line naming it."""


class CheckpointWarning(UserWarning):
    """A loader used another checkpoint than the one asked for (the message says which and why)."""


class DiskFullError(OSError):
    """A checkpoint save ran out of space; the message is one line naming the run directory, the
    step and the checkpoint to resume from."""

    def __init__(self, message: str, directory: Path):
        super().__init__(errno.ENOSPC, message, str(directory))
        self.message = message

    def __str__(self) -> str:
        return self.message


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


# ----------------------------------------------------------------------------- checksums
_DIGESTS: dict[tuple, str] = {}     # (device, inode, size, mtime, ctime) -> SHA-256, hashed by this process


def _sha256(file: Path) -> str:
    st = os.stat(file)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def _write_manifest(directory: Path) -> None:
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}
    with open(directory / MANIFEST, "w") as f:
        f.write(json.dumps({"format": 1, "files": files}, indent=1))


def verify_checkpoint(path: str | Path, skip: tuple[str, ...] = ()) -> None:
    """Check every file ``manifest.json`` lists (except those named in ``skip``) against its
    recorded size and SHA-256; CheckpointDamaged naming the first that differs. A checkpoint
    without a manifest passes (see the module docstring)."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointDamaged(f"{manifest}: not a readable checkpoint manifest") from None
    for name, size, digest in entries:
        if name in skip:
            continue
        file = path / name
        if not file.is_file():
            raise CheckpointDamaged(f"{file}: missing (listed in {manifest})")
        if file.stat().st_size != size:
            raise CheckpointDamaged(f"{file}: truncated or damaged since it was written ({file.stat().st_size} "
                                    f"bytes, {size} then)")
        if _sha256(file) != digest:
            raise CheckpointDamaged(f"{file}: damaged or changed since it was written (its SHA-256 differs from "
                                    f"the one in {manifest})")


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
    state = dict(state)
    save_model(model, str(tmp / MODEL_FILE))
    _as_new_file(tmp / MODEL_FILE)
    if optimizer is not None:
        tensors, meta = optimizer_state_to_flat(optimizer)
        save_file(tensors, str(tmp / OPTIMIZER_FILE))
        _as_new_file(tmp / OPTIMIZER_FILE)
        state["optimizer"] = meta
    return finish_checkpoint(tmp, final, state, assets)


def finish_checkpoint(tmp: Path, final: Path, state: dict, assets: Callable[[Path], None] | None = None) -> Path:
    """Complete the checkpoint whose tensors are already in the temporary directory ``tmp``: add
    the trainer state, the assets and the manifest, fsync, and rename it to ``final``."""
    state = dict(state, format=FORMAT_VERSION)
    with open(tmp / STATE_FILE, "w") as f:
        f.write(json.dumps(state))
    if assets is not None:
        assets(tmp)
    _write_manifest(tmp)                # last: it vouches for every file above
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


def resolve_resume(path: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The checkpoint to resume from, checked against its manifest, and (checkpoint, why) for each
    damaged one passed over: ``path`` itself if it is a checkpoint (CheckpointDamaged if it is
    damaged), else the one its ``latest`` names or, if that is damaged, the newest intact
    ``step-*`` before it. (None, []) for a directory without checkpoints; CheckpointDamaged if
    none is intact."""
    path = Path(path)
    ckpt = resolve_checkpoint(path)
    if ckpt is None or ckpt == path:
        if ckpt is not None:
            verify_checkpoint(ckpt)
        return ckpt, []
    newest = _STEP_DIR.match(ckpt.name)
    older = sorted(((int(m.group(1)), p) for p in path.iterdir()
                    if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()), reverse=True)
    candidates = [ckpt] + ([p for s, p in older if s < int(newest.group(1))] if newest else [])
    skipped: list[tuple[Path, str]] = []
    for candidate in candidates:
        try:
            verify_checkpoint(candidate)
        except CheckpointDamaged as e:
            skipped.append((candidate, str(e)))
            continue
        return candidate, skipped
    more = f" (and {len(skipped) - 1} older damaged)" if len(skipped) > 1 else ""
    raise CheckpointDamaged(f"{skipped[0][1]}; {path} holds no intact checkpoint to resume from{more}")


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
    ckpt, state = read_checkpoint_state(path, optimizer is not None)
    if (ckpt / SHARDS_DIR).is_dir():
        raise ValueError(f"{ckpt}: written by a sharded run (--shard), its weights are in {SHARDS_DIR}/; resume it "
                         "with --shard under torchrun")
    _read_safetensors(ckpt / MODEL_FILE, lambda f: load_model(model, f, strict=True))
    if optimizer is not None:
        if not (ckpt / OPTIMIZER_FILE).is_file():
            raise FileNotFoundError(f"{ckpt}: no {OPTIMIZER_FILE} to resume the optimizer from")
        tensors = _read_safetensors(ckpt / OPTIMIZER_FILE, load_file)
        optimizer_state_from_flat(optimizer, tensors, state["optimizer"])
    state["path"] = str(ckpt)
    return state


def read_checkpoint_state(path: str | Path, with_optimizer: bool = True) -> tuple[Path, dict]:
    """The checkpoint directory ``path`` resolves to and its trainer state, its files checked
    against the manifest (the optimizer's only ``with_optimizer``)."""
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
    verify_checkpoint(ckpt, skip=() if with_optimizer else (OPTIMIZER_FILE,))
    return ckpt, state


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


def _out_of_space(e: BaseException) -> bool:
    """Whether a failed write ran out of space; safetensors reports the OS error of a failed write
    only in its own error's text ("... No space left on device (os error 28)")."""
    if isinstance(e, OSError):
        return e.errno in _NO_SPACE
    found = _OS_ERROR.search(str(e))
    return found is not None and int(found.group(1)) in _NO_SPACE


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
        """Save ``step`` (see the module docstring); DiskFullError if the device runs out of space."""
        final = self.out_dir / f"step-{step:07d}"
        return self._commit(step, lambda: save_checkpoint(final, model, optimizer, state, assets), is_best)

    def finalise(self, step: int, staged: Path, state: dict, assets: Callable[[Path], None] | None = None,
                 is_best: bool = False) -> Path:
        """Save ``step`` whose tensors every rank has already written into ``staged`` (a temporary
        directory in ``out_dir``, see :func:`attnlab.train.sharded.save_sharded`)."""
        final = self.out_dir / f"step-{step:07d}"
        return self._commit(step, lambda: finish_checkpoint(staged, final, state, assets), is_best)

    def _commit(self, step: int, write: Callable[[], Path], is_best: bool) -> Path:
        try:
            path = write()
            write_text_atomic(self.out_dir / LATEST, path.name + "\n")
            if is_best:
                self._copy_to_best(path)
        except (OSError, SafetensorError) as e:
            if not _out_of_space(e):
                raise
            for leftover in [*self.out_dir.glob(f".tmp-*-{os.getpid()}"), *self.out_dir.glob(".tmp-*-sharded")]:
                shutil.rmtree(leftover, ignore_errors=True)
            intact = self.latest()
            then = (f"nothing is lost: {intact} is intact, and --resume (resume=True) continues from it once "
                    "there is room" if intact is not None else "no earlier checkpoint: make room and start again")
            raise DiskFullError(f"{self.out_dir}: no space left on the device while saving the checkpoint of step "
                                f"{step}; {then}", self.out_dir) from None
        self._prune(keep=path)
        return path

    def discard_after(self, step: int) -> None:
        """Remove checkpoints newer than ``step`` (left by a run that is being resumed from ``step``:
        its abandoned future, or damaged ones passed over), and point ``latest`` at ``step``."""
        for s, p in self.step_dirs():
            if s > step:
                shutil.rmtree(p)
        kept = self.out_dir / f"step-{step:07d}"
        if (kept / STATE_FILE).is_file() and _pointed(self.out_dir / LATEST) != kept.name:
            write_text_atomic(self.out_dir / LATEST, kept.name + "\n")

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
