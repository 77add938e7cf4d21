#!/usr/bin/env bash
# Installs what is missing, configures and builds gpt2attn into ./build (or $GPT2ATTN_BUILD_DIR).
# Usage: scripts/build.sh [cmake targets...]   (default: everything)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${GPT2ATTN_BUILD_DIR:-$root/build}
bash "$root/scripts/install-deps.sh"
# GPT2ATTN_WERROR=ON (CI sets it) turns warnings into errors, so a new warning cannot land.
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGPT2ATTN_WERROR="${GPT2ATTN_WERROR:-OFF}" >/dev/null
jobs=$(nproc)
if (($#)); then
  for t in "$@"; do cmake --build "$build" --target "$t" -j"$jobs"; done
else
  cmake --build "$build" -j"$jobs"
fi
