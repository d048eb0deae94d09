#!/usr/bin/env bash
# The H200 run of bench/token2wav_chunk_cost.py: full-size random checkpoint, flow in float32
# and in bfloat16 (HiFT stays float32), 6 s prompt, 16 streaming chunks + the final one.
#
# Run from the repo root on the GPU machine, with $OUT set; it writes $OUT/gpu.txt,
# $OUT/token2wav_fp32.json, $OUT/token2wav_bf16.json and $OUT/log.txt.
# That machine has torch (CUDA), transformers, onnx, onnxruntime, pyyaml, numpy and
# tokenizers, but not soxr (the frontend resamples the prompt with it): carry its wheel
# in .whl/, fetched beforehand on the dev machine with
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#       -d .whl soxr==1.1.0
#
# (soxr 1.1.0 ships only manylinux_2_28 wheels, cp312-abi3: without that --platform pip finds none.)
#
# Time: the checkpoint (~2.5 GB, written once to /tmp and used by both runs) takes a
# minute or two; each benchmark run well under a minute. The timeouts keep the whole
# script under 9 minutes even if something hangs (each run writes its JSON before it
# checks the two modes' audio, so a failed check still leaves the timings).
set -euo pipefail
: "${OUT:?set OUT to the output folder}"
MODEL_DIR=/tmp/cv2-full

# shellcheck source=bench/gpu_install.sh
. bench/gpu_install.sh

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt"
nvidia-smi >> "$OUT/gpu.txt"

if [ ! -f "$MODEL_DIR/README.md" ]; then  # make_checkpoint writes README.md last
    timeout 240 python3 -c "
import time
from tts_gateway.testkit.checkpoint import make_checkpoint
started = time.time()
make_checkpoint('$MODEL_DIR', 'full', 0, log=print)
print(f'full checkpoint written in {time.time() - started:.0f} s')
" 2>&1 | tee -a "$OUT/log.txt"
fi

status=0
for dtype in float32 bfloat16; do
    tag=$([ "$dtype" = float32 ] && echo fp32 || echo bf16)
    echo "=== token2wav chunk cost, flow $dtype ===" | tee -a "$OUT/log.txt"
    timeout 150 python3 bench/token2wav_chunk_cost.py --size full --device cuda --dtype "$dtype" \
        --model-dir "$MODEL_DIR" --prompt-seconds 6 --chunks 16 --repeats 3 \
        --json "$OUT/token2wav_$tag.json" 2>&1 | tee -a "$OUT/log.txt" || status=$?
done
exit $status
