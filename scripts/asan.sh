#!/usr/bin/env bash
# The whole ctest suite under AddressSanitizer + UndefinedBehaviorSanitizer: configures build-asan/ with the `asan`
# preset (CMakePresets.json), builds everything but the benchmarks and runs the `asan` test preset. Any report
# fails the run (halt_on_error, -fno-sanitize-recover). The allocation test is not built there: it replaces malloc,
# as ASan does.
# Usage: scripts/asan.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset asan >/dev/null
cmake --build --preset asan -j"$(nproc)"
ctest --preset asan -j"$(nproc)" "$@"
