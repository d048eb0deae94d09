#!/usr/bin/env bash
# Several bench/gpu_check.sh runs in one device call, a gateway each, each into $OUT/<name>:
# an A/B on one machine. (Runs on different machines of one card type have differed by as much
# as most settings change: docs/benchmarks.md.) After the vLLM bundle's staging calls:
#   carry [".whl", ".gpu"], command:
#   bash bench/with_mps.sh bash bench/gpu_check_variants.sh \
#       --common '--skip-equality --first-chunk-by-load --duration 40 --first-audio-sessions "" \
#       --full-sessions "" --sessions 64' base '' between '--urgent-chunks-between-calls'
# NAME ARGS pairs, run in order; each variant's ARGS follow the common ones (quoting as in a
# shell). The variants share the call's 600 s: at 64 sessions a gateway with one 40 s level
# takes ~190-210 s. Each variant's folder is packed into $OUT/<name>.tar.gz when it ends (a
# device call brings back at most 8 files); one cut off by the call's limit leaves its folder.
# GPU_CHECK: the script each variant runs (the tests give a stand-in). VARIANTS_LIMIT_S (590 by
# default, inside a device call's 600 s): a variant is skipped, and the call fails, when the time
# left is less than the longest variant so far took; cut off while it starts, it would return nothing.
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
usage="usage: gpu_check_variants.sh [--common ARGS] NAME ARGS [NAME ARGS ...]"
common=""
if [ "${1:-}" = "--common" ]; then
    [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
    common=$2
    shift 2
fi
if [ $# -eq 0 ] || [ $(($# % 2)) -ne 0 ]; then echo "$usage" >&2; exit 2; fi
names=() extras=() options=()
while [ $# -gt 0 ]; do  # every name checked before anything runs
    case $1 in
        "" | *[!A-Za-z0-9_-]*) echo "gpu_check_variants: a variant's name is letters, digits, - and _: '$1'" >&2; exit 2 ;;
    esac
    eval "options=($common $2)" || { echo "gpu_check_variants: cannot split the options of $1" >&2; exit 2; }
    names+=("$1") extras+=("$2")
    shift 2
done
status=0
limit=${VARIANTS_LIMIT_S:-590} longest=0
for i in "${!names[@]}"; do
    name=${names[i]}
    if [ "$i" -gt 0 ] && [ $((SECONDS + longest)) -gt "$limit" ]; then
        echo "== $name skipped: $((limit - SECONDS)) s of $limit left, a variant took up to $longest s" >&2
        status=1
        continue
    fi
    started=$SECONDS
    eval "options=($common ${extras[i]})"
    mkdir -p "$OUT/$name"
    echo "== $name:${options[*]:+ ${options[*]}}"
    OUT="$OUT/$name" bash "${GPU_CHECK:-bench/gpu_check.sh}" "${options[@]}" || { echo "== $name failed" >&2; status=1; }
    if tar -czf "$OUT/$name.tar.gz" -C "$OUT" "$name"; then rm -rf "${OUT:?}/$name"; else echo "== $name not packed" >&2; status=1; fi
    longest=$((SECONDS - started > longest ? SECONDS - started : longest))
done
exit "$status"
