#!/usr/bin/env bash
# The whole ctest suite under AddressSanitizer + UndefinedBehaviorSanitizer: configures build-asan/ with the `asan`
# preset (CMakePresets.json), builds everything but the benchmarks and runs the `asan` test preset. Any report
# fails the run (halt_on_error, -fno-sanitize-recover). allocator_may_return_null=1: the library checks every
# allocation and refuses with out_of_memory, which the tests check; ASan's default aborts on a huge request instead.
# The allocation test is not built there: it replaces malloc, as ASan does.
# Usage: scripts/asan.sh [extra ctest arguments]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash scripts/install-deps.sh
cmake --preset asan >/dev/null
cmake --build --preset asan -j"$(nproc)"
ctest --preset asan -j"$(nproc)" "$@"
