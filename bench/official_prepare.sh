#!/usr/bin/env bash
# Dev-machine side of the official CosyVoice2 baseline (bench/official_baseline.py, issue 22):
# upstream at the pinned commits and the wheels its inference path imports that the GPU image
# lacks, into git-ignored folders that a device call carries. Nothing of upstream enters git.
#
#   bash bench/official_prepare.sh [COSYVOICE_GIT_DIR [MATCHA_GIT_DIR]]
#
# The git directories (or $COSYVOICE_GIT_DIR, $MATCHA_GIT_DIR) are local clones or mirrors of
# FunAudioLLM/CosyVoice and shivammehta25/Matcha-TTS holding the pinned commits; without them
# both are cloned from GitHub.
#   .official/src/cosyvoice, .official/src/matcha   upstream's packages (git archive of the pins)
#   .official/src/PINNED                            the commits
#   .official/whl/                                  wheels for the GPU machine's Python 3.12
# Stubs for what inference never uses are our own code, in bench/official_stubs/.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
COSYVOICE_COMMIT=ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40
MATCHA_COMMIT=dd9105b34bf2be2230f4aa1e4769fb586a3c824e
COSYVOICE_URL=https://github.com/FunAudioLLM/CosyVoice.git
MATCHA_URL=https://github.com/shivammehta25/Matcha-TTS.git
cosyvoice_git=${1:-${COSYVOICE_GIT_DIR:-}}
matcha_git=${2:-${MATCHA_GIT_DIR:-}}
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx /.official/ "$exclude" 2>/dev/null || echo /.official/ >> "$exclude"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# A git directory holding COMMIT: the one given, else a bare clone of URL.
git_dir() {
    local given=$1 url=$2 commit=$3 name=$4
    if [ -z "$given" ]; then
        git clone -q --bare "$url" "$work/$name.git" >&2
        given=$work/$name.git
    fi
    git --git-dir="$given" cat-file -e "$commit^{commit}" || { echo "$given lacks $commit" >&2; exit 1; }
    echo "$given"
}

cosyvoice_git=$(git_dir "$cosyvoice_git" "$COSYVOICE_URL" "$COSYVOICE_COMMIT" cosyvoice)
submodule=$(git --git-dir="$cosyvoice_git" ls-tree "$COSYVOICE_COMMIT" third_party/Matcha-TTS | awk '{print $3}')
[ "$submodule" = "$MATCHA_COMMIT" ] || { echo "CosyVoice pins Matcha-TTS at $submodule, expected $MATCHA_COMMIT" >&2; exit 1; }
matcha_git=$(git_dir "$matcha_git" "$MATCHA_URL" "$MATCHA_COMMIT" matcha)

rm -rf .official/src
mkdir -p .official/src .official/whl
git --git-dir="$cosyvoice_git" archive "$COSYVOICE_COMMIT" cosyvoice | tar -x -C .official/src
git --git-dir="$matcha_git" archive "$MATCHA_COMMIT" matcha | tar -x -C .official/src
printf 'CosyVoice %s\nMatcha-TTS %s\n' "$COSYVOICE_COMMIT" "$MATCHA_COMMIT" > .official/src/PINNED

# What the official inference path imports (cosyvoice.cli.cosyvoice, its yaml's classes, the
# frontend, matcha's decoder and audio) and the GPU image lacks; the image's own list is in
# the device notes (KINDS.md): torch, torchaudio, transformers, onnxruntime, numba, tiktoken,
# lightning, scipy, einops, regex, requests, joblib, lazy-loader, msgpack are there.
WHEELS=(
    hyperpyyaml==1.2.3 ruamel.yaml==0.18.17 ruamel.yaml.clib==0.2.15   # the yaml loader
    omegaconf==2.3.1                                                    # flow.py's DictConfig
    conformer==0.3.2 diffusers==0.42.1                                  # matcha's decoder
    librosa==0.11.0 decorator==5.3.1 platformdirs==4.14.9 pooch==1.9.0  # matcha.utils.audio's mel filters
    inflect==7.6.0 typeguard==4.6.0 more-itertools==11.2.1 jaraco.functools==4.6.0  # the text frontend
)
rm -f .official/whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .official/whl "${WHEELS[@]}"
# Published as source archives only, pure Python, so their wheels are built here: omegaconf's
# parser runtime (pinned by omegaconf to 4.9.*) and openai-whisper (the frontend's log-mel).
python3 -m pip wheel -q --no-deps -w .official/whl antlr4-python3-runtime==4.9.3 openai-whisper==20250625
du -sh .official/src .official/whl
ls .official/whl
