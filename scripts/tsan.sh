#!/usr/bin/env bash
# The concurrency tests (suite KvCacheConcurrency: caller threads sharing one layer and one KvCache) under
# ThreadSanitizer: configures build-tsan/ with the `tsan` preset (CMakePresets.json), builds gpt2attn_tests and
# runs the `tsan` test preset. Any report fails the run (halt_on_error). The tests use threads=1 per call: libgomp
# is not instrumented, so TSan cannot see the synchronisation inside OpenMP teams and would report false races.
# Usage: scripts/tsan.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset tsan >/dev/null
cmake --build --preset tsan -j"$(nproc)"
ctest --preset tsan "$@"
