#!/usr/bin/env bash
# Set up (idempotent), then run the default test suite (slow tests are opt-in: -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 "$@"
