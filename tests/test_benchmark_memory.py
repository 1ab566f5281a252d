"""benchmarks/_memory.py, the peak-memory meter that reads a fresh process's resident
high-water mark: it sees a tensor written during the call (and not one freed before it), an
allocation past the cap fails in the child as "over the cap" instead of taking the machine down,
and a child that dies is reported in one line. Sizes in MiB, tolerances of a few MiB: the
resident set also holds Python's and glibc's own bookkeeping. No timing is asserted."""
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import _memory as M  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")

CHILD = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
import torch
import _memory as M
MIB = 2**20
big = torch.ones(256 * MIB // 4)          # written, then freed before the measured calls
del big
def fill(mib):
    return lambda: torch.ones(mib * MIB // 4).sum()
fill(8)()                                 # warm-up: the ops' code pages are resident before measuring
M.report(what="64", peak=M.peak_rss_during(fill(64)))
M.report(what="none", peak=M.peak_rss_during(lambda: None))
M.report(what="two 32 in turn", peak=M.peak_rss_during(lambda: (fill(32)(), fill(32)())))
M.cap_memory(M.status_bytes("VmRSS") + 256 * MIB)
try:
    torch.ones(1024 * MIB // 4)
    M.report(what="cap", over_cap=False)
except (RuntimeError, MemoryError) as e:
    M.report(what="cap", over_cap=M.is_out_of_memory(e))
M.report(what="after", peak=M.peak_rss_during(fill(64)))
"""


def test_the_resident_peak_sees_the_call_and_the_cap_refuses_cleanly():
    results, failure = M.run_child(["-c", CHILD], timeout=120)
    assert failure == "", failure
    got = {r["what"]: r for r in results}
    mib = {k: r.get("peak", 0) / 2**20 for k, r in got.items()}
    assert 63 <= mib["64"] <= 70, mib             # the 64 MiB written during the call; not the 256 freed before
    assert mib["none"] < 2, mib
    assert 31 <= mib["two 32 in turn"] <= 38, mib  # the peak, not the sum: the first is freed before the second
    assert got["cap"]["over_cap"] is True
    assert 63 <= mib["after"] <= 70, mib           # the process carries on under the cap


def test_a_child_that_dies_or_hangs_is_reported_in_one_line():
    results, failure = M.run_child(["-c", "raise SystemExit('no room for the model')"], timeout=60)
    assert results == [] and failure.startswith("exit 1: ") and "no room for the model" in failure
    results, failure = M.run_child(["-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); import time, _memory as M; "
                                    "M.report(step=1); time.sleep(30)"], timeout=3)
    assert results == [{"step": 1}] and failure == "over the time limit of 3 s"


def test_parse_keeps_only_the_result_lines():
    out = "hello\n" + M.MARK + '{"a": 1}\n# progress\n' + M.MARK + '{"b": [2, 3]}\n'
    assert M.parse(out) == [{"a": 1}, {"b": [2, 3]}]
