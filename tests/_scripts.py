"""Load one of the project's scripts (benchmarks/*.py, scripts/*.py) as a module, by its path from
the repository root, so a test can call its functions without running it."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str, name: str | None = None):
    """The module of ROOT/``relative``, executed once per call (``name``: its module name, by
    default the file's stem)."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
