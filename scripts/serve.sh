#!/usr/bin/env bash
# Install the gateway into .venv (once) and run it on the embedded Piper voice.
# Extra arguments go to `tts-gateway serve` (e.g. --port 9000, --config my.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[server]'
exec .venv/bin/tts-gateway serve "$@"
