#!/usr/bin/env bash
# Device side of the official CosyVoice2 baseline (issue 22): one arm of bench/official_baseline.py
# on the full-size random checkpoint bench/gpu_check.sh serves (made here if this machine has none).
#
# On the dev machine, once:  bash bench/gpu_prepare.sh && bash bench/official_prepare.sh
# Device call, carry [".official", ".whl", ".gpu"]:
#   bash bench/official_check.sh --arm torch [official_baseline.py options]
#   bash bench/official_check.sh --arm vllm [options]   (after the vLLM bundle)
# Writes $OUT/official_<arm>.json (rewritten after each level) and $OUT/official_<arm>.log.
# The pip lines go to $OUT/pip.log.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 \
    || { cat "$OUT/pip.log"; exit 1; }
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/official-site .official/whl/*.whl \
    >>"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:/tmp/official-site${PYTHONPATH:+:$PYTHONPATH}
# This checkout, importable as tts_gateway (pyproject.toml maps its folders there).
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/pip.log" 2>&1 || { cat "$OUT/pip.log"; exit 1; }
arm=torch
for ((i = 1; i <= $#; i++)); do [ "${!i}" = --arm ] && { j=$((i + 1)); arm=${!j}; }; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
model_dir=/tmp/cv2-full
if [ ! -f "$model_dir/README.md" ]; then  # make_checkpoint writes README.md last
    python3 -c "from pathlib import Path; from tts_gateway.testkit.checkpoint import make_checkpoint; make_checkpoint(Path('$model_dir'), 'full', 0)" \
        || exit 1
fi
# Streamed to the file line by line, so that a call cut off by its time limit still returns the log
# up to that moment. OFFICIAL_LIMIT_S: keep it under the device call's own limit.
timeout "${OFFICIAL_LIMIT_S:-570}" python3 bench/official_baseline.py --model-dir "$model_dir" --out "$OUT" "$@" 2>&1 \
    | grep --line-buffered -v ' DEBUG ' > "$OUT/official_$arm.log"
status=${PIPESTATUS[0]}
tail -30 "$OUT/official_$arm.log"
exit "$status"
