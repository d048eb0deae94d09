#!/usr/bin/env bash
# Install everything the test suite needs into .venv, then run the whole suite.
# Extra arguments go to pytest (e.g. -k protocol).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip install -q "$@"; }
pip --upgrade pip
# torch first and pinned: 2.13.0 is a CPU build; an unpinned torch pulls a multi-GB CUDA build.
pip torch==2.13.0
pip -e '.[test,server,cosyvoice2,bench,pipecat,livekit]'
# The official CosyVoice2 implementation, test-only, for the equivalence tests.
pip -r tests/requirements-reference.txt
pip --no-deps cosyvoice-minicpmo==0.1.0
# Debian's Chromium for the browser-client tests (tests/web/test_browser.py), HAProxy for the
# load-balancer test (tests/deploy/test_load_balancer.py) and ShellCheck for the benchmark
# scripts' lint (tests/bench/test_official_baseline.py), and a C++ compiler for torch.compile's
# CPU code (bench/estimator_ops.py --inductor, tests/bench/test_benches.py); CI runs as root.
missing=()
command -v g++ >/dev/null || missing+=(g++)
command -v chromium >/dev/null || missing+=(chromium)
command -v haproxy >/dev/null || missing+=(haproxy)
command -v shellcheck >/dev/null || missing+=(shellcheck)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
