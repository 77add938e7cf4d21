#!/usr/bin/env bash
# The whole test suite: installs what is missing, builds, and runs every test under ctest
# (GoogleTest suites for every compiled instruction set, and PyTorch parity through the CLI).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${GPT2ATTN_BUILD_DIR:-$root/build}
bash "$root/scripts/build.sh" gpt2attn_cli gpt2attn_tests
cd "$build"
ctest --output-on-failure -j"$(nproc)" "$@"
