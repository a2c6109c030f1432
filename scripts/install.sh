#!/usr/bin/env bash
# Creates .venv (once) and installs llmtrain into it with the pinned constraints.
# Re-running is cheap: pip only checks that everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[test]"
