#!/usr/bin/env bash
# Install the gateway into .venv and run it, by default on the embedded Piper voice.
# Extra arguments go to `tts-gateway serve` (e.g. --port 9000, --config my.toml).
# EXTRAS names the pip extras to install (default: server); the GPU quick start is
#   EXTRAS=vllm,gpu TTS_GATEWAY__ENGINE__COSYVOICE2__MODEL_DIR=/models/CosyVoice2-0.5B \
#       bash scripts/serve.sh --config config.gpu.toml
# The install runs on the first start and again only when pyproject.toml or EXTRAS changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-server}
known=$("$PYTHON" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]))')
for extra in ${EXTRAS//,/ }; do
    [[ " $known " == *" $extra "* ]] || { echo "serve.sh: EXTRAS names '$extra', which pyproject.toml lacks (it has: $known)" >&2; exit 2; }
done
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.tts-gateway-server-installed
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS"
if [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
    echo "$wanted" > "$stamp"
fi
exec .venv/bin/tts-gateway serve "$@"
