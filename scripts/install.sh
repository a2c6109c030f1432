#!/usr/bin/env bash
# Creates .venv (once) and installs llmtrain into it with the pinned constraints.
# Re-running is cheap: pip only checks that everything is already there.
# The development install includes the `deepspeed` and `eval` extras, so that the DeepSpeed and `llmtrain evaluate`
# tests run (CI runs this script, then pytest). It goes through constraints.txt like the rest: without the torch pin,
# deepspeed would pull a CUDA build of torch. On top of the base install the deepspeed extra takes about 12 s here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -c constraints.txt -e ".[test,deepspeed,serve,eval,float8]"
