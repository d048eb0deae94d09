#!/usr/bin/env bash
# The H200 proof of the CosyVoice2 + vLLM gateway: one device run with vLLM 0.26 importable by
# python3 (the vLLM bundle: see ../shared/device/build-vllm-bundle.sh for its three staging calls).
#
# On the dev machine, once:   bash bench/gpu_prepare.sh      (wheels + prompt wav into .gpu/, .whl/)
# Device call:  carry [".whl", ".gpu"], command:
#   bash bench/gpu_check.sh [gpu_check.py options]
# Writes $OUT/gpu_check.json (phase by phase), equality.json, gateway.log, equality.log.
# Everything takes ~9 of the 10 minutes a call may run; to keep a margin, make two calls on the
# warm machine (the bundle and the checkpoint stay): `... gpu_check.sh --only-equality`, then
# `bash bench/gpu_check.sh --skip-equality`.
# With CUDA MPS (the gateway's two GPU processes then run their kernels side by side):
#   bash bench/with_mps.sh bash bench/gpu_check.sh [options]
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
# shellcheck source=bench/gpu_install.sh
. bench/gpu_install.sh || exit 1
if [ -d .gpu/balancer ]; then
    # HAProxy for --through-balancer, unpacked beside the system (not over it); a wrapper on
    # PATH points it at the libraries it brought.
    root=/tmp/balancer
    for deb in .gpu/balancer/*.deb; do dpkg -x "$deb" "$root"; done
    mkdir -p "$root/bin"
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$root/usr/lib/x86_64-linux-gnu" "$root/usr/sbin/haproxy" > "$root/bin/haproxy"
    chmod +x "$root/bin/haproxy"
    export PATH=$root/bin:$PATH
    haproxy -v | head -1 || echo "gpu_check: the bundled HAProxy does not run here" >&2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv > "$OUT/gpu.txt"
# Written as it comes, so that a call cut off by its time limit still returns the log so far.
timeout 570 python3 bench/gpu_check.py --out "$OUT" "$@" > "$OUT/check.log" 2>&1
status=$?
tail -40 "$OUT/check.log"
exit "$status"
