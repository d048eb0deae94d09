#!/usr/bin/env bash
# Starts one tts-gateway per GPU (or N replicas on CPU) behind HAProxy, in the foreground.
#
#   deploy/launch-replicas.sh [--replicas N] [--base-port 8765] [--listen 0.0.0.0:8080] \
#       [--mps] [--logs DIR] [--prometheus-targets FILE] -- [tts-gateway serve options]
#
#   deploy/launch-replicas.sh --mps -- --config config.gpu.toml   # one replica per GPU
#   deploy/launch-replicas.sh --replicas 3 --                      # three Piper replicas (CPU)
#
# Replica i listens on base-port + i. On a GPU host, without --replicas, there is one replica
# per GPU that nvidia-smi lists, each seeing only its GPU (CUDA_VISIBLE_DEVICES=i, so every
# replica's config says device "cuda"), and with --mps each has its own CUDA MPS daemon (its
# vLLM engine core and token2wav worker then share that GPU side by side). HAProxy
# (deploy/haproxy/haproxy.cfg) takes sessions on --listen and sends each new one to the ready
# replica with the fewest connections.
#
# SIGTERM or Ctrl-C drains every replica (open replies finish, see docs/deployment.md) and then
# stops the balancer. To restart one replica without dropping replies, send SIGTERM to its pid
# (printed at start and kept in LOGS/gateway-i.pid; its exit status lands in
# LOGS/gateway-i.status): the balancer stops sending it new sessions
# once its /readyz says 503; start it again with the command in LOGS/gateway-i.cmd.
set -euo pipefail
replicas="" base_port=8765 listen=0.0.0.0:8080 mps=0 logs=${TMPDIR:-/tmp}/tts-replicas targets=""
while [ $# -gt 0 ]; do
    case $1 in
        --replicas) replicas=$2; shift 2 ;;
        --base-port) base_port=$2; shift 2 ;;
        --listen) listen=$2; shift 2 ;;
        --mps) mps=1; shift ;;
        --logs) logs=$2; shift 2 ;;
        --prometheus-targets) targets=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "launch-replicas: unknown option $1 (options go before --, serve's after it)" >&2; exit 2 ;;
    esac
done
here=$(cd "$(dirname "$0")" && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ -z "$replicas" ]; then
    replicas=${gpus:-0}
    [ "$replicas" -gt 0 ] || { echo "launch-replicas: no GPU found; say --replicas N for CPU replicas" >&2; exit 2; }
fi
[ "$replicas" -le 8 ] || { echo "launch-replicas: haproxy.cfg lists 8 replicas; add lines there for more" >&2; exit 2; }
command -v haproxy >/dev/null || { echo "launch-replicas: haproxy not found (apt-get install haproxy)" >&2; exit 2; }
gateway=$(command -v tts-gateway) || { echo "launch-replicas: tts-gateway not found on PATH" >&2; exit 2; }
# GPU containers often mount the driver's tools in /usr/local/nvidia/bin, off PATH.
mps_control=$(PATH=$PATH:/usr/local/nvidia/bin command -v nvidia-cuda-mps-control || true)
[ "$mps" = 0 ] || [ -n "$mps_control" ] || { echo "launch-replicas: --mps needs nvidia-cuda-mps-control" >&2; exit 2; }
mkdir -p "$logs"
pids=()
watchers=()
mps_dirs=()
declare -A balancer_env=([LISTEN]=$listen)
for ((i = 0; i < replicas; i++)); do
    port=$((base_port + i))
    env_args=()
    if [ "$gpus" -gt 0 ] && [ "$i" -lt "$gpus" ]; then
        env_args+=("CUDA_VISIBLE_DEVICES=$i")
        if [ "$mps" = 1 ]; then
            dir=$logs/mps-$i
            mkdir -p "$dir/pipe" "$dir/log"
            CUDA_VISIBLE_DEVICES=$i CUDA_MPS_PIPE_DIRECTORY=$dir/pipe CUDA_MPS_LOG_DIRECTORY=$dir/log \
                "$mps_control" -d
            mps_dirs+=("$dir")
            env_args+=("CUDA_MPS_PIPE_DIRECTORY=$dir/pipe" "CUDA_MPS_LOG_DIRECTORY=$dir/log")
        fi
    fi
    cmd=(env "${env_args[@]}" "$gateway" serve --port "$port" "$@")
    printf '%q ' "${cmd[@]}" > "$logs/gateway-$i.cmd"
    rm -f "$logs/gateway-$i.pid" "$logs/gateway-$i.status"
    # A watcher per replica keeps its exit status (LOGS/gateway-i.status: 0 after a drain,
    # non-zero when its engine failed) and says so in the launcher's output.
    (
        "${cmd[@]}" > "$logs/gateway-$i.log" 2>&1 &
        echo $! > "$logs/gateway-$i.pid"
        status=0
        wait $! || status=$?
        echo $status > "$logs/gateway-$i.status"
        echo "replica $i exited with status $status"
    ) &
    watchers+=($!)
    until [ -s "$logs/gateway-$i.pid" ]; do sleep 0.05; done
    pids+=("$(cat "$logs/gateway-$i.pid")")
    balancer_env[GATEWAY_$((i + 1))]=127.0.0.1:$port
    echo "replica $i: pid ${pids[-1]} on port $port ${env_args[*]:-}, log $logs/gateway-$i.log"
done
if [ -n "$targets" ]; then
    printf '[{"targets": [%s]}]\n' "$(for ((i = 0; i < replicas; i++)); do
        printf '%s"127.0.0.1:%d"' "$([ "$i" -gt 0 ] && echo ,)" $((base_port + i)); done)" > "$targets"
fi
balancer_args=()
for name in "${!balancer_env[@]}"; do balancer_args+=("$name=${balancer_env[$name]}"); done
env "${balancer_args[@]}" haproxy -W -f "$here/haproxy/haproxy.cfg" > "$logs/haproxy.log" 2>&1 &
balancer=$!
echo "haproxy: pid $balancer on $listen, log $logs/haproxy.log"

stop() {
    trap - TERM INT
    echo "draining ${#pids[@]} replicas"
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait "${watchers[@]}" 2>/dev/null || true
    kill -TERM "$balancer" 2>/dev/null || true
    wait "$balancer" 2>/dev/null || true
    for dir in "${mps_dirs[@]}"; do echo quit | CUDA_MPS_PIPE_DIRECTORY=$dir/pipe "$mps_control" || true; done
}
trap stop TERM INT
wait "$balancer"
