# shellcheck shell=bash
# Sourced by the GPU machine's bench scripts, from the repo root with $OUT set: the packages the
# GPU image lacks (websockets, orjson, soxr: carried in .whl/, see bench/gpu_prepare.sh), then
# this checkout itself, importable as tts_gateway (pyproject.toml maps its folders there), so
# that vLLM's processes find the cosyvoice2 plugin entry point. Returns non-zero on failure.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; return 1; }
export PYTHONUNBUFFERED=1
