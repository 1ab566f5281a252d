"""The set-up's lock pins everything the suite runs on: a fresh machine gets the versions the suite
last passed with, and a newer version comes in only through scripts/upgrade.sh."""
import pytest

from _deps import LOCK, needed_distributions, read_lock, unpinned


def test_every_package_the_suite_needs_is_pinned_at_its_installed_version():
    needed = needed_distributions()
    # the test dependencies and what they pull in are all there, not only the direct ones
    assert {"torch", "transformers", "tokenizers", "huggingface-hub", "safetensors", "gguf", "pytest"} <= set(needed)
    assert unpinned(read_lock(), needed) == []


def test_a_missing_or_moved_pin_is_named(tmp_path):
    pins = read_lock()
    needed = needed_distributions()
    less = dict(pins)
    del less["transformers"]
    moved = dict(pins, tokenizers="0.0.1")
    assert unpinned(less, needed) == [f"transformers {needed['transformers']} (lock: absent)"]
    assert unpinned(moved, needed) == [f"tokenizers {needed['tokenizers']} (lock: 0.0.1)"]
    bad = tmp_path / "lock.txt"
    bad.write_text("# a comment\ntorch>=2.4\n")
    with pytest.raises(ValueError, match=r"lock.txt:2: not a 'name==version' pin: 'torch>=2.4'"):
        read_lock(bad)


def test_the_lock_pins_the_cpu_torch_the_setup_installs():
    assert read_lock(LOCK)["torch"] == "2.13.0"


def _pytest_in(tmp_path, ci: bool, deps_stub: str | None = None):
    """Run pytest on a folder holding this suite's conftest and a module that importorskips."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path
    here = Path(__file__).parent
    shutil.copy(here / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "_deps.py").write_text(deps_stub or (here / "_deps.py").read_text())
    (tmp_path / "test_probe.py").write_text('import pytest\npytest.importorskip("no_such_module_xyz")\n\n\n'
                                            'def test_nothing():\n    pass\n')
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_module_that_cannot_import_fails_instead_of_skipping(tmp_path):
    alone = _pytest_in(tmp_path, ci=False)
    assert alone.returncode in (0, 5) and "1 skipped" in alone.stdout, alone.stdout   # 5: no test ran
    ci = _pytest_in(tmp_path, ci=True)
    assert ci.returncode != 0 and "1 error" in ci.stdout and "no_such_module_xyz" in ci.stdout, ci.stdout


def test_under_ci_a_missing_test_dependency_stops_the_run_in_one_line(tmp_path):
    stub = "def missing_test_dependencies():\n    return ['transformers', 'gguf']\n"
    ci = _pytest_in(tmp_path, ci=True, deps_stub=stub)
    assert ci.returncode == 3, ci.stdout + ci.stderr
    assert "CI: test dependencies not installed: transformers, gguf" in ci.stdout + ci.stderr
