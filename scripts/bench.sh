#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs `gpt2attn bench` over the GPT-2 presets
# (and gpt3-175b at a small T), with each case checked against the naive reference.
# Extra arguments go to `gpt2attn bench` (e.g. --seq 512 --threads 1 --json).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${GPT2ATTN_BUILD_DIR:-$root/build}
bash "$root/scripts/build.sh" gpt2attn_cli
"$build/gpt2attn" bench "$@"
