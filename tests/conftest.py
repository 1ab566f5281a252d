"""Test-wide settings.

The suite runs as two pytest-xdist workers on a 2-core machine; each worker uses one torch
thread so the workers do not oversubscribe the cores (tiny matmuls with contended threads
run ~100x slower).

Under CI (``CI=true``) nothing vanishes silently: a missing test dependency stops the run with one
line before any test runs, and a test module that skips itself because an import failed
(``pytest.importorskip``) is reported as a failure. On a developer's machine those modules skip.
"""
import os

import pytest
import torch

torch.set_num_threads(1)

_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    if not _CI:
        return
    from _deps import missing_test_dependencies
    missing = missing_test_dependencies()
    if missing:
        pytest.exit(f"CI: test dependencies not installed: {', '.join(missing)} (bash scripts/setup.sh installs "
                    "requirements/lock.txt)", returncode=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if _CI and report.skipped and "could not import" in str(report.longrepr):
        report.outcome = "failed"       # pytest.importorskip's reason: a test dependency is missing under CI
