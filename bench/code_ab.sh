#!/usr/bin/env bash
# An A/B of a code change on one GPU machine: the same benches over this checkout ("now"), then
# with an earlier version of some of its files swapped in ("before"), which are put back when the
# run ends, also when it fails. Both arms' results come back as one file, $OUT/code_ab.tar.gz
# (a device call brings back at most 8). Make the earlier files, paths as in the checkout:
#   for f in engine/cosyvoice2/model/estimator.py ...; do mkdir -p .ab/$(dirname $f); git show COMMIT:$f > .ab/$f; done
# then, after the vLLM bundle's staging calls, carry [".whl", ".gpu", ".ab"], command:
#   bash bench/code_ab.sh .ab
# An arm (~200 s): a paged call's decoder line, the engine's configuration
# (bench/paged_call_costs.sh fused_unsplit), and a flow solve by graphs at 1, 8 and 64 rows
# (bench/flow_graphs.py). CODE_AB_ARM: a script run for each arm instead, with OUT set to the
# arm's folder (the tests give a stand-in).
set -uo pipefail
: "${OUT:?set OUT to the output folder}"
earlier=${1:?usage: code_ab.sh FOLDER (earlier versions of files, paths as in the checkout)}
[ -d "$earlier" ] || { echo "code_ab: no folder $earlier" >&2; exit 2; }
mapfile -t files < <(cd "$earlier" && find . -type f | sed 's|^\./||' | sort)
[ ${#files[@]} -gt 0 ] || { echo "code_ab: $earlier holds no files" >&2; exit 2; }
for f in "${files[@]}"; do
    [ -f "$f" ] || { echo "code_ab: $f is not a file of this checkout" >&2; exit 2; }
done
kept=$(mktemp -d)
for f in "${files[@]}"; do mkdir -p "$kept/$(dirname "$f")" && cp "$f" "$kept/$f"; done
put_back() { for f in "${files[@]}"; do cp "$kept/$f" "$f"; done; }
trap put_back EXIT

arm() {  # the benches of one arm, into the folder $1
    if [ -n "${CODE_AB_ARM:-}" ]; then
        OUT=$1 bash "$CODE_AB_ARM"
        return
    fi
    # shellcheck source=bench/gpu_install.sh
    OUT=$1 . bench/gpu_install.sh || return 1
    OUT=$1 bash bench/paged_call_costs.sh fused_unsplit || return 1
    python3 bench/flow_graphs.py --batches 1,8,64 --json "$1/flow_graphs.json" > "$1/flow_graphs.log" 2>&1
}

results=$(mktemp -d)
status=0
mkdir -p "$results/now" "$results/before"
arm "$results/now" || { echo "code_ab: the now arm failed" >&2; status=1; }
for f in "${files[@]}"; do cp "$earlier/$f" "$f"; done
arm "$results/before" || { echo "code_ab: the before arm failed" >&2; status=1; }
put_back
tar -czf "$OUT/code_ab.tar.gz" -C "$results" now before
exit $status
