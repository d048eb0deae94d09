#!/usr/bin/env bash
# Runs a command with CUDA MPS (Multi-Process Service) on: every CUDA process it starts becomes
# a client of one MPS server, so kernels of different processes can run on the GPU at the same
# time instead of taking turns. The gateway is two such processes (vLLM's engine core and the
# token2wav worker); bench/gpu_sharing.py measures what taking turns costs.
#
#   bash bench/with_mps.sh bash bench/gpu_check.sh [options]
#
# The daemon gets private pipe and log folders (so that nothing else on the machine becomes its
# client by accident) and is shut down when the command ends, whatever its exit status. The
# command finds the control program in TTS_MPS_CONTROL (bench/gpu_check.py asks it for the
# server's clients). In GPU containers the driver's tools are often not on PATH but in
# /usr/local/nvidia/bin, where the NVIDIA container runtime mounts them.
set -uo pipefail
: "${OUT:=/tmp}"
control=$(PATH=$PATH:/usr/local/nvidia/bin command -v nvidia-cuda-mps-control) || {
    echo "with_mps: nvidia-cuda-mps-control not found" >&2; exit 2; }
export TTS_MPS_CONTROL=$control
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/tts-mps/pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/tts-mps/log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
"$control" -d || { echo "with_mps: the MPS control daemon did not start" >&2; exit 2; }
stop() {
    echo quit | "$control"
    for log in control server; do
        cp "$CUDA_MPS_LOG_DIRECTORY/$log.log" "$OUT/mps-$log.log" || echo "with_mps: no MPS $log log" >&2
    done
}
trap stop EXIT
"$@"
