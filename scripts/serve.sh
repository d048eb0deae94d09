#!/usr/bin/env bash
# Install the gateway into .venv and run it on the embedded Piper voice.
# Extra arguments go to `tts-gateway serve` (e.g. --port 9000, --config my.toml).
# The install runs on the first start and again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.tts-gateway-server-installed
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[server]'
    echo "$wanted" > "$stamp"
fi
exec .venv/bin/tts-gateway serve "$@"
