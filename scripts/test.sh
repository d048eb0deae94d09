#!/usr/bin/env bash
# Install everything the test suite needs into .venv, then run the whole suite.
# Extra arguments go to pytest (e.g. -k protocol).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
exec .venv/bin/python -m pytest "$@"
