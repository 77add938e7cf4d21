#!/usr/bin/env bash
# The concurrency tests (suite KvCacheConcurrency: caller threads sharing one layer and one KvCache, each call on
# a team of 2; ModelKvCacheConcurrency: threads creating, extending and releasing sequences of one model cache) and
# the engine's thread team (suite Team) under ThreadSanitizer: configures build-tsan/ with the `tsan` preset
# (CMakePresets.json), builds gpt2attn_tests and gpt2attn_model_tests and runs the `tsan` test preset. Any report fails the run
# (halt_on_error). The team is std::thread and atomics, which TSan sees; oneDNN's GEMMs run single-threaded on it.
# Usage: scripts/tsan.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j"$(nproc)"
ctest --preset tsan "$@"
