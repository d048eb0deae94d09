#!/usr/bin/env bash
# A paged token2wav call's cost on the GPU, alone, by its decoder's row-frames (bench/launch_waits.py):
# the decoder as plain torch ops, with its fused Triton kernels (flow_fused_kernels), and with
# those and FlashAttention's keys unsplit (no combining kernel). Each variant reports every
# call's phases, any launch that waited, and the decoder's cost fitted as ms a call plus us a
# row-frame. One device call after the vLLM bundle's staging calls (~5 minutes):
#   carry [".whl", ".gpu"], command: bash bench/paged_call_costs.sh [VARIANT...]
# VARIANT: plain, fused, fused_unsplit (default: all three). plain and fused leave FlashAttention's
# key splits to the kernel, as the engine did before 2026-12-07; fused_unsplit is the engine since.
# Writes $OUT/paged_call_costs_<variant>.json and .log, and paged_call_costs_mels.json (how
# far each two variants' mels lie apart, bf16 all: fused_unsplit against fused is a change of
# summation order alone, the yardstick for fused against plain); the checkpoint goes to /tmp/cv2-full
# (the one bench/gpu_check.sh serves, made here if missing).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
for name in "$@"; do
    case $name in
        plain | fused | fused_unsplit) ;;
        *) echo "unknown variant: $name (plain, fused, fused_unsplit)" >&2; exit 2 ;;
    esac
done
# shellcheck source=bench/gpu_install.sh
. bench/gpu_install.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt"
MELS=$(mktemp -d)  # the turns' mels, compared here rather than brought back
status=0
for variant in "plain:" "fused:--fused-kernels" "fused_unsplit:--fused-kernels --attention-splits 1"; do
    name=${variant%%:*}
    if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
    # shellcheck disable=SC2086  # the variant's options split into words
    timeout 170 python3 bench/launch_waits.py --device cuda --size full --model-dir /tmp/cv2-full --rows 1,8,32 \
        --pool-gb 24 ${variant#*:} --json "$OUT/paged_call_costs_$name.json" --mels "$MELS/$name.npz" \
        > "$OUT/paged_call_costs_$name.log" 2>&1
    code=$?
    echo "$name: exit $code"
    [ "$code" = 0 ] || { status=1; tail -5 "$OUT/paged_call_costs_$name.log"; }
    report="$OUT/paged_call_costs_$name.json"
    [ -f "$report" ] && python3 -c "import json, sys; r = json.load(open(sys.argv[1]))
print('decoder', r['decoder_cost'], 'launches that waited', r['launches_that_waited'])" "$report"
done
# What each kernel option changes in the turns' mels.
python3 - "$MELS" "$OUT" <<'PY' || status=1
import json, sys
from pathlib import Path
from bench.launch_waits import compare_mels
from itertools import combinations
mels, out = Path(sys.argv[1]), Path(sys.argv[2])
ran = sorted(mels.glob("*.npz"), key=lambda path: path.stat().st_mtime)
report = {f"{b.stem}_vs_{a.stem}": compare_mels(a, b) for a, b in combinations(ran, 2)}
print("mels apart", report)
(out / "paged_call_costs_mels.json").write_text(json.dumps(report, indent=2))
PY
exit "$status"
